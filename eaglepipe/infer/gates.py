"""Quality gates checked while infer runs (``infer.gates``: config.Gates): a broken run stops early.

A record has reasoning when its reasoning is non-empty and closed, unless the output was cut short (a block that
never closes although the model stopped is what a prefilled ``<think>`` leaves when the thinking was dropped); it is
empty with neither reasoning nor answer text (special tokens do not count). A breach raises GateBreach naming the
gate, the observed rate, the limit and a few record ids; infer then keeps its cache and publishes nothing.
"""

from __future__ import annotations

import re

from eaglepipe.core.errors import UserError

HINTS = {
    "min_reasoning": "these records carry no reasoning (or a block that never closes although the model stopped): "
    "does target.reasoning match the model's markers and chat template (docs/reasoning-and-tools.md)"
    ", and do the served output ids still hold the thinking?",
    "max_truncated": "too many outputs hit infer.max_new_tokens: raise it, or check for degenerate repetition",
    "max_empty": "too many outputs are empty: check the chat template, the stop tokens and the engine",
}


class GateBreach(UserError, RuntimeError):
    def __init__(self, gate: str, rate: float, limit: float, seen: int, offenders: list, hint: str = ""):
        self.gate, self.rate, self.limit, self.seen, self.offenders = gate, rate, limit, seen, offenders
        low = gate.startswith("min_")
        super().__init__(
            f"gate {gate} breached: observed {rate:.3f} {'<' if low else '>'} {limit} after {seen} "
            f"records (e.g. {', '.join(offenders) or '-'}); {hint or HINTS[gate]}"
        )


def cut_in_reasoning_hint(n: int) -> str:
    """max_truncated's hint when ``n`` truncated records end inside a reasoning block that never closed."""
    return (
        f"{HINTS['max_truncated']}. {n} of them end inside a reasoning block that never closed: either the model "
        "thinks past infer.max_new_tokens, or (when the chat template prefills the opening tag) it does not think "
        "at all and its whole answer reads as reasoning; `make inspect` shows which"
    )


class Gates:
    def __init__(self, params, expects_reasoning: bool, markup: tuple = ()):
        """``params``: ``infer.gates`` (config.Gates). ``markup``: strings (special and added tokens, see
        derive.markup) that are not answer text."""
        self.warmup, self.every = params.warmup, params.every
        self.limits = {"max_truncated": params.max_truncated, "max_empty": params.max_empty}
        if expects_reasoning:
            self.limits = {"min_reasoning": params.min_reasoning, **self.limits}
        self._markup = re.compile("|".join(map(re.escape, sorted(markup, key=len, reverse=True)))) if markup else None
        self.seen = 0
        self.checked_at: int | None = None
        self.hits = {"min_reasoning": [], "max_truncated": [], "max_empty": []}  # ids of records that count
        self.cut_in_reasoning = 0  # truncated records whose reasoning never closed
        self.misses = {"min_reasoning": []}  # for min_reasoning the offenders are the records without reasoning

    def empty(self, response) -> bool:
        answer = self._markup.sub("", response.content) if self._markup else response.content
        return not response.reasoning.strip() and not answer.strip()

    @staticmethod
    def reasoned(response) -> bool:
        return bool(response.reasoning.strip()) and (response.reasoning_closed or response.finish_reason != "stop")

    def add(self, response) -> None:
        self.seen += 1
        if self.reasoned(response):
            self.hits["min_reasoning"].append(response.id)
        else:
            self.misses["min_reasoning"].append(response.id)
        if response.finish_reason == "length":
            self.hits["max_truncated"].append(response.id)
            self.cut_in_reasoning += bool(response.reasoning.strip()) and not response.reasoning_closed
        if self.empty(response):
            self.hits["max_empty"].append(response.id)

    def due(self) -> bool:
        """True once ``warmup`` records are in and then every ``every`` records (records loaded from the cache
        count, so a resumed run is checked at its first new completion)."""
        return self.seen >= self.warmup and (self.checked_at is None or self.seen - self.checked_at >= self.every)

    def check(self) -> None:
        """Raise GateBreach naming the gate, the observed rate and a few record ids."""
        if not self.seen:
            return
        self.checked_at = self.seen
        for gate, limit in self.limits.items():
            rate = len(self.hits[gate]) / self.seen
            low = gate.startswith("min_")
            if (rate < limit) if low else (rate > limit):
                hint = (
                    cut_in_reasoning_hint(self.cut_in_reasoning)
                    if gate == "max_truncated" and self.cut_in_reasoning
                    else ""
                )
                raise GateBreach(gate, rate, limit, self.seen, (self.misses if low else self.hits)[gate][:5], hint)

    def summary(self) -> dict:
        return {gate: round(len(self.hits[gate]) / max(self.seen, 1), 4) for gate in self.limits}
