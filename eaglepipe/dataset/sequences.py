"""Training sequences: responses -> ``prompt_ids + output_ids`` with a loss mask, shuffled, split, in shards.

Layout of ``data/sequences/`` (a sharded dataset, format: ``shards.py``):
    index.json                       {"train": {"shards": [...], "samples", "tokens"}, "valid": {...}, "policy": {...}}
    train-00000.safetensors, ...     per shard: input_ids int32 [tokens], loss_mask uint8 [tokens],
                                     engine_logprob float32 [tokens], offsets int64 [samples + 1] (sample i is
                                     input_ids[offsets[i]:offsets[i+1]])
    each shard entry in index.json lists its file, samples, tokens, and the record ids and sources in order.

``engine_logprob``: the engine's own log-probability of each output id (the records' ``logprobs``), NaN on prompt
ids, on an appended end-of-turn id, where the engine gave no figure, and everywhere for a record without figures
(answers cached before engines reported them). hidden checks them against the states' model
(hidden/agreement.py); its own shards never store them (their bytes depend on the ids alone).

Policy: never re-tokenised from text. ``loss_mask`` is 1 exactly on the output ids (reasoning, answer, end-of-turn
token). Counted: a ``stop`` record whose output lacks the end-of-turn id gets it appended; ``abort`` records are left
out; sequences longer than ``merge.max_length`` are truncated to it; a record whose prompt leaves no room for
``MIN_TRAINED`` output tokens is left out (``has_room``, which infer applies before generating). The split is drawn
per prompt by a seeded hash of its id (adding data never moves a record; one prompt's answers never straddle the
splits); the order within a split is a seeded shuffle. index.json's ``policy`` (merge.py) holds these numbers and
what the records say of the run that generated them: its ``sampling``, its ``engines`` and how many records carry
engine figures; and ``engine_dtype``, the dtype the engine computed in as infer's engine.json says ("float32",
"bfloat16", "float16"; null: unknown), which sets the agreement check's tolerance (hidden/comparison.py).

Turns (``infer.turns: all``, records ``<id>@1``, ``<id>@2``, ...): a turn whose prompt ids extend the previous turn's
prompt and output ids token for token joins its sequence as another masked segment (``join_turns``); otherwise it is
its own sequence. Either way every trained id sits in the context the target generated it in (and keeps the figure
the engine gave it there).
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from eaglepipe.core.records import Response, prompt_of, write_json
from eaglepipe.dataset import shards


def _unit(seed: int, salt: str, rid: str) -> float:
    """A number in [0, 1) fixed by (seed, salt, id)."""
    return int(hashlib.sha256(f"{seed}:{salt}:{rid}".encode()).hexdigest()[:12], 16) / 16**12


WINDOW = 64  # samples sorted by length together (plan_batches)
MIN_TRAINED = 2  # output tokens a sequence needs for one trained position (the drafter predicts t+2 from t)
ENGINE_LOGPROB = "engine_logprob"  # the shards' column of engine figures (module docstring)
NO_FIGURE = float("nan")


@dataclass(frozen=True)
class Sequence:
    """One training sequence: its record's id and source, ``ids`` (prompt then output ids), the loss ``mask`` (1 on
    the output ids) and ``engine_logprob`` (the engine's figure of each id, NaN where none; None: no figure at all).
    Lists while merge builds it, tensors once read (``read_samples``)."""

    id: str
    source: str
    ids: list
    mask: list
    engine_logprob: list | None = None


def as_sequence(item) -> Sequence:
    """``item`` itself, or the ``Sequence`` of a tuple (id, source, ids, mask[, engine_logprob])."""
    return item if isinstance(item, Sequence) else Sequence(*item)


def has_room(prompt_tokens: int, max_length: int) -> bool:
    """Whether a prompt of this length leaves room for a trainable answer within ``merge.max_length``."""
    return prompt_tokens + MIN_TRAINED <= max_length


def output_figures(r: Response) -> list[float]:
    """The engine's figure of each output id of ``r``, NaN where it gave none (every one for a record without)."""
    if r.logprobs is None:
        return [NO_FIGURE] * len(r.output_ids)
    return [NO_FIGURE if x is None else float(x) for x in r.logprobs]


def build(r: Response, end_of_turn: int, max_length: int, counts: Counter) -> Sequence | None:
    """The ``Sequence`` of one record, or None when it is left out (the reason is counted)."""
    if r.finish_reason == "abort":
        counts["left_out_abort"] += 1
        return None
    output, figures = list(r.output_ids), output_figures(r)
    if r.finish_reason == "stop" and (not output or output[-1] != end_of_turn):
        output.append(end_of_turn)
        figures.append(NO_FIGURE)  # merge's, not the engine's
        counts["end_of_turn_appended"] += 1
    if not has_room(len(r.prompt_ids), max_length):
        counts["left_out_prompt_too_long"] += 1
        return None
    ids = list(r.prompt_ids) + output
    mask = [0] * len(r.prompt_ids) + [1] * len(output)
    engine_logprob = [NO_FIGURE] * len(r.prompt_ids) + figures
    if len(ids) > max_length:
        counts["truncated"] += 1
        ids, mask, engine_logprob = ids[:max_length], mask[:max_length], engine_logprob[:max_length]
    return Sequence(r.id, r.source, ids, mask, engine_logprob)


def join_turns(turns: list[Sequence], counts: Counter) -> list[Sequence]:
    """The built turns of one conversation, in turn order, as training sequences: a turn whose ids extend the
    sequence before it joins it as one more masked segment (the sequence takes its id and source; the ids it shares
    keep the earlier turns' mask and figures); any other starts its own. Later turns are counted as ``turns_joined``
    or ``turns_apart``."""
    out = []
    for turn in turns:
        if out:
            prev = out[-1]
            cut = len(prev.ids)
            joins = len(turn.ids) > cut and turn.ids[:cut] == prev.ids
            counts["turns_joined" if joins else "turns_apart"] += 1
            if joins:
                mask = prev.mask + turn.mask[cut:]
                out[-1] = replace(turn, mask=mask, engine_logprob=prev.engine_logprob + turn.engine_logprob[cut:])
                continue
        out.append(turn)
    return out


def split_and_shuffle(records: list[Sequence], seed: int, valid_fraction: float) -> dict:
    """{"train": [...], "valid": [...]} of the sequences, each in seeded shuffled order; drawn per prompt."""
    splits = {"train": [], "valid": []}
    for rec in records:
        splits["valid" if _unit(seed, "split", prompt_of(rec.id)) < valid_fraction else "train"].append(rec)
    for items in splits.values():
        items.sort(key=lambda rec: _unit(seed, "order", rec.id))
    return splits


def pack(seqs) -> dict[str, torch.Tensor]:
    """The tensors of one shard of [(input_ids, loss_mask)]: ``input_ids`` int32 [T], ``loss_mask`` uint8 [T] and
    ``offsets`` int64 [n + 1] (hidden's shards start with these)."""
    return {
        "input_ids": shards.concat([ids for ids, _ in seqs], torch.int32),
        "loss_mask": shards.concat([mask for _, mask in seqs], torch.uint8),
        "offsets": shards.offsets([len(ids) for ids, _ in seqs]),
    }


def figures_column(seqs: list[Sequence]) -> torch.Tensor:
    """float32 [T]: the ``engine_logprob`` of the sequences, concatenated, NaN for a sequence without any."""
    rows = [[NO_FIGURE] * len(s.ids) if s.engine_logprob is None else s.engine_logprob for s in seqs]
    return shards.concat(rows, torch.float32)


def write(folder: Path, splits: dict, shard_tokens: int, policy: dict) -> dict:
    """Store the splits ({name: [Sequence or (id, source, ids, mask[, engine_logprob])]}) and index.json under
    ``folder``; return the index. ``policy``: what the sequences were built with and from (merge.py). An empty split
    gets one empty shard."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index = {"policy": policy}
    for name, listed in splits.items():
        items, entries = [as_sequence(item) for item in listed], []
        for k, (a, b) in enumerate(shards.plan([len(s.ids) for s in items], shard_tokens) or [(0, 0)]):
            chunk, file = items[a:b], f"{name}-{k:05d}.safetensors"
            tensors = {**pack([(s.ids, s.mask) for s in chunk]), ENGINE_LOGPROB: figures_column(chunk)}
            shards.write(folder / file, tensors)
            entries.append(
                {
                    "file": file,
                    "samples": len(chunk),
                    "tokens": sum(len(s.ids) for s in chunk),
                    "ids": [s.id for s in chunk],
                    "sources": [s.source for s in chunk],
                }
            )
        index[name] = {"shards": entries, "samples": len(items), "tokens": sum(s["tokens"] for s in entries)}
    write_json(folder / "index.json", index)
    return index


def read_samples(folder: Path, split: str) -> Iterator[Sequence]:
    """Every sample of a split, in stored order, as a ``Sequence`` of tensors: ``ids`` int32, ``mask`` uint8,
    ``engine_logprob`` float32 (None in sequences merged before the column existed)."""
    for entry, i, rows in shards.samples(folder, split):
        yield Sequence(
            entry["ids"][i], entry["sources"][i], rows["input_ids"], rows["loss_mask"], rows.get(ENGINE_LOGPROB)
        )


def read(folder: Path, split: str):
    """Yield (id, source, input_ids int32 tensor, loss_mask uint8 tensor) for every sample of a split, in stored
    order."""
    for s in read_samples(folder, split):
        yield s.id, s.source, s.ids, s.mask


def holds_figures(folder: Path) -> bool:
    """Whether the shards of ``folder`` have the ``engine_logprob`` column (merged ``data/sequences`` since it
    exists; never ``data/hidden``)."""
    names = shards.files(folder)
    if not names:
        return False
    with safe_open(str(Path(folder) / names[0]), framework="pt") as f:
        return ENGINE_LOGPROB in f.keys()  # noqa: SIM118  safe_open has keys() but is not iterable


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
        for seq in items:
            s = per_source[seq.source]
            s["samples"] += 1
            s["tokens"] += len(seq.ids)
            s["trained_tokens"] += sum(seq.mask)
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
