"""evaluate: EAGLE-3 speculative decoding of every conversation of the chosen benchmarks (dataset/benchmarks.py), each
turn checked to be the target's plain greedy output (``decode.greedy_check``, settled by plain decoding where it
fails), and the n-gram baseline's counts replayed from that output (``decode.replay``). Turn k + 1's prompt is the
chat so far with turn k's answer as a serving engine returns it (``Chat.answer``).

Under torchrun (core/runtime.py) rank r of W decodes conversations r, r + W, ..; every turn's counts are gathered and
added up in order, so every figure but the speeds is the same at any number of processes of the same thread count."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import torch

from eaglepipe.core import config, runtime, uncertainty
from eaglepipe.dataset.benchmarks import Conversation
from eaglepipe.drafter import methods
from eaglepipe.evaluate import decode
from eaglepipe.evaluate.block import BlockDrafter
from eaglepipe.target import chat, families
from eaglepipe.text import derive

log = logging.getLogger(__name__)


class Chat:
    """The target's chat: ``ids`` renders messages to prompt ids with its template; ``answer`` is the assistant
    message a serving engine returns for an output (``derive.answer_message``)."""

    def __init__(self, tokenizer, template_kwargs: dict, spec, stop_ids):
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        self.spec = spec
        self.stops = set(stop_ids)

    def ids(self, messages: list, tools: list | None = None) -> list[int]:
        return chat.prompt_ids(self.tokenizer, messages, tools, self.template_kwargs)

    def answer(self, prompt_ids: list, output_ids: list) -> dict:
        return derive.answer_message(self.tokenizer, prompt_ids, output_ids, self.spec, self.stops)


@dataclass
class Decoders:
    """What decodes a turn: the target, the EAGLE drafter, the n-gram baseline, the chat and evaluate's params."""

    model: torch.nn.Module
    eagle: decode.EagleDrafter | BlockDrafter
    lookup: decode.NgramDrafter
    chat: Chat
    params: config.Evaluate


@dataclass
class Turn:
    """One decoded turn: ``position`` of its conversation in the run's list, ``turn`` (from 1), the plain greedy
    ``output_ids``, each method's counts (``eagle``, ``ngram``), the greedy check's seconds (``check_s``),
    ``mismatch``: where EAGLE's output differed from plain greedy, if it did; and ``index`` within its benchmark (from
    0), set once every rank's turns are gathered."""

    conversation: Conversation
    position: int
    turn: int
    prompt_ids: list
    output_ids: list
    eagle: decode.Stats
    ngram: decode.Stats
    check_s: float
    mismatch: dict | None
    index: int = 0


def position_rows(rates: dict[str, list[float]]) -> list[dict]:
    """Plot rows ``{position (from 1), method, acceptance_rate}`` from each method's rate per draft position."""
    return [
        {"position": i + 1, "method": method, "acceptance_rate": r}
        for method, per_position in rates.items()
        for i, r in enumerate(per_position)
    ]


def decoded_record(t: Turn, layers: list) -> dict:
    """One line of ``data/decoded/<benchmark>.jsonl`` (read by serve.py): prompt and plain greedy output ids, and the
    EAGLE run's counts (decode.Stats) with the target layers the drafter read (HF indices)."""
    c = t.conversation
    return {
        "index": t.index,
        "id": c.id,
        "turn": t.turn,
        "category": c.category,
        "prompt_ids": t.prompt_ids,
        "output_ids": t.output_ids,
        "eagle": {
            "steps": t.eagle.steps,
            "emitted": t.eagle.emitted,
            "proposed": t.eagle.proposed,
            "accepted": t.eagle.accepted,
            "layers": list(layers),
        },
    }


