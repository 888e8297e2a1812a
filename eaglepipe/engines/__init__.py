"""Engines turn prompt id lists into output id lists (the engines: table.py). Every engine has:

    engine.stream(prompts, sampling, rids) -> iterator of (index into prompts, Output | Failure), as they finish

``Output.output_ids`` are exactly the ids the engine produced (a stop token it emitted is kept), ``finish_reason`` is
``stop | length | abort``, ``meta`` is free-form engine metadata kept in the record.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Sampling:
    """Every sampling parameter, explicit. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    seed: int = 0
    stop_token_ids: tuple = ()

    @classmethod
    def from_params(cls, p, stop_token_ids) -> Sampling:
        """From the ``infer`` section (config.Infer)."""
        return cls(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            max_new_tokens=p.max_new_tokens,
            seed=p.seed,
            stop_token_ids=tuple(sorted(stop_token_ids)),
        )

    def to_json(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d


@dataclass
class Output:
    output_ids: list
    finish_reason: str
    meta: dict = field(default_factory=dict)


@dataclass
class Failure:
    """A prompt the engine gave up on (after its retries); the reason goes to the failures file."""

    reason: str


def seed_for(seed: int, record_id: str) -> int:
    """The seed of record ``record_id``'s own sampling generator in every engine, so an answer never depends on batch
    mates, order, resumes or concurrency."""
    return int(hashlib.sha256(f"{seed}:{record_id}".encode()).hexdigest()[:8], 16)
