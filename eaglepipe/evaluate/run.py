"""evaluate: EAGLE-3 speculative decoding of every conversation of the chosen benchmarks (benchmarks.py), each turn
checked to be the target's plain greedy output (``speculative.greedy_check``, settled by plain decoding where it
fails), and the n-gram baseline's counts replayed from that output (``speculative.replay``). Turn k + 1's prompt is
the chat so far with turn k's answer as a serving engine returns it (``Chat.answer``).

Under torchrun (runtime.py) rank r of W decodes conversations r, r + W, ..; every turn's counts are gathered and added
up in order, so every figure but the speeds is the same at any number of processes of the same thread count."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import torch

from eaglepipe.core import runtime, uncertainty
from eaglepipe.dataset.benchmarks import Conversation
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.evaluate import decode as speculative
from eaglepipe.target import chat, families
from eaglepipe.text import derive

log = logging.getLogger(__name__)


class Chat:
    """The target's chat: ``ids`` renders messages to prompt ids with its template; ``answer`` is the assistant
    message a serving engine returns for an output (``derive.answer_message``)."""

    def __init__(self, tokenizer, template_kwargs: dict, spec, stop_ids):
        self.tokenizer, self.template_kwargs, self.spec, self.stops = tokenizer, template_kwargs, spec, set(stop_ids)

    def ids(self, messages: list, tools: list | None = None) -> list[int]:
        return chat.prompt_ids(self.tokenizer, messages, tools, self.template_kwargs)

    def answer(self, prompt_ids: list, output_ids: list) -> dict:
        return derive.answer_message(self.tokenizer, prompt_ids, output_ids, self.spec, self.stops)


@dataclass
class Turn:
    """One decoded turn: ``index`` within its benchmark (from 0), ``turn`` (from 1), the plain greedy ``output_ids``,
    ``stats`` per method (``eagle``, ``ngram``; ``check_s``: the greedy check's seconds) and ``wrong``: where EAGLE's
    output differed from plain greedy, if it did."""

    conversation: Conversation
    index: int
    turn: int
    ids: list
    output_ids: list
    stats: dict
    wrong: list


def position_rows(rates: dict[str, list[float]]) -> list[dict]:
    """Plot rows ``{position (from 1), method, acceptance_rate}`` from each method's rate per draft position."""
    return [
        {"position": i + 1, "method": method, "acceptance_rate": r}
        for method, per_position in rates.items()
        for i, r in enumerate(per_position)
    ]


def decoded_record(t: Turn, layers: list) -> dict:
    """One line of ``data/decoded/<benchmark>.jsonl`` (read by serve.py): prompt and plain greedy output ids, and the
    EAGLE run's counts (speculative.Stats) with the target layers the drafter read (HF indices)."""
    c, eagle = t.conversation, t.stats["eagle"]
    return {
        "index": t.index,
        "id": c.id,
        "turn": t.turn,
        "category": c.category,
        "prompt_ids": t.ids,
        "output_ids": t.output_ids,
        "eagle": {
            "steps": eagle.steps,
            "emitted": eagle.emitted,
            "proposed": eagle.proposed,
            "accepted": eagle.accepted,
            "layers": list(layers),
        },
    }


def summary(turns: list[Turn]) -> dict:
    """A group of turns' figures. Each acceptance length comes with its standard error over conversations
    (uncertainty.py); ``difference_se`` is that of drafter minus baseline, paired."""
    spec, base = _total(turns, "eagle"), _total(turns, "ngram")
    conversations = list(_groups(turns, lambda t: (t.conversation.benchmark, t.conversation.id)).values())
    spec_c, base_c = (
        ([s.emitted for s in cs], [s.steps for s in cs])
        for cs in ([_total(ts, m) for ts in conversations] for m in ("eagle", "ngram"))
    )
    diff_se = uncertainty.difference_se(spec_c, base_c)
    return {
        "prompts": len(conversations),
        "turns": len(turns),
        "tokens": sum(len(t.output_ids) for t in turns),
        "lossless": not any(t.wrong for t in turns),
        "acceptance_length": round(spec.acceptance_length, 4),
        "acceptance_length_se": _round(uncertainty.ratio_se(*spec_c)),
        "baseline_acceptance_length": round(base.acceptance_length, 4),
        "baseline_acceptance_length_se": _round(uncertainty.ratio_se(*base_c)),
        "difference_se": _round(diff_se),
        "beats_baseline": spec.acceptance_length > base.acceptance_length,
        "beats_baseline_by_2se": diff_se is not None and spec.acceptance_length - base.acceptance_length > 2 * diff_se,
        "acceptance_rate_per_position": [round(r, 4) for r in spec.acceptance_rate],
        "conditional_acceptance_rate_per_position": [round(r, 4) for r in spec.conditional_rate],
        "baseline_acceptance_rate_per_position": [round(r, 4) for r in base.acceptance_rate],
        "verification_steps": spec.steps,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _total(turns: list[Turn], method: str) -> speculative.Stats:
    return reduce(speculative.Stats.merge, (t.stats[method] for t in turns), speculative.Stats())


def speeds(turns: list[Turn]) -> dict:
    """EAGLE's seconds and tokens/s and the greedy checks' seconds (the timings file)."""
    eagle = _total(turns, "eagle")
    return {
        "eagle_seconds": round(eagle.seconds, 2),
        "eagle_tokens_per_s": round(eagle.tokens_per_s, 2),
        "check_seconds": round(sum(t.stats["check_s"] for t in turns), 2),
    }


def _groups(turns: list[Turn], key) -> dict:
    groups = defaultdict(list)
    for t in turns:
        groups[key(t)].append(t)
    return dict(sorted(groups.items()))


def report(turns: list[Turn]) -> dict:
    """``summary`` of a benchmark's turns, with ``per_category`` and ``per_turn`` where there are several."""
    out = summary(turns)
    by_category = _groups(turns, lambda t: t.conversation.category)
    if len(by_category) > 1:
        out["per_category"] = {cat: summary(ts) for cat, ts in by_category.items()}
    by_turn = _groups(turns, lambda t: t.turn)
    if len(by_turn) > 1:
        out["per_turn"] = {str(k): summary(ts) for k, ts in by_turn.items()}
    return out


def _turn(c: Conversation, turn: int, ids: list, model, eagle, lookup, chat_: Chat, params) -> Turn:
    """Decode one turn with EAGLE, check it against plain greedy and replay the n-gram baseline on it."""
    max_new, steps = params.max_new_tokens, params.num_steps
    stats = {"eagle": speculative.Stats(), "ngram": speculative.Stats()}
    output = speculative.speculative(model, eagle, ids, max_new, chat_.stops, steps, stats["eagle"])
    start = time.perf_counter()
    wrong = []
    if speculative.greedy_check(model, ids, output, max_new, chat_.stops) is not None:
        plain = speculative.greedy(model, ids, max_new, chat_.stops)
        if plain != output:
            wrong = [
                {
                    "benchmark": c.benchmark,
                    "id": c.id,
                    "turn": turn,
                    "method": "eagle",
                    "first_difference": speculative.first_difference(output, plain),
                }
            ]
            output = plain
    stats["check_s"] = time.perf_counter() - start
    speculative.replay(lookup, ids, output, max_new, chat_.stops, steps, stats["ngram"])
    return Turn(c, 0, turn, ids, output, stats, wrong)


def run(
    conversations: list[Conversation],
    chat_: Chat,
    model,
    drafter_model,
    params,
    rt: runtime.Runtime = runtime.Runtime(),  # noqa: B008  Runtime is frozen: the one-process default is a constant
) -> dict:
    """Decode this rank's share of the conversations (the module docstring); return, on every rank, the metrics of
    all: ``benchmarks`` (``report`` per benchmark, in order), ``lossless`` (False lists the ``mismatches``), ``run``
    (speeds), ``positions`` (``position_rows`` of each benchmark) and ``decoded`` (``decoded_record``s per
    benchmark)."""
    eagle = speculative.EagleDrafter(drafter_model)
    lookup = speculative.NgramDrafter(params.ngram.max, params.ngram.min)
    layers = families.text_config(model.config).num_hidden_layers
    if any(not 0 <= i < layers for i in eagle.layers):
        raise ValueError(f"the drafter reads hidden states {eagle.layers}, the target has {layers} layers")
    mine = list(enumerate(conversations))[rt.rank :: rt.world]
    if mine:  # warm-up (first-call allocations, lazy hooks), not counted
        ids = chat_.ids(mine[0][1].messages_for([]), mine[0][1].tools)
        speculative.speculative(model, eagle, ids, min(8, params.max_new_tokens), chat_.stops, params.num_steps)
    done = []  # per turn of this rank: (conversation's position, turn, Turn)
    for position, c in mine:
        answers = []
        for turn in range(1, c.turns + 1):
            ids = chat_.ids(c.messages_for(answers), c.tools)
            t = _turn(c, turn, ids, model, eagle, lookup, chat_, params)
            done.append((position, turn, t))
            log.info(
                "%s %s turn %d (%d/%d, %s): %d tokens; acceptance length eagle %.3f, n-gram %.3f",
                c.benchmark,
                c.id,
                turn,
                position + 1,
                len(conversations),
                c.category,
                len(t.output_ids),
                t.stats["eagle"].acceptance_length,
                t.stats["ngram"].acceptance_length,
            )
            answers.append(chat_.answer(ids, t.output_ids))
    turns = [t for _, _, t in sorted((d for part in rt.gather(done) for d in part), key=lambda d: d[:2])]
    by_benchmark = {}
    for t in turns:
        group = by_benchmark.setdefault(t.conversation.benchmark, [])
        t.index = len(group)
        group.append(t)
    mismatches = [w for t in turns for w in t.wrong]
    reports = {name: report(ts) for name, ts in by_benchmark.items()}
    return {
        "num_steps": params.num_steps,
        "max_new_tokens": params.max_new_tokens,
        "lossless": not mismatches,
        "mismatches": mismatches,
        "benchmarks": reports,
        "run": {
            "threads": torch.get_num_threads(),
            "processes": rt.world,
            "benchmarks": {name: speeds(ts) for name, ts in by_benchmark.items()},
        },
        "positions": [
            row | {"benchmark": name, "method": f"{name} {row['method']}"}
            for name, r in reports.items()
            for row in position_rows(
                {"eagle": r["acceptance_rate_per_position"], "ngram": r["baseline_acceptance_rate_per_position"]}
            )
        ],
        "decoded": {name: [decoded_record(t, eagle.layers) for t in ts] for name, ts in by_benchmark.items()},
    }


def load_drafter(folder, model):
    """The trained drafter on the target's device, given the target's input embedding (the drafter stores none)."""
    return draft.load(Path(folder), model.get_input_embeddings().weight).to(model.device)
