"""hidden's store ``.cache/hidden/<fingerprint>/`` (its name: ``extract.fingerprint``): shards of states by content.

A sequence's key is the hash of its ids and loss mask (``sequence_key``). A shard's safetensors metadata ``content``
({keys, failed}) lists its samples and the sequences that failed in it, so the store is its own index (``scan``): a
run computes only the sequences no shard holds, whatever the order, split or shard layout merge gives the data.

The plan (``plan``, rank 0 holds the store's lock): the missing sequences (unique keys, in ``data/sequences`` order)
cut into shards of at most ``hidden.shard_tokens`` tokens, saved under the sequences' hash and ``shard_tokens``
(``plans/``) so a resumed run computes the same shards; then the sequences that failed before (``retry_plan``). A
shard is named by the hash of its keys and written atomically (``write_shard``): one that exists is finished, and a
killed process loses only the shard it was writing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eaglepipe.core import runtime
from eaglepipe.core.records import write_json
from eaglepipe.dataset import sequences, shards


@dataclass(frozen=True)
class KeyedSequence:
    """A sample of ``data/sequences`` and its content key (``sequence_key``: ids and mask only, never the engine's
    figures, so that states stay content-addressed)."""

    id: str
    ids: torch.Tensor  # int32 [n]
    mask: torch.Tensor  # uint8 [n], the loss mask
    key: str
    engine_logprob: torch.Tensor | None = None  # float32 [n] (dataset/sequences.py); None in older data/sequences


Splits = dict[str, list[KeyedSequence]]
"""``data/sequences`` read by ``read_sequences``: each split's samples in stored order."""


@dataclass(frozen=True)
class Row:
    """Where the store holds a sequence's states: row ``row`` of the shard file ``file``."""

    file: str
    row: int


@dataclass(frozen=True)
class Failure:
    """A sequence that failed alone: why, and the shard file whose metadata says so."""

    reason: str
    shard: str


@dataclass(frozen=True)
class Contents:
    """What the finished shards of a store hold (``scan``): the row of each key held, and the keys no shard holds
    that failed alone."""

    held: dict[str, Row]
    failed: dict[str, Failure]


@dataclass(frozen=True)
class Plan:
    """This run's shards, each the keys of its samples in order: the saved plan, then the retry plan; and the shard
    files the store held before any rank wrote one."""

    shards: list[list[str]]
    existing: frozenset[str]

    @property
    def missing(self) -> list[list[str]]:
        """The shards of the plan that the store does not hold yet."""
        return [keys for keys in self.shards if shard_name(keys) not in self.existing]


