"""Offset-packed safetensors shards: the storage format of ``data/sequences`` and ``data/hidden``.

A sharded dataset is a folder holding ``index.json`` and shard files. ``index.json`` maps each split of ``SPLITS``
it has to ``{"shards": [{"file", "samples", "tokens", "ids", ...}], "samples", "tokens"}``, next to whatever else
its writer records. A shard is one safetensors file of flat per-token tensors (first dimension T, the shard's
samples concatenated in stored order) plus ``offsets`` int64 [samples + 1]: sample i is rows
``offsets[i]:offsets[i + 1]`` of every other tensor. A shard is written atomically (a temporary file renamed into
place, so a shard that exists is complete), with mode 0644 and no metadata: its bytes depend on its tensors only.
"""
from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .hashing import files_hash

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


def write(path, tensors: dict[str, torch.Tensor]) -> None:
    """Write one shard atomically (see the module docstring)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp))
    os.chmod(tmp, 0o644)  # safetensors creates files readable by their owner only
    os.replace(tmp, path)


def load_index(folder) -> dict:
    return json.loads((Path(folder) / "index.json").read_text())


def read_shards(folder, split: str) -> Iterator[tuple[dict, dict[str, torch.Tensor]]]:
    """Yield (shard entry of index.json, its tensors) per shard of ``split``, one shard in memory at a time."""
    folder = Path(folder)
    for entry in load_index(folder)[split]["shards"]:
        yield entry, load_file(str(folder / entry["file"]))


def samples(folder, split: str) -> Iterator[tuple[dict, int, dict[str, torch.Tensor]]]:
    """Yield (shard entry, i, {name: rows of sample i} for every tensor but ``offsets``) for every sample of
    ``split`` in stored order; the rows are views into the loaded shard (clone what outlives it if memory
    matters)."""
    for entry, t in read_shards(folder, split):
        off = t.pop("offsets").tolist()
        for i in range(len(off) - 1):
            yield entry, i, {name: x[off[i]:off[i + 1]] for name, x in t.items()}


def columns(folder, split: str, names) -> Iterator[tuple[dict, list[int], dict[str, torch.Tensor]]]:
    """Yield (shard entry, offsets as a list, {name: whole tensor} for ``names`` only) per shard of ``split``: the
    other tensors' bytes are not read."""
    folder = Path(folder)
    for entry in load_index(folder)[split]["shards"]:
        with safe_open(str(folder / entry["file"]), framework="pt") as f:
            yield entry, f.get_tensor("offsets").tolist(), {name: f.get_tensor(name) for name in names}


def read_rows(path, names, spans: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
    """Rows ``start:end`` of the tensors ``names`` of one shard file, per span: only those bytes are read (the file
    is mapped while reading and unmapped after, so nothing of it stays in memory but the rows returned)."""
    with safe_open(str(path), framework="pt") as f:
        slices = {name: f.get_slice(name) for name in names}
        return [{name: s[start:end] for name, s in slices.items()} for start, end in spans]


def dataset_hash(folder) -> str:
    """Hash of a sharded dataset's bytes: ``index.json``, then every split's shard files in index order."""
    folder = Path(folder)
    index = load_index(folder)
    return files_hash([folder / "index.json", *(folder / s["file"] for split in SPLITS
                                                 for s in index.get(split, {}).get("shards", []))])
