"""Training sequences: responses -> ``prompt_ids + output_ids`` with a loss mask, shuffled, split, in shards.

Layout of ``data/sequences/`` (a sharded dataset, format: ``shards.py``):
    index.json                       {"train": {"shards": [...], "samples", "tokens"}, "valid": {...}, "policy": {...}}
    train-00000.safetensors, ...     per shard: input_ids int32 [tokens], loss_mask uint8 [tokens],
                                     offsets int64 [samples + 1] (sample i is input_ids[offsets[i]:offsets[i+1]])
    each shard entry in index.json lists its file, samples, tokens, and the record ids and sources in order.

Policy: never re-tokenised from text. ``loss_mask`` is 1 exactly on the output ids (reasoning, answer, end-of-turn
token). Counted: a ``stop`` record whose output lacks the end-of-turn id gets it appended; ``abort`` records are left
out; sequences longer than ``merge.max_length`` are truncated to it; a record whose prompt leaves no room for
``MIN_TRAINED`` output tokens is left out (``has_room``, which infer applies before generating). The split is drawn
per prompt by a seeded hash of its id (adding data never moves a record; one prompt's answers never straddle the
splits); the order within a split is a seeded shuffle.

Turns (``infer.turns: all``, records ``<id>@1``, ``<id>@2``, ...): a turn whose prompt ids extend the previous turn's
prompt and output ids token for token joins its sequence as another masked segment (``join_turns``); otherwise it is
its own sequence. Either way every trained id sits in the context the target generated it in.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

from eaglepipe.core.records import Response, prompt_of, write_json
from eaglepipe.dataset import shards


def _unit(seed: int, salt: str, rid: str) -> float:
    """A number in [0, 1) fixed by (seed, salt, id)."""
    return int(hashlib.sha256(f"{seed}:{salt}:{rid}".encode()).hexdigest()[:12], 16) / 16**12


WINDOW = 64  # samples sorted by length together (plan_batches)
MIN_TRAINED = 2  # output tokens a sequence needs for one trained position (the drafter predicts t+2 from t)


def has_room(prompt_tokens: int, max_length: int) -> bool:
    """Whether a prompt of this length leaves room for a trainable answer within ``merge.max_length``."""
    return prompt_tokens + MIN_TRAINED <= max_length


def build(r: Response, end_of_turn: int, max_length: int, counts: Counter):
    """(input_ids, loss_mask) for one record, or None when it is left out (the reason is counted)."""
    if r.finish_reason == "abort":
        counts["left_out_abort"] += 1
        return None
    output = list(r.output_ids)
    if r.finish_reason == "stop" and (not output or output[-1] != end_of_turn):
        output.append(end_of_turn)
        counts["end_of_turn_appended"] += 1
    if not has_room(len(r.prompt_ids), max_length):
        counts["left_out_prompt_too_long"] += 1
        return None
    ids = list(r.prompt_ids) + output
    mask = [0] * len(r.prompt_ids) + [1] * len(output)
    if len(ids) > max_length:
        counts["truncated"] += 1
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def join_turns(turns: list, counts: Counter) -> list:
    """The built turns of one conversation, (id, source, ids, mask) in turn order, as training sequences: a turn whose
    ids extend the sequence before it joins it as one more masked segment (the sequence takes its id); any other
    starts its own. Later turns are counted as ``turns_joined`` or ``turns_apart``."""
    out = []
    for rid, source, ids, mask in turns:
        if out:
            prev = out[-1][2]
            joins = len(ids) > len(prev) and ids[: len(prev)] == prev
            counts["turns_joined" if joins else "turns_apart"] += 1
            if joins:
                out[-1] = (rid, source, ids, out[-1][3] + mask[len(prev) :])
                continue
        out.append((rid, source, ids, mask))
    return out


def split_and_shuffle(records: list, seed: int, valid_fraction: float) -> dict:
    """{"train": [...], "valid": [...]} of (id, source, ids, mask), each in seeded shuffled order; drawn per prompt."""
    splits = {"train": [], "valid": []}
    for rec in records:
        splits["valid" if _unit(seed, "split", prompt_of(rec[0])) < valid_fraction else "train"].append(rec)
    for items in splits.values():
        items.sort(key=lambda rec: _unit(seed, "order", rec[0]))
    return splits


def pack(seqs) -> dict[str, torch.Tensor]:
    """The tensors of one shard of [(input_ids, loss_mask)]: ``input_ids`` int32 [T], ``loss_mask`` uint8 [T] and
    ``offsets`` int64 [n + 1] (hidden's shards start with these)."""
    return {
        "input_ids": shards.concat([ids for ids, _ in seqs], torch.int32),
        "loss_mask": shards.concat([mask for _, mask in seqs], torch.uint8),
        "offsets": shards.offsets([len(ids) for ids, _ in seqs]),
    }


def write(folder: Path, splits: dict, shard_tokens: int, policy: dict) -> dict:
    """Store the splits and index.json under ``folder``; return the index. ``policy``: the numbers the sequences
    were built with. An empty split gets one empty shard."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index = {"policy": policy}
    for name, items in splits.items():
        entries = []
        for k, (a, b) in enumerate(shards.plan([len(c[2]) for c in items], shard_tokens) or [(0, 0)]):
            chunk, file = items[a:b], f"{name}-{k:05d}.safetensors"
            shards.write(folder / file, pack([(c[2], c[3]) for c in chunk]))
            entries.append(
                {
                    "file": file,
                    "samples": len(chunk),
                    "tokens": sum(len(c[2]) for c in chunk),
                    "ids": [c[0] for c in chunk],
                    "sources": [c[1] for c in chunk],
                }
            )
        index[name] = {"shards": entries, "samples": len(items), "tokens": sum(s["tokens"] for s in entries)}
    write_json(folder / "index.json", index)
    return index


def read(folder: Path, split: str):
    """Yield (id, source, input_ids int32 tensor, loss_mask uint8 tensor) for every sample of a split, in stored
    order."""
    for entry, i, rows in shards.samples(folder, split):
        yield entry["ids"][i], entry["sources"][i], rows["input_ids"], rows["loss_mask"]


def stats(splits: dict, counts: Counter) -> dict:
    out = {
        "left_out": {k: v for k, v in counts.items() if k.startswith("left_out")},
        "truncated": counts["truncated"],
        "end_of_turn_appended": counts["end_of_turn_appended"],
    }
    if counts["turns_joined"] or counts["turns_apart"]:
        out["turns"] = {"joined": counts["turns_joined"], "apart": counts["turns_apart"]}
    for name, items in splits.items():
        per_source = defaultdict(lambda: {"samples": 0, "tokens": 0, "trained_tokens": 0})
        for _rid, source, ids, mask in items:
            s = per_source[source]
            s["samples"] += 1
            s["tokens"] += len(ids)
            s["trained_tokens"] += sum(mask)
        out[name] = {
            "samples": len(items),
            "tokens": sum(s["tokens"] for s in per_source.values()),
            "trained_tokens": sum(s["trained_tokens"] for s in per_source.values()),
            "per_source": dict(sorted(per_source.items())),
        }
    return out


def plan_batches(lengths: list[int], batch_tokens: int, seed: int | None = None, epoch: int = 0) -> list[list[int]]:
    """Sample indices in right-padded batches of at most ``batch_tokens`` (rows x longest). With a seed: shuffled
    (by seed and epoch), sorted by length within windows, batches in shuffled order; without: sorted by length."""
    rng = None if seed is None else np.random.default_rng([seed, epoch])
    order = list(range(len(lengths))) if rng is None else rng.permutation(len(lengths)).tolist()
    window = WINDOW if rng is not None else max(1, len(order))
    batches = []
    for w in range(0, len(order), window):
        batch = []
        for i in sorted(order[w : w + window], key=lambda i: -lengths[i]):
            if batch and (len(batch) + 1) * lengths[batch[0]] > batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        batches.append(batch)
    return batches if rng is None else [batches[i] for i in rng.permutation(len(batches))]
