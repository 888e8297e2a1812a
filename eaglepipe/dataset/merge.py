"""The merge run: validate every response record, then build, shuffle, split and store training sequences."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from eaglepipe.core.errors import UserError
from eaglepipe.core.records import RecordError, prompt_of, read_jsonl, response_from_json
from eaglepipe.dataset import sequences
from eaglepipe.text import derive

log = logging.getLogger(__name__)


def run(responses_path: Path, out: Path, tokenizer, spec: derive.Spec, end_of_turn: int, params) -> dict:
    """Write the sequences under ``out``; return the dataset statistics. ``params``: the ``merge`` section
    (config.Merge). An inconsistent record is an error."""
    counts, records, conversation, key, read = Counter(), [], [], None, 0
    for n, obj in tqdm(read_jsonl(responses_path), desc="merge", unit="record"):
        r, read = response_from_json(obj, responses_path, n), read + 1
        bad = derive.mismatch(r, tokenizer, spec)
        if bad:
            raise RecordError(
                responses_path,
                n,
                bad,
                f"of record {r.id} does not match what its output_ids give "
                f"under target.reasoning; the record is inconsistent (re-run infer)",
            )
        if (prompt_of(r.id), r.sample) != key:  # infer writes a conversation's turns together, in order
            records += sequences.join_turns(conversation, counts)
            conversation, key = [], (prompt_of(r.id), r.sample)
        built = sequences.build(r, end_of_turn, params.max_length, counts)
        if built:
            conversation.append((r.id, r.source, *built))
    records += sequences.join_turns(conversation, counts)
    dropped = {k: v for k, v in counts.items() if k.startswith("left_out")}
    if not records or sum(dropped.values()) > params.max_left_out * read:  # fail here, not two stages later
        raise UserError(
            f"{responses_path}: {sum(dropped.values())} of {read} records would be left out {dropped}, "
            f"more than merge.max_left_out {params.max_left_out}: nothing is written"
        )
    splits = sequences.split_and_shuffle(records, params.seed, params.valid_fraction)
    policy = {
        "end_of_turn_id": end_of_turn,
        "max_length": params.max_length,
        "seed": params.seed,
        "valid_fraction": params.valid_fraction,
    }
    sequences.write(out, splits, params.shard_tokens, policy)
    stats = sequences.stats(splits, counts)
    log.info(
        "merged %d records: %d train, %d valid samples; %s",
        read,
        stats["train"]["samples"],
        stats["valid"]["samples"],
        dict(counts),
    )
    return stats
