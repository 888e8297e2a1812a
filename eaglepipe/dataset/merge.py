"""The merge run: validate every response record, then build, shuffle, split and store training sequences."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from eaglepipe.core.errors import UserError
from eaglepipe.core.records import RecordError, Response, prompt_of, read_jsonl, response_from_json
from eaglepipe.dataset import sequences
from eaglepipe.text import derive

log = logging.getLogger(__name__)
ENGINE_FILE = "engine.json"  # what infer keeps of its engine, beside responses.jsonl (stages/infer.py)
# The dtype names engine.json holds (the hf engine's without its "torch." prefix; a server's --dtype), normalised.
DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


@dataclass(frozen=True)
class EngineRecord:
    """What ``engine.json`` says of the engine that generated the answers: its ``name`` and the ``dtype`` it computed
    in ("float32", "bfloat16", "float16"; None: unknown)."""

    name: str | None = None
    dtype: str | None = None


def _malformed(path: Path, what: str) -> UserError:
    return UserError(f"{path}: {what}; infer writes it beside responses.jsonl with its engine's identity (rerun infer)")


def normalised_dtype(name: str | None) -> str | None:
    """``name`` (as engine.json holds it) as "float32", "bfloat16" or "float16"; None for none, ``auto`` or another
    name."""
    if name is None:
        return None
    return DTYPES.get(name.removeprefix("torch."))


def read_engine(path: Path) -> EngineRecord:
    """The ``EngineRecord`` of infer's engine.json at ``path`` (nothing known where there is none). The dtype is the hf
    engine's ``dtype`` ("torch.float32") or a server engine's ``identity.dtype`` (a launched server's --dtype, what
    an SGLang given by url reports, nothing for a vLLM given by url). A malformed file is a UserError naming it."""
    if not path.exists():
        return EngineRecord()
    try:
        described = json.loads(path.read_bytes())
    except ValueError as e:  # not UTF-8, or not JSON
        raise _malformed(path, f"not JSON ({e})") from None
    if not isinstance(described, dict):
        raise _malformed(path, f"a JSON object expected, found {type(described).__name__}")
    # a server engine keeps its identity under "identity"; the hf engine's is spread at the top (engines/hf.py)
    identity = described.get("identity", described)
    if identity is not None and not isinstance(identity, dict):
        raise _malformed(path, f"its identity should be an object, found {identity!r}")
    dtype = (identity or {}).get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise _malformed(path, f"its dtype should be a string, found {dtype!r}")
    return EngineRecord(described.get("engine"), normalised_dtype(dtype))


@dataclass
class Provenance:
    """What the records of ``path`` say of the infer run that generated them (index.json's policy): its sampling
    (one for every record: merge takes the answers of one run), the engines named in their meta, and how many carry
    the engine's log-probabilities; with the ``engine`` its engine.json describes, the dtype they were computed in."""

    path: Path
    engine: EngineRecord = field(default_factory=EngineRecord)
    sampling: dict | None = None
    engines: set = field(default_factory=set)
    with_figures: int = 0
    without_figures: int = 0

    def add(self, r: Response, line: int) -> None:
        """Count record ``r``, read at ``line``; a sampling other than the records' before it is an error."""
        if self.sampling is None:
            self.sampling = r.sampling
        elif r.sampling != self.sampling:
            raise UserError(
                f"{self.path}:{line}: record {r.id} was sampled with {r.sampling}, the records before it with "
                f"{self.sampling}: merge takes the answers of one infer run (one sampling policy); rerun infer"
            )
        if "engine" in r.meta:
            self.engines.add(str(r.meta["engine"]))
        if r.logprobs is None:
            self.without_figures += 1
        else:
            self.with_figures += 1

    def policy(self) -> dict:
        """index.json's provenance keys; ``engine_dtype`` is None where the records name another engine than
        engine.json's (a file left from another run)."""
        engines = sorted(self.engines)
        same_engine = engines in ([], [self.engine.name])
        return {
            "sampling": self.sampling or {},
            "engines": engines,
            "engine_logprobs": {"records_with": self.with_figures, "records_without": self.without_figures},
            "engine_dtype": self.engine.dtype if same_engine else None,
        }


def run(responses_path: Path, out: Path, tokenizer, spec: derive.Spec, end_of_turn: int, params) -> dict:
    """Write the sequences under ``out``; return the dataset statistics. ``params``: the ``merge`` section
    (config.Merge). An inconsistent record is an error. The engine's dtype comes from the engine.json beside
    ``responses_path``."""
    counts, records, conversation, key, read = Counter(), [], [], None, 0
    provenance = Provenance(responses_path, read_engine(responses_path.parent / ENGINE_FILE))
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
        provenance.add(r, n)
        if (prompt_of(r.id), r.sample) != key:  # infer writes a conversation's turns together, in order
            records += sequences.join_turns(conversation, counts)
            conversation, key = [], (prompt_of(r.id), r.sample)
        built = sequences.build(r, end_of_turn, params.max_length, counts)
        if built:
            conversation.append(built)
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
        **provenance.policy(),
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