def sequence_key(ids, mask) -> str:
    """A sequence's content key: the sha256 of its ids (int32) and loss mask (uint8) bytes, 32 hex digits."""
    h = hashlib.sha256(torch.as_tensor(ids).to(torch.int32).numpy().tobytes())
    h.update(torch.as_tensor(mask).to(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def read_sequences(seq_folder: Path) -> Splits:
    """Every split of ``seq_folder`` (``data/sequences``), its samples in stored order, each with its key."""
    index = shards.load_index(seq_folder)
    return {
        split: [
            KeyedSequence(s.id, s.ids, s.mask, sequence_key(s.ids, s.mask), s.engine_logprob)
            for s in sequences.read_samples(seq_folder, split)
        ]
        for split in shards.SPLITS
        if split in index
    }


def shard_name(keys: list[str]) -> str:
    """A shard's file name: the hash of its keys."""
    return f"shard-{hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:16]}.safetensors"


def content(path: Path) -> dict:
    """A finished shard's metadata ``content``: {keys: the samples it holds, failed: [{key, tokens, reason}]}."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta.get("content", '{"keys": [], "failed": []}'))


def write_shard(store: Path, keys: list[str], tensors: dict, failed: list[dict]) -> None:
    """Write the shard of ``keys``: ``tensors`` (``extract.extract_shard``'s) and the metadata ``content`` naming the
    samples it holds and those that ``failed`` alone ([{id, tokens, reason}])."""
    gone = {f["id"] for f in failed}
    listed = {
        "keys": [k for k in keys if k not in gone],
        "failed": [{"key": f["id"], "tokens": f["tokens"], "reason": f["reason"]} for f in failed],
    }
    # one metadata key: safetensors writes several in no fixed order
    shards.write(store / shard_name(keys), tensors, {"content": json.dumps(listed)})


def scan(store: Path) -> Contents:
    """The ``Contents`` of the finished shards in ``store``, from their metadata. A key some shard holds is not
    failed; a failure names a shard that holds samples too where there is one (a retry's shard of failures alone is
    never published)."""
    held, failed = {}, {}
    listed = {path.name: content(path) for path in sorted(store.glob("shard-*.safetensors"))}
    with_samples_first = sorted(listed, key=lambda name: not listed[name]["keys"])
    for name in with_samples_first:
        for row, key in enumerate(listed[name]["keys"]):
            held.setdefault(key, Row(name, row))
        for fail in listed[name]["failed"]:
            failed.setdefault(fail["key"], Failure(fail["reason"], name))
    return Contents(held, {key: fail for key, fail in failed.items() if key not in held})


def shards_of(seqs: Splits, wanted: set[str], shard_tokens: int) -> list[list[str]]:
    """The ``wanted`` keys, each once, in the order of ``seqs``, cut into shards of at most ``shard_tokens`` tokens."""
    lengths = {}
    for split in seqs.values():
        for seq in split:
            if seq.key in wanted:
                lengths.setdefault(seq.key, len(seq.ids))
    keys = list(lengths)
    return [keys[a:b] for a, b in shards.plan(list(lengths.values()), shard_tokens)]


def make_plan(store: Path, plan_path: Path, seqs: Splits, shard_tokens: int) -> list[list[str]]:
    """The shards to compute: the saved plan when its unfinished shards hold exactly the keys the store lacks (a
    resumed run), else a new plan of them, saved. Failed sequences are ``retry_plan``'s."""
    found = scan(store)
    lacking = {seq.key for split in seqs.values() for seq in split} - found.held.keys() - found.failed.keys()
    fresh = shards_of(seqs, lacking, shard_tokens)
    if plan_path.exists():
        saved = json.loads(plan_path.read_text())
        unfinished = {k for keys in saved if not (store / shard_name(keys)).exists() for k in keys}
        if unfinished == {k for keys in fresh for k in keys}:
            return saved
    write_json(plan_path, fresh)
    return fresh


def retry_plan(store: Path, seqs: Splits, shard_tokens: int) -> list[list[str]]:
    """Shards of the sequences that failed before and no shard holds: each run retries them (a server fault or a
    passing lack of memory heals), after the plan, so a resumed run publishes what an uninterrupted one does."""
    return shards_of(seqs, set(scan(store).failed), shard_tokens)


def clear_unfinished(store: Path) -> None:
    """Delete what a stopped run left half-written (under the lock no other run is writing) and the shards of
    failures alone, so that they are computed again."""
    for stale in store.glob("**/*.tmp*"):
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    for path in store.glob("shard-*.safetensors"):
        if not content(path)["keys"]:
            path.unlink()


def plan(store: Path, seq_folder: Path, seqs: Splits, shard_tokens: int, rt: runtime.Runtime) -> Plan:
    """This run's ``Plan``, the same on every rank. Rank 0 first clears what is unfinished (``clear_unfinished``)
    and writes the plan."""
    plan_path = store / "plans" / f"{shards.dataset_hash(seq_folder)[:32]}-{shard_tokens}.json"
    if rt.is_main:
        clear_unfinished(store)
        make_plan(store, plan_path, seqs, shard_tokens)
    rt.barrier()  # the plan is written before any rank reads it
    planned = json.loads(plan_path.read_text()) + retry_plan(store, seqs, shard_tokens)
    existing = frozenset(path.name for path in store.glob("shard-*.safetensors"))
    rt.barrier()  # every rank has listed the finished shards before any is written
    return Plan(planned, existing)
