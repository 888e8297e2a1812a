"""The agreement check's fallback for sampled answers without engine figures (answers cached before engines reported
them): the target's likelihood of the tokens against what the sampling params make likely (agreement.py).

Under the target's own sampler distribution q at an answer position (``sampler_probs``: temperature, then min-p,
top-k and top-p from the run's sampling policy, as the hf engine's ``pick`` draws), a token the target itself drew has
log q(token) with expectation E_q[log q] and variance Var_q[log q]. Over a record's answer tokens,
z = sum(log q(token) - E) / sqrt(sum Var) is about standard normal when the engine computed the target's
distribution; a record of at least ``MIN_TOKENS`` scored tokens with |z| above ``Z_LIMIT`` is flagged. A token outside
q's support (q = 0: the target could never have drawn it) is counted apart, not scored. Computed in the forward, so
for the sequences a run computes only (a reused one is not checked again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Z_LIMIT = 6.0
MIN_TOKENS = 16  # scored tokens a record needs before its z is judged
ROWS = 512  # positions whose distributions are held at once ([ROWS, vocabulary] float32)


@dataclass(frozen=True)
class Tally:
    """One record's fallback figures: the answer ``tokens`` scored, the sum of their log q less its expectation
    (``deviation``), the sum of the variances, and the tokens ``outside`` q's support."""

    tokens: int = 0
    deviation: float = 0.0
    variance: float = 0.0
    outside: int = 0

    @property
    def z(self) -> float | None:
        """The record's z score (None with nothing scored)."""
        return self.deviation / math.sqrt(self.variance) if self.variance > 0 else None

    @property
    def flagged(self) -> bool:
        return self.tokens >= MIN_TOKENS and self.z is not None and abs(self.z) > Z_LIMIT

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.tokens + other.tokens,
            self.deviation + other.deviation,
            self.variance + other.variance,
            self.outside + other.outside,
        )


def sampler_probs(logits: torch.Tensor, sampling: dict) -> torch.Tensor:
    """q [n, V]: the distribution the sampler draws from over float32 ``logits`` [n, V] under ``sampling`` (a record's
    ``sampling`` dict, temperature > 0): softmax at the temperature, less what min-p, top-k and top-p rule out,
    renormalised."""
    probs = torch.softmax(logits.float() / sampling["temperature"], -1)
    min_p, top_k, top_p = sampling.get("min_p", 0.0), sampling.get("top_k", -1), sampling.get("top_p", 1.0)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    if top_k > 0 or top_p < 1.0:
        ranked, order = probs.sort(-1, descending=True)
        if top_k > 0:
            ranked[:, top_k:] = 0.0
        if top_p < 1.0:
            ranked = ranked.masked_fill(ranked.cumsum(-1) - ranked > top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
    return probs / probs.sum(-1, keepdim=True)


def score_rows(logits: torch.Tensor, tokens: torch.Tensor, sampling: dict) -> Tally:
    """The ``Tally`` of ``tokens`` [n], each drawn from the distribution of its row of ``logits`` [n, V]."""
    q = sampler_probs(logits, sampling)
    log_q = torch.log(q)
    held = q > 0
    expected = torch.where(held, q * log_q, 0.0).sum(-1)
    variance = (torch.where(held, q * log_q.square(), 0.0).sum(-1) - expected.square()).clamp(min=0.0)
    chosen = log_q.gather(-1, tokens.to(device=logits.device, dtype=torch.long)[:, None])[:, 0]
    inside = torch.isfinite(chosen)
    return Tally(
        tokens=int(inside.sum()),
        deviation=float((chosen - expected)[inside].double().sum()),
        variance=float(variance[inside].double().sum()),
        outside=int((~inside).sum()),
    )


def score(logits_at, positions: torch.Tensor, ids: torch.Tensor, sampling: dict) -> Tally:
    """The ``Tally`` of the tokens ``ids[positions]`` (positions >= 1), the distribution of each from the logits at
    the position before it: ``logits_at(rows)`` gives float32 logits at the positions ``rows``."""
    total = Tally()
    for start in range(0, len(positions), ROWS):
        chunk = positions[start : start + ROWS]
        total = total + score_rows(logits_at(chunk - 1), ids[chunk], sampling)
    return total