def summary(turns: list[Turn]) -> dict:
    """A group of turns' figures. Each acceptance length comes with its standard error over conversations
    (core/uncertainty.py); ``difference_se`` is that of drafter minus baseline, paired."""
    eagle = _total(t.eagle for t in turns)
    ngram = _total(t.ngram for t in turns)
    conversations = list(_groups(turns, lambda t: (t.conversation.benchmark, t.conversation.id)).values())
    eagle_counts = _per_conversation(conversations, "eagle")
    ngram_counts = _per_conversation(conversations, "ngram")
    diff_se = uncertainty.difference_se(eagle_counts, ngram_counts)
    return {
        "prompts": len(conversations),
        "turns": len(turns),
        "tokens": sum(len(t.output_ids) for t in turns),
        "lossless": not any(t.mismatch for t in turns),
        "acceptance_length": round(eagle.acceptance_length, 4),
        "acceptance_length_se": _round(uncertainty.ratio_se(*eagle_counts)),
        "baseline_acceptance_length": round(ngram.acceptance_length, 4),
        "baseline_acceptance_length_se": _round(uncertainty.ratio_se(*ngram_counts)),
        "difference_se": _round(diff_se),
        "beats_baseline": eagle.acceptance_length > ngram.acceptance_length,
        "beats_baseline_by_2se": diff_se is not None
        and eagle.acceptance_length - ngram.acceptance_length > 2 * diff_se,
        "acceptance_rate_per_position": [round(r, 4) for r in eagle.acceptance_rate],
        "conditional_acceptance_rate_per_position": [round(r, 4) for r in eagle.conditional_rate],
        "baseline_acceptance_rate_per_position": [round(r, 4) for r in ngram.acceptance_rate],
        "verification_steps": eagle.steps,
    }


def _per_conversation(conversations: list[list[Turn]], method: str) -> tuple[list[int], list[int]]:
    """``method``'s tokens emitted and verification steps per conversation: the (nums, dens) of uncertainty.py."""
    totals = [_total(getattr(t, method) for t in turns) for turns in conversations]
    return [s.emitted for s in totals], [s.steps for s in totals]


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _total(stats: Iterable[decode.Stats]) -> decode.Stats:
    return reduce(decode.Stats.merge, stats, decode.Stats())


