"""infer's report: the counts over the published records (``tally``) and what a run generated (``Progress``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from eaglepipe.core.records import Response
from eaglepipe.infer.gates import Gates
from eaglepipe.text import toolcalls


@dataclass
class Progress:
    """What this run generated (the answers the cache held aside): answers asked of the engine, their new tokens
    and the seconds spent generating them."""

    generated: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def report(self, cache_counts: Counter) -> dict:
        """The report's ``run`` part, with the cache's repairs (``Cache.load``'s counts)."""
        speed = round(self.tokens / self.seconds, 2) if self.seconds > 0 and self.tokens else 0.0
        return {
            "generated": self.generated,
            "tokens_out": self.tokens,
            "seconds": round(self.seconds, 2),
            "tokens_per_s": speed,
            **{f"cache_{k}": v for k, v in cache_counts.items()},
        }


def tally(responses: list[Response]) -> dict:
    """The report's counts over the published records."""
    return {
        "finish_reason": dict(Counter(r.finish_reason for r in responses)),
        "empty_outputs": sum(1 for r in responses if not r.output_ids),
        "with_reasoning": sum(1 for r in responses if Gates.reasoned(r)),
        "unclosed_reasoning": sum(1 for r in responses if not r.reasoning_closed),
        "unclosed_reasoning_at_stop": sum(1 for r in responses if not r.reasoning_closed and r.finish_reason == "stop"),
        "tool_calls": {
            "records": sum(1 for r in responses if r.tool_calls),
            "calls": sum(len(r.tool_calls) - toolcalls.count_errors(r.tool_calls) for r in responses),
            "parse_failures": sum(toolcalls.count_errors(r.tool_calls) for r in responses),
        },
        "tokens_in": sum(len(r.prompt_ids) for r in responses),
        "tokens_out": sum(len(r.output_ids) for r in responses),
        "per_source": dict(sorted(Counter(r.source for r in responses).items())),
        "logprobs": figures_tally(responses),
    }


def figures_tally(responses: list[Response]) -> dict:
    """The report's ``logprobs`` counts: the records with the engine's log-probabilities and those without (cached
    before engines gave them), and the tokens an engine gave no figure (in the records with them)."""
    scored = [r for r in responses if r.logprobs is not None]
    return {
        "records_with": len(scored),
        "records_without": len(responses) - len(scored),
        "tokens_without": sum(figure is None for r in scored for figure in r.logprobs),
    }
