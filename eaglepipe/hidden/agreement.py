"""hidden's agreement check: the engine that generated the answers against the model whose states train the drafter.

Both sides' figures are raw log-probabilities of the answer tokens: the engine's (``engine_logprob`` of
data/sequences, from the records' ``logprobs``) and the target's (``target_logprob`` of hidden's shards, from the
forward that gives the states), compared per sequence with the target's argmax where the run was greedy
(comparison.py); sampled answers without engine figures get the fallback (fallback.py). Sequences without a sampling
policy and without figures (made up) have nothing to check: not applicable, and they pass.

Verdict (``Aggregate.problems``): the mean |engine - target| over every compared token above
``hidden.agreement.max_mean_abs_diff`` (``auto``: comparison.tolerance), the greedy agreement below
``min_greedy_agreement``, or more than ``MOST_FLAGGED`` of the fallback's judged sequences flagged. ``mode: on`` stops
the stage with a UserError naming the worst sequences and the likely causes, ``warn`` logs it once, ``off`` checks
nothing.

When: live (``Live``) as a run computes sequences, once ``min_sequences`` are in (all, when fewer), so that a wrong
engine stops the stage in its first shards; and over every published sequence from the store (``final``), before
anything is published: those figures, the same for a fresh and a resumed run, are the report's ``agreement``. Not
part of hidden's cache key: it decides whether a stage stops, never the states.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open

from eaglepipe.core.errors import UserError
from eaglepipe.dataset import shards
from eaglepipe.hidden import fallback, layout
from eaglepipe.hidden.comparison import Context, Figures, describe, measure

log = logging.getLogger(__name__)

MOST_FLAGGED = 0.5  # the share of the fallback's judged sequences that may be flagged
WORST_SHOWN = 5
CAUSES = (
    "Likely causes: the engine serves another checkpoint, revision or quantization than the target's files; it reads "
    "a config key otherwise (a tied head, rope scaling, the norm's eps); its figures are processed rather than raw "
    "(vLLM --logprobs-mode processed_*, SGLang without SGLANG_RETURN_ORIGINAL_LOGPROB=1); or bf16 against float32 "
    "beyond the tolerance: raise hidden.agreement.max_mean_abs_diff."
)


@dataclass
class Aggregate:
    """Running sums over checked sequences (``add``), what the verdict and the report read."""

    sequences: int = 0
    with_figures: int = 0
    compared: int = 0
    total: float = 0.0
    largest: float = 0.0
    largest_mean: float = 0.0
    greedy_checked: int = 0
    greedy_agreed: int = 0
    fallback_sequences: int = 0
    judged: int = 0
    flagged: int = 0
    tally: fallback.Tally = field(default_factory=fallback.Tally)

    def add(self, f: Figures) -> None:
        self.sequences += 1
        if f.difference:
            self.with_figures += 1
            self.compared += f.difference.compared
            self.total += f.difference.total
            self.largest = max(self.largest, f.difference.largest)
            self.largest_mean = max(self.largest_mean, f.mean_abs_diff)
        if f.greedy:
            self.greedy_checked += f.greedy.checked
            self.greedy_agreed += f.greedy.agreed
        if f.fallback:
            self.fallback_sequences += 1
            self.judged += f.fallback.tokens >= fallback.MIN_TOKENS
            self.flagged += f.fallback.flagged
            self.tally = self.tally + f.fallback

    def problems(self, ctx: Context) -> list[str]:
        """What breaks the tolerance, one sentence each; empty when nothing does."""
        found = []
        if self.compared and self.total / self.compared > ctx.tolerance:
            how = "set" if ctx.params.max_mean_abs_diff != "auto" else "auto"
            found.append(
                f"mean |engine - target| log-probability {self.total / self.compared:.4g} nats over "
                f"{self.compared} answer tokens, above hidden.agreement.max_mean_abs_diff {ctx.tolerance:g} "
                f"({how}; engine {ctx.engine_dtype or 'dtype unknown'}, target {ctx.target_dtype})"
            )
        share = self.greedy_agreed / self.greedy_checked if self.greedy_checked else 1.0
        if share < ctx.params.min_greedy_agreement:
            found.append(
                f"greedy answers: {share:.3f} of {self.greedy_checked} answer tokens are the target's argmax, "
                f"below hidden.agreement.min_greedy_agreement {ctx.params.min_greedy_agreement:g}"
            )
        if self.judged and self.flagged > MOST_FLAGGED * self.judged:
            found.append(
                f"{self.flagged} of {self.judged} sampled answers without engine figures are unlikely under the "
                f"target's own sampler (|z| > {fallback.Z_LIMIT:g}: eaglepipe/hidden/fallback.py)"
            )
        return found


def enforce(figures: list[Figures], total: Aggregate, ctx: Context) -> bool:
    """Stop (``mode: on``: UserError) or warn (``warn``) when ``total`` breaks the tolerance; whether it does."""
    found = total.problems(ctx)
    if not found:
        return False
    worst = sorted(figures, key=lambda f: f.badness, reverse=True)
    lines = [
        f"hidden: the answers' engine ({', '.join(ctx.engines) or 'not named'}) and the states' model disagree, "
        f"over {total.sequences} sequences checked: {'; '.join(found)}.",
        "Worst sequences:",
        *[f"  {describe(f)}" for f in worst[:WORST_SHOWN]],
        CAUSES,
    ]
    if ctx.params.mode == "on":
        stopped = "Nothing is published (states stored so far stay: they are valid); "
        raise UserError("\n".join([*lines, stopped + "hidden.agreement.mode: warn or off goes on."]))
    log.warning("\n".join([*lines, "hidden.agreement.mode is warn: the stage goes on."]))
    return True


class Live:
    """The check while sequences are computed: each sequence is measured once (``add``), and from the
    ``min_sequences``-th on (all ``expected``, when fewer) the whole is judged after each (``enforce``; a warning is
    given once). ``finish`` judges what came in when fewer than that did."""

    def __init__(self, ctx: Context, expected: int):
        self.ctx, self.due = ctx, min(ctx.params.min_sequences, max(expected, 1))
        self.checked: dict[str, Figures] = {}
        self.total, self.warned = Aggregate(), False

    def add(self, seq, top: torch.Tensor, target_logprob: torch.Tensor, logits_at=None) -> None:
        if seq.id in self.checked:
            return
        figures = measure(self.ctx, seq, top, target_logprob, logits_at)
        self.checked[seq.id] = figures
        self.total.add(figures)
        if len(self.checked) >= self.due:
            self.judge()

    def judge(self) -> None:
        if self.checked and not self.warned:
            self.warned = enforce(list(self.checked.values()), self.total, self.ctx)

    def finish(self) -> None:
        if len(self.checked) < self.due:
            self.judge()

    def bound(self, seqs: list):
        """``add`` for the samples of an ``extract.extract_shard`` call, by their index in ``seqs``."""
        return lambda i, top, target_logprob, logits_at: self.add(seqs[i], top, target_logprob, logits_at)

    def tallies(self) -> dict[str, fallback.Tally]:
        """The fallback figures of the sequences checked, by id."""
        return {sid: f.fallback for sid, f in self.checked.items() if f.fallback is not None}


def live(ctx: Context, expected: int) -> Live | None:
    """The live check of ``expected`` sequences, or None with ``mode: off``."""
    return None if ctx.params.mode == "off" else Live(ctx, expected)


def summary(total: Aggregate, ctx: Context, not_rechecked: int = 0) -> dict:
    """The report's ``agreement``: the figures of ``total`` and the verdict (``not_rechecked``: sequences the fallback
    would check that were reused, not computed)."""
    logprobs = greedy = rest = "not applicable"
    if total.compared:
        logprobs = {
            "tokens": total.compared,
            "mean_abs_diff": round(total.total / total.compared, 7),
            "max_abs_diff": round(total.largest, 7),
            "max_sequence_mean_abs_diff": round(total.largest_mean, 7),
            "max_mean_abs_diff": ctx.tolerance,
        }
    if ctx.greedy:
        share = total.greedy_agreed / total.greedy_checked if total.greedy_checked else None
        greedy = {"tokens": total.greedy_checked, "agreement": None if share is None else round(share, 6)}
    if ctx.sampled and total.sequences > total.with_figures:
        z = total.tally.z
        rest = {
            "sequences": total.fallback_sequences,
            "not_rechecked": not_rechecked,
            "tokens": total.tally.tokens,
            "outside_support": total.tally.outside,
            "judged": total.judged,
            "flagged": total.flagged,
            "z": None if z is None else round(z, 3),
        }
    checked = total.compared or total.greedy_checked or total.tally.tokens
    verdict = "fail" if total.problems(ctx) else "pass" if checked else "not applicable"
    return {
        "mode": ctx.params.mode,
        "engines": ctx.engines,
        "engine_dtype": ctx.engine_dtype,
        "target_dtype": ctx.target_dtype,
        "sequences": total.sequences,
        "sequences_with_engine_figures": total.with_figures,
        "logprobs": logprobs,
        "greedy": greedy,
        "fallback": rest,
        "verdict": verdict,
    }


def aggregate(figures: list[Figures]) -> Aggregate:
    """The ``Aggregate`` of these figures."""
    total = Aggregate()
    for f in figures:
        total.add(f)
    return total


def stored_rows(store_dir: Path, index: dict) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(id, its ``top`` and ``target_logprob`` rows) of every sample a published ``index`` names, from the shards of
    the store ``store_dir``."""
    for split in shards.SPLITS:
        for entry in index.get(split, {}).get("shards", []):
            path = store_dir / entry["file"]
            with safe_open(str(path), framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
            spans = [(offsets[r], offsets[r + 1]) for r in entry["rows"]]
            yield from zip(entry["ids"], shards.read_rows(path, ("top", layout.TARGET_LOGPROB), spans))


def final(store_dir: Path, index: dict, seqs: dict, ctx: Context, tallies: dict[str, fallback.Tally]) -> dict:
    """The check over every sequence a published ``index`` names (``seqs``: store.read_sequences's), from the store,
    with the fallback ``tallies`` of the sequences this run computed (by id); enforced, then summarised."""
    if ctx.params.mode == "off":
        return {"mode": "off"}
    by_id = {seq.id: seq for split in seqs.values() for seq in split}
    tally_of = {by_id[sid].key: tally for sid, tally in tallies.items()}
    figures = []
    for sid, rows in stored_rows(store_dir, index):
        seq = by_id[sid]
        measured = measure(ctx, seq, rows["top"], rows[layout.TARGET_LOGPROB])
        figures.append(replace(measured, fallback=tally_of.get(seq.key)))
    total = aggregate(figures)
    enforce(figures, total, ctx)
    reused = sum(1 for f in figures if f.difference is None and f.fallback is None) if ctx.sampled else 0
    return summary(total, ctx, reused)
