"""``data/hidden`` from hidden's store (store.py): hard links to (or copies of) the shards its sequences use, and an
index naming, in ``data/sequences`` order, each sample's shard row (format: layout.py, dataset/shards.py); or, with
``train.features: online``, only an index saying why it holds no states (``skip``)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from eaglepipe.core.records import write_json, write_jsonl
from eaglepipe.dataset import shards
from eaglepipe.hidden import store

SKIPPED = "train.features is online or streamed: train has the states computed as it goes, hidden extracts nothing"


@dataclass
class Published:
    """What ``data/hidden`` gets: ``index`` (index.json: its header, then each split's entries), the shard ``files``
    the entries name, in order, and the ``failures`` left out (failures.jsonl); and how many of its sequences were
    ``reused_sequences``, in shards the store held before this run."""

    index: dict
    files: list[str] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    reused_sequences: int = 0

    @property
    def splits(self) -> list[str]:
        return [split for split in shards.SPLITS if split in self.index]

    @property
    def samples(self) -> int:
        return sum(self.index[split]["samples"] for split in self.splits)

    @property
    def tokens(self) -> int:
        return sum(self.index[split]["tokens"] for split in self.splits)


def index_of(store_dir: Path, seqs: store.Splits, existing: frozenset[str], header: dict) -> Published:
    """``header`` followed by each split's entries (each sequence's shard and row, in order), from the store
    ``store_dir``; ``existing``: the shard files it held before this run."""
    found = store.scan(store_dir)
    published = Published(index=dict(header))
    for split, items in seqs.items():
        entries = []
        for seq in items:
            if seq.key in found.failed:
                failure = found.failed[seq.key]
                published.failures.append(
                    {"id": seq.id, "shard": failure.shard, "tokens": len(seq.ids), "reason": failure.reason}
                )
                continue
            row = found.held[seq.key]
            published.reused_sequences += row.file in existing
            if not entries or entries[-1]["file"] != row.file:
                entries.append({"file": row.file, "samples": 0, "tokens": 0, "ids": [], "rows": []})
                published.files.append(row.file)
            _add(entries[-1], seq, row.row)
        published.index[split] = {
            "shards": entries,
            "samples": sum(e["samples"] for e in entries),
            "tokens": sum(e["tokens"] for e in entries),
        }
    published.files = list(dict.fromkeys(published.files))
    return published


def _add(entry: dict, seq: store.KeyedSequence, row: int) -> None:
    """Count ``seq``, stored at ``row`` of the shard of ``entry``, into that index entry."""
    entry["samples"] += 1
    entry["tokens"] += len(seq.ids)
    entry["ids"].append(seq.id)
    entry["rows"].append(row)


def publish(store_dir: Path, out: Path, published: Published) -> None:
    """``out`` = links to the ``published`` shards of the store ``store_dir``, the index and the failures, built
    aside and renamed into place."""
    work = store_dir / f"publish.tmp{os.getpid()}"
    work.mkdir()
    for f in published.files:
        try:
            os.link(store_dir / f, work / f)
        except OSError:  # a filesystem without hard links, or a file linked too often
            shutil.copy2(store_dir / f, work / f)
    if published.failures:
        write_jsonl(work / "failures.jsonl", published.failures)
    write_json(work / "index.json", published.index)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(work), str(out))  # a rename on the same filesystem


def skip(out) -> dict:
    """Online or streamed training: publish ``out`` as only an index saying why it holds no states; return the run
    report."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_json(out / "index.json", {"skipped": SKIPPED})
    return {"skipped": SKIPPED, "samples": 0, "tokens": 0, "run": {"computed_tokens": 0}}
