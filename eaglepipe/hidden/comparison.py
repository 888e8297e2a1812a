"""One sequence compared for hidden's agreement check (agreement.py): the engine's log-probabilities of its answer
tokens against the target's, and the target's argmax where the run was greedy.

``Context``: what the check holds sequences to: the ``hidden.agreement`` params, the sequences' policy (sampling,
engines, the engine's dtype, end-of-turn id: dataset/sequences.py), both sides' dtypes and the tolerance they give
(``tolerance``).

``measure``: per sequence, over its answer positions (loss mask 1) with an engine figure: how many, the sum and largest
|engine - target|, and the first position over the tolerance (else the largest). Where the run was greedy (sampling
temperature 0): how many answer tokens are the target's argmax (``top[t - 1] == ids[t]``), leaving out an
end-of-turn id merge appended (one right after another stop id, or opening an answer). A sampled sequence without
engine figures gets the fallback (fallback.py) where the logits are at hand (live).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglepipe.hidden import fallback

# ``max_mean_abs_diff: auto``, in nats, over the answer tokens of the checked sequences. Set from
# bench/bench_agreement.py on the embedded target (results/components.jsonl; docs/benchmarks.md): with both sides in
# float32 a sequence's mean stayed within 1e-5 for the hf engine and vLLM, so 1e-3 leaves room for other kernels; with
# either side in bfloat16 the means reached 0.03 over all tokens and 0.06 for one sequence. A doctored final norm
# (x1.5) gives 0.1 to 0.7.
AUTO_FLOAT32 = 0.001  # both sides compute in float32
AUTO_HALF = 0.1  # either side in bfloat16 or float16, or the engine's dtype unknown


def tolerance(params, engine_dtype: str | None, target_dtype: str) -> float:
    """``hidden.agreement.max_mean_abs_diff``; ``auto``: ``AUTO_FLOAT32`` when both sides compute in float32, else
    ``AUTO_HALF``."""
    if params.max_mean_abs_diff != "auto":
        return float(params.max_mean_abs_diff)
    return AUTO_FLOAT32 if engine_dtype == target_dtype == "float32" else AUTO_HALF


@dataclass(frozen=True)
class Context:
    """What the check holds sequences to: the ``hidden.agreement`` params, the sequences' policy (its sampling, engines
    and end-of-turn id: dataset/sequences.py), both sides' dtypes (the engine's None: unknown) and the resolved
    tolerance."""

    params: object
    sampling: dict
    engines: list[str]
    end_of_turn: int | None
    engine_dtype: str | None
    target_dtype: str
    tolerance: float

    @classmethod
    def of(cls, params, policy, target_dtype: str) -> Context:
        """From the ``hidden.agreement`` section, data/sequences' ``policy`` (the engine's dtype: its
        ``engine_dtype``, as merge read it from infer's engine.json; unknown where absent) and the dtype the states'
        model computes in."""
        policy = policy if isinstance(policy, dict) else {}
        engines = list(policy.get("engines", []))
        engine_dtype = policy.get("engine_dtype")
        sampling = dict(policy.get("sampling") or {})
        limit = tolerance(params, engine_dtype, target_dtype)
        return cls(params, sampling, engines, policy.get("end_of_turn_id"), engine_dtype, target_dtype, limit)

    @property
    def greedy(self) -> bool:
        return self.sampling.get("temperature") == 0

    @property
    def sampled(self) -> bool:
        return (self.sampling.get("temperature") or 0) > 0


@dataclass(frozen=True)
class Difference:
    """A sequence's |engine - target| over its ``compared`` answer tokens: their ``total`` and ``largest``; at
    ``position`` (the first over the tolerance when ``over``, else the largest) the ``engine`` and ``target``
    figures."""

    compared: int
    total: float
    largest: float
    position: int
    over: bool
    engine: float
    target: float


@dataclass(frozen=True)
class Greedy:
    """A greedy sequence's answer tokens ``checked`` and those that are the target's argmax (``agreed``); the first
    that is not, with the answer's token and the target's there (None when all agree)."""

    checked: int
    agreed: int
    position: int | None = None
    answer_token: int | None = None
    target_token: int | None = None


@dataclass(frozen=True)
class Figures:
    """One sequence's figures (``measure``): each part None where it does not apply."""

    id: str
    tokens: int
    difference: Difference | None = None
    greedy: Greedy | None = None
    fallback: fallback.Tally | None = None

    @property
    def mean_abs_diff(self) -> float:
        return self.difference.total / self.difference.compared if self.difference else 0.0

    @property
    def greedy_misses(self) -> float:
        return 1 - self.greedy.agreed / self.greedy.checked if self.greedy and self.greedy.checked else 0.0

    @property
    def badness(self) -> tuple[float, float, float]:
        """How far the sequence is from the target: its mean |difference|, then its greedy misses, then its |z|."""
        z = self.fallback.z if self.fallback is not None and self.fallback.z is not None else 0.0
        return self.mean_abs_diff, self.greedy_misses, abs(z)


