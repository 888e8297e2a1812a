"""Quality gates checked while infer runs, so a broken run stops before the rest of the compute is spent.

``infer.gates`` in params.yaml:
    warmup          first check after this many completions, then every ``every`` completions, and at the end
    min_reasoning   least share of records with non-empty reasoning (only when the reasoning preset expects it)
    max_truncated   most share of records finished by length
    max_empty       most share of records with no content and no reasoning
"""
from __future__ import annotations


class GateBreach(RuntimeError):
    pass


class Gates:
    def __init__(self, params: dict, expects_reasoning: bool):
        self.warmup = int(params["warmup"])
        self.every = int(params["every"])
        self.limits = {"max_truncated": float(params["max_truncated"]), "max_empty": float(params["max_empty"])}
        if expects_reasoning:
            self.limits["min_reasoning"] = float(params["min_reasoning"])
        self.seen = 0
        self.hits = {"min_reasoning": [], "max_truncated": [], "max_empty": []}  # ids of records that count
        self.misses = {"min_reasoning": []}  # for min_reasoning the offenders are the records without reasoning

    def add(self, response) -> None:
        self.seen += 1
        if response.reasoning.strip():
            self.hits["min_reasoning"].append(response.id)
        else:
            self.misses["min_reasoning"].append(response.id)
        if response.finish_reason == "length":
            self.hits["max_truncated"].append(response.id)
        if not response.reasoning.strip() and not response.content.strip():
            self.hits["max_empty"].append(response.id)

    def due(self) -> bool:
        return self.seen >= self.warmup and (self.seen - self.warmup) % self.every == 0

    def check(self) -> None:
        """Raise GateBreach naming the gate, the observed rate and a few record ids."""
        if not self.seen:
            return
        for gate, limit in self.limits.items():
            rate = len(self.hits[gate]) / self.seen
            low = gate.startswith("min_")
            if (rate < limit) if low else (rate > limit):
                offenders = (self.misses if low else self.hits)[gate][:5]
                raise GateBreach(f"gate {gate} breached: observed {rate:.3f} {'<' if low else '>'} {limit} after "
                                 f"{self.seen} records (e.g. {', '.join(offenders)})")

    def summary(self) -> dict:
        return {gate: round(len(self.hits[gate]) / max(self.seen, 1), 4) for gate in self.limits}
