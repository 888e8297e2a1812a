"""Offset-packed safetensors shards: the storage format of ``data/sequences`` and ``data/hidden``.

A sharded dataset is a folder holding ``index.json`` and shard files. ``index.json`` maps each split of ``SPLITS``
it has to ``{"shards": [{"file", "samples", "tokens", "ids", "rows"?, ...}], "samples", "tokens"}``, next to whatever
else its writer records. A shard is one safetensors file of flat per-token tensors (first dimension T, the shard's
samples concatenated) plus ``offsets`` int64 [samples + 1]: sample i of the file is rows ``offsets[i]:offsets[i + 1]``
of every other tensor. An entry names the split's next ``samples`` samples, in stored order: ``ids[j]`` is sample
``rows[j]`` of ``file`` (without ``rows``: sample j, the whole file in order). Entries may name a file more than once
and in part (data/hidden's content-addressed shards, hidden/extract.py). A shard is written atomically (a temporary file
renamed into place, so a shard that exists is complete), with mode 0644; its bytes depend on its tensors and on the
string metadata its writer gives (data/hidden's: the content keys of its samples), nothing else.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglepipe.core.config import DIGESTS
from eaglepipe.core.hashing import file_digest

SPLITS = ("train", "valid")


def plan(lengths: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges over samples of these lengths, each up to ``max_tokens`` tokens and at least
    one sample (no range for no samples)."""
    ranges, start = [], 0
    while start < len(lengths):
        end, tokens = start, 0
        while end < len(lengths) and (tokens == 0 or tokens + lengths[end] <= max_tokens):
            tokens += lengths[end]
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def offsets(lengths: list[int]) -> torch.Tensor:
    """int64 [n + 1]: where each of n samples of these lengths starts, then the total."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)


def concat(rows, dtype: torch.dtype) -> torch.Tensor:
    """One flat tensor of ``dtype`` from per-sample rows (lists, numpy arrays or tensors); empty for no rows."""
    return torch.cat([torch.as_tensor(r).to(dtype).reshape(-1) for r in rows]) if rows else torch.zeros(0, dtype=dtype)


def write(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write one shard atomically (see the module docstring)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o644)  # safetensors creates files readable by their owner only
    os.replace(tmp, path)


def load_index(folder) -> dict:
    return json.loads((Path(folder) / "index.json").read_text())


def rows_of(entry: dict) -> list[int]:
    """The samples of ``entry``'s file it names, in order (module docstring)."""
    return entry.get("rows", list(range(entry["samples"])))


def samples(folder, split: str) -> Iterator[tuple[dict, int, dict[str, torch.Tensor]]]:
    """Yield (shard entry, j, {name: rows of its j-th sample} for every tensor but ``offsets``) for every sample of
    ``split`` in stored order, reading only those rows."""
    folder = Path(folder)
    for entry in load_index(folder)[split]["shards"]:
        with safe_open(str(folder / entry["file"]), framework="pt") as f:
            off, names = (
                f.get_tensor("offsets").tolist(),
                [n for n in f.keys() if n != "offsets"],  # noqa: SIM118  safe_open has keys() but is not iterable
            )
        spans = [(off[r], off[r + 1]) for r in rows_of(entry)]
        for j, rows in enumerate(read_rows(folder / entry["file"], names, spans)):
            yield entry, j, rows


def columns(folder, split: str, names) -> Iterator[tuple[dict, list[tuple[int, int]], dict[str, torch.Tensor]]]:
    """Yield (shard entry, the row span of each of its samples, {name: its file's whole tensor} for ``names`` only)
    per entry of ``split``, each file's tensors read once: the other tensors' bytes are not read."""
    folder, loaded = Path(folder), {}
    for entry in load_index(folder)[split]["shards"]:
        if entry["file"] not in loaded:
            with safe_open(str(folder / entry["file"]), framework="pt") as f:
                loaded[entry["file"]] = (f.get_tensor("offsets").tolist(), {name: f.get_tensor(name) for name in names})
        off, tensors = loaded[entry["file"]]
        yield entry, [(off[r], off[r + 1]) for r in rows_of(entry)], tensors


def read_rows(path, names, spans: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
    """Rows ``start:end`` of the tensors ``names`` of one shard file, per span: only those bytes are read (the file
    is mapped while reading and unmapped after, so nothing of it stays in memory but the rows returned)."""
    with safe_open(str(path), framework="pt") as f:
        slices = {name: f.get_slice(name) for name in names}
        return [{name: s[start:end] for name, s in slices.items()} for start, end in spans]


def tokens_held(path) -> int:
    """How many token rows a shard file holds."""
    with safe_open(str(path), framework="pt") as f:
        return int(f.get_tensor("offsets")[-1])


def files(folder) -> list[str]:
    """Every shard file a dataset's index names, once each, in index order."""
    index = load_index(folder)
    return list(dict.fromkeys(s["file"] for split in SPLITS for s in index.get(split, {}).get("shards", [])))


def dataset_hash(folder) -> str:
    """Hash of a sharded dataset's bytes: the digests of ``index.json``, then of its shard files in index order, each
    file read once (``hashing.file_digest``)."""
    folder = Path(folder)
    names = ["index.json", *files(folder)]
    return hashlib.sha256("".join(f"{n}\0{file_digest(folder / n, DIGESTS)}\n" for n in names).encode()).hexdigest()