def speeds(turns: list[Turn]) -> dict:
    """EAGLE's seconds and tokens/s and the greedy checks' seconds (the timings file)."""
    eagle = _total(t.eagle for t in turns)
    return {
        "eagle_seconds": round(eagle.seconds, 2),
        "eagle_tokens_per_s": round(eagle.tokens_per_s, 2),
        "check_seconds": round(sum(t.check_s for t in turns), 2),
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


def _turn(c: Conversation, position: int, turn: int, ids: list, d: Decoders) -> Turn:
    """Decode one turn with EAGLE, check it against plain greedy and replay the n-gram baseline on it."""
    max_new = d.params.max_new_tokens
    steps = d.params.num_steps
    eagle = decode.Stats()
    ngram = decode.Stats()
    output = decode.speculative(d.model, d.eagle, ids, max_new, d.chat.stops, steps, eagle)
    start = time.perf_counter()
    mismatch = None
    if decode.greedy_check(d.model, ids, output, max_new, d.chat.stops) is not None:
        plain = decode.greedy(d.model, ids, max_new, d.chat.stops)
        if plain != output:
            mismatch = {
                "benchmark": c.benchmark,
                "id": c.id,
                "turn": turn,
                "method": "eagle",
                "first_difference": decode.first_difference(output, plain),
            }
            output = plain
    check_s = time.perf_counter() - start
    decode.replay(d.lookup, ids, output, max_new, d.chat.stops, steps, ngram)
    return Turn(
        conversation=c,
        position=position,
        turn=turn,
        prompt_ids=ids,
        output_ids=output,
        eagle=eagle,
        ngram=ngram,
        check_s=check_s,
        mismatch=mismatch,
    )


def _conversation(c: Conversation, position: int, of: int, d: Decoders) -> list[Turn]:
    """Every turn of conversation ``c`` (``position`` of ``of`` in the run), each asked after the answers to those
    before it as a serving engine returns them."""
    turns = []
    answers = []
    for turn in range(1, c.turns + 1):
        ids = d.chat.ids(c.messages_for(answers), c.tools)
        t = _turn(c, position, turn, ids, d)
        turns.append(t)
        log.info(
            "%s %s turn %d (%d/%d, %s): %d tokens; acceptance length eagle %.3f, n-gram %.3f",
            c.benchmark,
            c.id,
            turn,
            position + 1,
            of,
            c.category,
            len(t.output_ids),
            t.eagle.acceptance_length,
            t.ngram.acceptance_length,
        )
        answers.append(d.chat.answer(ids, t.output_ids))
    return turns


def _decoders(chat_: Chat, model, drafter_model, params: config.Evaluate) -> Decoders:
    """The decoders of a run; ValueError when the drafter reads a layer the target does not have."""
    eagle = decode.drafter_for(drafter_model, params.num_steps)
    layers = families.text_config(model.config).num_hidden_layers
    if any(not 0 <= i < layers for i in eagle.layers):
        raise ValueError(f"the drafter reads hidden states {eagle.layers}, the target has {layers} layers")
    return Decoders(model, eagle, decode.NgramDrafter(params.ngram.max, params.ngram.min), chat_, params)


def _warm_up(c: Conversation, d: Decoders) -> None:
    """A short decode of ``c``'s first turn (first-call allocations, lazy hooks), not counted."""
    ids = d.chat.ids(c.messages_for([]), c.tools)
    decode.speculative(d.model, d.eagle, ids, min(8, d.params.max_new_tokens), d.chat.stops, d.params.num_steps)


def _by_benchmark(turns: list[Turn]) -> dict[str, list[Turn]]:
    """The turns of each benchmark, in order, each given its ``index`` among them."""
    by_benchmark = {}
    for t in turns:
        group = by_benchmark.setdefault(t.conversation.benchmark, [])
        t.index = len(group)
        group.append(t)
    return by_benchmark


def _position_rows(reports: dict) -> list[dict]:
    """``position_rows`` of every benchmark's report, the method named with its benchmark."""
    return [
        row | {"benchmark": name, "method": f"{name} {row['method']}"}
        for name, r in reports.items()
        for row in position_rows(
            {"eagle": r["acceptance_rate_per_position"], "ngram": r["baseline_acceptance_rate_per_position"]}
        )
    ]


def run(
    conversations: list[Conversation],
    chat_: Chat,
    model,
    drafter_model,
    params: config.Evaluate,
    rt: runtime.Runtime = runtime.Runtime(),  # noqa: B008  Runtime is frozen: the one-process default is a constant
) -> dict:
    """Decode this rank's share of the conversations (the module docstring); return, on every rank, the metrics of
    all: ``benchmarks`` (``report`` per benchmark, in order), ``lossless`` (False lists the ``mismatches``), ``run``
    (speeds), ``positions`` (``position_rows`` of each benchmark) and ``decoded`` (``decoded_record``s per
    benchmark)."""
    d = _decoders(chat_, model, drafter_model, params)
    mine = list(enumerate(conversations))[rt.rank :: rt.world]
    if mine:
        _warm_up(mine[0][1], d)
    done = [t for position, c in mine for t in _conversation(c, position, len(conversations), d)]
    turns = sorted((t for part in rt.gather(done) for t in part), key=lambda t: (t.position, t.turn))
    by_benchmark = _by_benchmark(turns)
    mismatches = [t.mismatch for t in turns if t.mismatch]
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
        "positions": _position_rows(reports),
        "decoded": {name: [decoded_record(t, d.eagle.layers) for t in ts] for name, ts in by_benchmark.items()},
    }


def load_drafter(folder, model):
    """The trained drafter on the target's device, given the target's input embedding (the drafter stores none)."""
    return methods.load(Path(folder), model.get_input_embeddings().weight).to(model.device)
