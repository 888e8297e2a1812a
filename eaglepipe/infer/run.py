"""The infer run: prompts -> the target's own ids -> records, resumable (``InferRun``).

``infer.turns: last`` answers each prompt's last turn; ``all`` answers turn k of every conversation after turn k - 1,
in the context of the target's own earlier answers (text/turns.py). A turn that fails, is aborted, breaks a limit or
calls a tool ends its conversation (the turns left unanswered are counted).

Each finished generation is appended and fsync'd to a cache (cache.py) keyed by ``fingerprint`` (model, engine,
sampling, template arguments, the code that renders and generates); a rerun with the same key reuses it. Readable
fields are derived from the ids when published (text/derive.py); the engine's log-probabilities of the ids
(engines/logprobs.py) are kept beside them, in the cache and the records (None in answers cached before engines gave
them: the report counts them, and a run that reuses them says so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from eaglepipe.core.errors import UserError
from eaglepipe.core.fingerprint import code_key
from eaglepipe.core.records import Generation, Prompt, Response, prompt_of, record_id
from eaglepipe.dataset import sequences
from eaglepipe.engines import Failure, Output, Sampling
from eaglepipe.engines.logprobs import Scored
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import Gates
from eaglepipe.infer.report import Progress, tally
from eaglepipe.target import chat
from eaglepipe.text import turns
from eaglepipe.text.derive import Spec, answer_message, to_response

log = logging.getLogger(__name__)
# The code that decides which ids a prompt gets (core/fingerprint.py), with the engine's own module; under
# infer.turns: all, HISTORY_CODE too (an answer becomes the next turn's history).
GENERATION_CODE = ("target.chat", "target.model", "target.quant", "engines")
HISTORY_CODE = ("text.turns", "text.derive", "text.reasoning", "text.harmony", "text.toolcalls")


def fingerprint(
    model_fp: str,
    engine_name: str,
    engine_identity: dict,
    sampling: Sampling,
    template_kwargs: dict,
    history: Spec | None = None,
) -> str:
    """The cache's key. ``history``: the spec that splits an answer into the next turn's history (None under
    ``infer.turns: last``)."""
    h = hashlib.sha256()
    h.update(code_key([*GENERATION_CODE, f"engines.{engine_name}", *(HISTORY_CODE if history else ())]).encode())
    blob = {
        "model": model_fp,
        "engine": engine_name,
        "identity": engine_identity,
        "sampling": sampling.to_json(),
        "template": template_kwargs,
    } | ({"turns": "all", "history": repr(history)} if history else {})
    h.update(json.dumps(blob, sort_keys=True).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Limits:
    """The limits a prompt must be within to be generated for (``InferRun.admit``)."""

    context_length: int | None = None  # the target's (max_position_embeddings): prompt + max_new_tokens must fit
    max_length: int | None = None  # merge.max_length: the prompt must leave room for an answer (has_room)
    on_error: str = "fail"  # infer.on_error: a prompt that breaks a limit stops the run, or is left out
    where: str = "prompts"  # the prompts file, for messages

    def breach(self, prompt_tokens: int, max_new_tokens: int) -> tuple[str, str] | None:
        """(reason, why) when a prompt of ``prompt_tokens`` breaks a limit (``exceeds_context``,
        ``no_room_in_max_length``), else None."""
        if self.context_length and prompt_tokens + max_new_tokens > self.context_length:
            why = (
                f"{prompt_tokens} prompt tokens + infer.max_new_tokens {max_new_tokens} "
                f"exceed the target's context of {self.context_length}"
            )
            return "exceeds_context", why
        if self.max_length and not sequences.has_room(prompt_tokens, self.max_length):
            why = f"{prompt_tokens} prompt tokens leave no room for an answer within merge.max_length {self.max_length}"
            return "no_room_in_max_length", why
        return None


@dataclass(frozen=True)
class Plan:
    """What a run asks of the target beyond the prompts: the chat template's arguments, ``samples`` answers per prompt
    (to its last turn, or to every turn under ``turns: all``) for the prompts within ``limits``, of which at most
    ``max_failure_rate`` may fail."""

    template_kwargs: dict
    max_failure_rate: float = 0.0
    samples: int = 1
    limits: Limits = Limits()
    turns: str = "last"


@dataclass(frozen=True)
class Ask:
    """One prompt to answer: its line and record, the turn (0 under ``infer.turns: last``), the samples that share
    these ids (all up to turn 1, one after) and the ids."""

    line: int
    prompt: Prompt
    turn: int
    samples: tuple
    ids: list

    @property
    def name(self) -> str:
        """What a report lists it as: the prompt id, or the record id of a later turn."""
        return self.prompt.id if self.turn <= 1 else record_id(self.prompt.id, self.samples[0], self.turn)


@dataclass(frozen=True)
class Wanted:
    """One answer a run wants: answer ``sample`` to ``ask``, record ``id``."""

    ask: Ask
    sample: int
    id: str


@dataclass
class InferRun:
    """One run over the prompts (``run``): the ``plan.samples`` answers per prompt (per turn under ``plan.turns:
    all``) that ``cache`` lacks, generated by ``engine`` with ``sampling``, each fsync'd to the cache and checked by
    ``gates`` as it arrives; the records' readable fields split by ``spec``. ``before_generating``, if given, is called
    once per run with the record ids and prompt ids of the first answers it generates, before the engine is asked
    for any (never when the cache holds every answer). One object per run."""

    engine: object  # stream(prompts, sampling, rids), as eaglepipe/engines/__init__.py says
    tokenizer: object
    sampling: Sampling
    spec: Spec
    gates: Gates
    cache: Cache
    plan: Plan
    before_generating: Callable[[list[str], list[list[int]]], None] | None = None
    cached: dict[str, Generation] = field(default_factory=dict, init=False)  # the cache's generations by record id
    lines: dict[str, int] = field(default_factory=dict, init=False)  # prompt id -> its line in the prompts
    asked: list[str] = field(default_factory=list, init=False)  # the record id of every answer wanted, in order
    responses: dict[str, Response] = field(default_factory=dict, init=False)  # by record id: reused or generated
    failures: list[dict] = field(default_factory=list, init=False)  # {"id", "reason"} per answer that failed
    left_out: dict[str, list[str]] = field(default_factory=dict, init=False)  # reason -> names of asks left out
    progress: Progress = field(default_factory=Progress, init=False)
    ended_at_tool_call: int = field(default=0, init=False)  # conversations whose answer called a tool (turns: all)
    reused_without_figures: int = field(default=0, init=False)  # answers from the cache without log-probabilities
    generating: bool = field(default=False, init=False)  # whether the engine was asked for an answer yet

    def run(self, prompts: list[Prompt]) -> tuple[list[Response], dict]:
        """Answer ``prompts``; return (responses in prompt, sample and turn order, report). Prompts outside
        ``plan.limits`` are left out (``admit``). Raises GateBreach, or UserError for too many failures, with
        everything generated kept in the cache."""
        self.cached, cache_counts = self.cache.load()
        self.lines = {p.id: line for line, p in enumerate(prompts, start=1)}
        if self.plan.turns == "all":
            self.answer_every_turn(prompts)
        else:
            self.answer_last_turn(prompts)
        self.gates.check()
        if self.reused_without_figures:
            log.warning(
                "%d answers in %s predate engine log-probabilities: hidden checks them by the target's likelihood "
                "alone; delete the folder to regenerate them with figures",
                self.reused_without_figures,
                self.cache.folder,
            )
        if len(self.failures) > self.plan.max_failure_rate * len(self.asked):
            raise UserError(
                f"{len(self.failures)} of {len(self.asked)} answers failed (more than infer.max_failure_rate="
                f"{self.plan.max_failure_rate}); see {self.cache.failures_path}"
            )
        ordered = sorted(
            (self.responses[rid] for rid in self.asked if rid in self.responses),
            key=lambda r: (self.lines[prompt_of(r.id)], r.sample, r.turn),
        )
        report = self.report(ordered, cache_counts)
        if self.plan.turns == "all":
            report["turns"] = self.turns_report(ordered, prompts)
        return ordered, report

    def ask(self, prompt: Prompt, turn: int, samples: tuple, messages: list) -> Ask:
        """``prompt`` at ``turn``, its chat rendered from ``messages``, for ``samples``."""
        ids = chat.prompt_ids(self.tokenizer, messages, prompt.tools, self.plan.template_kwargs)
        return Ask(self.lines[prompt.id], prompt, turn, samples, ids)

    def answer_last_turn(self, prompts: list[Prompt]) -> None:
        """``infer.turns: last``: every prompt as it is, at turn 0 (record ids without a turn)."""
        every_sample = tuple(range(self.plan.samples))
        self.answer([self.ask(p, 0, every_sample, p.messages) for p in prompts], 0, len(prompts))

    def answer_every_turn(self, prompts: list[Prompt]) -> None:
        """``infer.turns: all``: turn 1 of every conversation, then turn k of each whose turn k - 1 was answered, the
        dataset's earlier answers replaced by the target's own."""
        by_id = {p.id: p for p in prompts}
        asks_of = {p.id: turns.asks(p.messages) for p in prompts}
        history = {}  # (prompt id, sample) -> the target's answers so far, as assistant messages
        every_sample = tuple(range(self.plan.samples))
        for turn in range(1, max(map(len, asks_of.values()), default=1) + 1):
            if turn == 1:
                asks = [self.ask(p, 1, every_sample, turns.interleave(asks_of[p.id], [])) for p in prompts]
            else:
                asks = [
                    self.ask(by_id[pid], turn, (sample,), turns.interleave(asks_of[pid], answers))
                    for (pid, sample), answers in history.items()
                    if len(answers) == turn - 1 < len(asks_of[pid])
                ]
            wanted = self.answer(asks, turn, len(prompts))
            self.extend_history(history, wanted, asks_of)

    def answer(self, asks: list[Ask], turn: int, prompts_read: int) -> list[Wanted]:
        """The answers to ``asks`` within the limits (of ``turn``; 0 under ``infer.turns: last``): taken from the
        cache where it holds them, the others generated. Returns the answers wanted, in order."""
        asks = self.admit(asks)
        if turn <= 1 and not asks:
            raise UserError(
                f"{self.plan.limits.where}: no prompt is left to generate for ({prompts_read} read, left out: "
                f"{ {k: len(v) for k, v in self.left_out.items()} })"
            )
        wanted = [Wanted(a, k, record_id(a.prompt.id, k, a.turn)) for a in asks for k in a.samples]
        self.asked += [w.id for w in wanted]
        todo = self.reuse(wanted)
        log.info(
            "%s%d prompts x %d samples: %d already generated (cache %s), %d to generate",
            f"turn {turn}: " if turn else "",
            len(asks),
            self.plan.samples,
            len(wanted) - len(todo),
            self.cache.folder,
            len(todo),
        )
        self.generate(todo, turn)
        return wanted

    def admit(self, asks: list[Ask]) -> list[Ask]:
        """The asks within ``plan.limits``; the others go to ``left_out`` by reason. Under ``on_error: fail`` the
        first one left out is a UserError naming it."""
        limits = self.plan.limits
        kept, left_out = [], {}
        for candidate in asks:
            breach = limits.breach(len(candidate.ids), self.sampling.max_new_tokens)
            if breach is None:
                kept.append(candidate)
                continue
            reason, why = breach
            if limits.on_error == "fail":
                prompt = candidate.prompt
                turn = f" at turn {candidate.turn} ({candidate.name})" if candidate.turn > 1 else ""
                raise UserError(
                    f"{limits.where}:{candidate.line}: prompt {prompt.id} of source {prompt.source}{turn}: {why} "
                    "(set infer.on_error: skip to leave such prompts out, counted)"
                )
            left_out.setdefault(reason, []).append(candidate.name)
        if left_out:
            log.warning("left out before generating: %s", {k: len(v) for k, v in left_out.items()})
        for reason, names in left_out.items():
            self.left_out.setdefault(reason, []).extend(names)
        return kept

    def reuse(self, wanted: list[Wanted]) -> list[Wanted]:
        """Take the ``wanted`` answers the cache holds into the responses and the gates; return the others."""
        for w in wanted:
            gen = self.cached.get(w.id)
            if gen is None:
                continue
            if gen.prompt_ids != w.ask.ids:
                raise UserError(
                    f"{self.cache.path}: record {w.id} was generated from other prompt ids; delete the cache folder"
                )
            self.take(gen)
            if gen.logprobs is None:
                self.reused_without_figures += 1
        return [w for w in wanted if w.id not in self.cached]

    def take(self, gen: Generation) -> None:
        """Add the published record of ``gen`` to the responses and the gates."""
        response = to_response(gen, self.tokenizer, self.spec, self.sampling)
        response.logprobs = gen.logprobs
        self.responses[gen.id] = response
        self.gates.add(response)

    def generate(self, todo: list[Wanted], turn: int) -> None:
        """Generate ``todo`` with the engine, each answer or failure ``collect``ed as it arrives; before the run's
        first answer, ``before_generating``."""
        if todo and not self.generating:
            self.generating = True
            if self.before_generating is not None:
                self.before_generating([w.id for w in todo], [w.ask.ids for w in todo])
        start = time.perf_counter()
        seconds_before = self.progress.seconds
        desc = f"infer turn {turn}" if turn else "infer"
        with tqdm(total=len(todo), desc=desc, unit="answer", dynamic_ncols=True) as bar:
            for i, out in self.engine.stream([w.ask.ids for w in todo], self.sampling, [w.id for w in todo]):
                self.collect(todo[i], out)
                bar.update(1)
                bar.set_postfix(tok_s=f"{self.progress.tokens / (seconds_before + time.perf_counter() - start):.1f}")
        self.progress.seconds = seconds_before + time.perf_counter() - start
        self.progress.generated += len(todo)

    def collect(self, wanted: Wanted, out: Output | Failure) -> None:
        """A failure into the cache's failures file and ``failures``; an answer fsync'd to the cache, then into the
        responses and the gates (checked when due)."""
        if isinstance(out, Failure):
            self.cache.fail(wanted.id, out.reason)
            self.failures.append({"id": wanted.id, "reason": out.reason})
            return
        a = wanted.ask
        figures = out.logprobs if isinstance(out, Scored) else None
        gen = Generation(
            wanted.id,
            a.prompt.source,
            a.ids,
            out.output_ids,
            out.finish_reason,
            out.meta,
            wanted.sample,
            a.turn,
            logprobs=figures,
        )
        self.cache.add(gen)
        self.take(gen)
        self.progress.tokens += len(out.output_ids)
        if self.gates.due():
            self.gates.check()

    def extend_history(self, history: dict, wanted: list[Wanted], asks_of: dict) -> None:
        """Add each answer in ``wanted`` (as the assistant message an engine returns) to its conversation's history
        where a turn follows; an aborted answer or a tool call (no dataset turn answers it) ends the conversation."""
        for w in wanted:
            r = self.responses.get(w.id)
            if not (w.ask.turn < len(asks_of[w.ask.prompt.id]) and r and r.finish_reason != "abort"):
                continue
            if r.tool_calls:
                self.ended_at_tool_call += 1
                continue
            message = answer_message(
                self.tokenizer, r.prompt_ids, r.output_ids, self.spec, self.sampling.stop_token_ids
            )
            key = (w.ask.prompt.id, w.sample)
            history[key] = history.get(key, []) + [message]

    def turns_report(self, ordered: list[Response], prompts: list[Prompt]) -> dict:
        """The report's ``turns`` part under ``infer.turns: all``: the answers per turn, the dataset's turns left
        unanswered (times the samples) and the conversations that ended at a tool call."""
        dataset_turns = sum(len(turns.asks(p.messages)) for p in prompts)
        return {
            "mode": "all",
            "answered": dict(sorted(Counter(r.turn for r in ordered).items())),
            "unanswered": dataset_turns * self.plan.samples - len(ordered),
            "ended_at_tool_call": self.ended_at_tool_call,
        }

    def report(self, ordered: list[Response], cache_counts: Counter) -> dict:
        """The run's report: the published records' counts, the failures, the prompts left out, this run's progress
        (``run``) and the gates."""
        return {
            "prompts": len({prompt_of(rid) for rid in self.asked}),
            "answers": len(ordered) + len(self.failures),
            "completions": len(ordered),
            **tally(ordered),
            "failures": len(self.failures),
            "run": self.progress.report(cache_counts),
            "gates": self.gates.summary(),
            "left_out": {k: len(v) for k, v in self.left_out.items()},
            "left_out_ids": self.left_out,
        }