def _difference(mask, target_logprob, engine_logprob, limit: float) -> Difference | None:
    """The ``Difference`` over the answer positions where both sides have a figure; None where there is none."""
    if engine_logprob is None:
        return None
    engine = engine_logprob.float().cpu()
    compared = mask & ~engine.isnan() & ~target_logprob.isnan()
    if not compared.any():
        return None
    positions = compared.nonzero()[:, 0]
    gaps = (engine[positions] - target_logprob[positions]).abs().double()
    over = positions[gaps > limit]
    position = int(over[0]) if len(over) else int(positions[gaps.argmax()])
    return Difference(
        compared=len(positions),
        total=float(gaps.sum()),
        largest=float(gaps.max()),
        position=position,
        over=bool(len(over)),
        engine=float(engine[position]),
        target=float(target_logprob[position]),
    )


def _greedy(ids, mask, top, ctx: Context) -> Greedy:
    """The ``Greedy`` figures of a sequence: answer positions t >= 1 but an appended end-of-turn id."""
    answer = mask[1:].clone()
    if ctx.end_of_turn is not None:
        stops = torch.tensor(ctx.sampling.get("stop_token_ids", []), dtype=torch.long)
        after_stop = torch.isin(ids[:-1], stops) & (ids[:-1] != ctx.end_of_turn)
        answer &= ~((ids[1:] == ctx.end_of_turn) & (~mask[:-1] | after_stop))
    agreed = (top[:-1] == ids[1:]) & answer
    misses = (answer & ~agreed).nonzero()[:, 0]
    if not len(misses):
        return Greedy(int(answer.sum()), int(agreed.sum()))
    t = int(misses[0]) + 1
    return Greedy(int(answer.sum()), int(agreed.sum()), t, int(ids[t]), int(top[t - 1]))


def measure(ctx: Context, seq, top: torch.Tensor, target_logprob: torch.Tensor, logits_at=None) -> Figures:
    """The ``Figures`` of ``seq`` (a sequence with ``id``, ``ids``, ``mask`` and ``engine_logprob``) from the
    target's ``top`` and ``target_logprob``; ``logits_at(rows)`` (float32 logits at those positions, live only) gives
    the fallback of a sampled sequence without engine figures."""
    ids, mask = torch.as_tensor(seq.ids).long().cpu(), torch.as_tensor(seq.mask).bool().cpu()
    top, target_logprob = top.long().cpu(), target_logprob.float().cpu()
    difference = _difference(mask, target_logprob, seq.engine_logprob, ctx.tolerance)
    greedy = _greedy(ids, mask, top, ctx) if ctx.greedy else None
    tally = None
    if difference is None and ctx.sampled and logits_at is not None:
        tally = fallback.score(logits_at, mask[1:].nonzero()[:, 0] + 1, ids, ctx.sampling)
    return Figures(seq.id, len(ids), difference, greedy, tally)


def describe(f: Figures) -> str:
    """One line on one sequence's figures, for the message."""
    parts = []
    d = f.difference
    if d:
        where = "first over the tolerance" if d.over else "largest"
        parts.append(
            f"mean |engine - target| {f.mean_abs_diff:.4g}, max {d.largest:.4g} over {d.compared} answer tokens; "
            f"{where} at position {d.position}: engine {d.engine:.5f}, target {d.target:.5f}"
        )
    if f.greedy and f.greedy.position is not None:
        g = f.greedy
        parts.append(
            f"greedy agreement {g.agreed}/{g.checked}, first miss at position {g.position}: answer token "
            f"{g.answer_token}, target's argmax {g.target_token}"
        )
    if f.fallback and f.fallback.z is not None:
        t = f.fallback
        parts.append(f"fallback z {t.z:.2f} over {t.tokens} answer tokens, {t.outside} outside the sampler's support")
    return f"{f.id} ({f.tokens} tokens): " + "; ".join(parts)
