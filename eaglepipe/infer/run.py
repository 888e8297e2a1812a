"""The infer run: prompts -> the target's own ids -> records, resumable.

``infer.turns: last`` answers each prompt's last turn; ``all`` answers turn k of every conversation after turn k - 1,
in the context of the target's own earlier answers (turns.py). A turn that fails, is aborted, breaks a limit or calls
a tool ends its conversation (the turns left unanswered are counted).

Each finished generation is appended and fsync'd to a cache keyed by ``fingerprint`` (model, engine, sampling,
template arguments, the code that renders and generates); a rerun with the same key reuses it. Readable fields are
derived from the ids when published (derive.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from eaglepipe.core.errors import UserError
from eaglepipe.core.fingerprint import code_key
from eaglepipe.core.records import (
    Generation,
    Prompt,
    RecordError,
    Response,
    generation_from_json,
    json_object,
    prompt_of,
    record_id,
    scan_jsonl,
    writer,
)
from eaglepipe.dataset import sequences
from eaglepipe.engines import Failure, Sampling
from eaglepipe.infer.gates import Gates
from eaglepipe.target import chat
from eaglepipe.text import toolcalls, turns
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


class Cache:
    """Append-only JSON Lines of finished generations (and of permanent failures) for one fingerprint."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "generations.jsonl"
        self.failures_path = folder / "failures.jsonl"

    def load(self) -> tuple[dict, Counter]:
        """(finished generations by id, counts). A torn last line is dropped and a duplicate id keeps its first
        record, both counted, and the file is rewritten without them (and with a last line's missing newline)."""
        done, counts = {}, Counter()
        if not self.path.exists():
            return done, counts
        good, torn, raw = [], None, b"\n"
        with open(self.path, "rb") as f:
            for n, raw, obj in scan_jsonl(f):
                if torn is not None:  # only the last line can be torn by a kill
                    raise torn
                try:
                    gen = generation_from_json(json_object(obj, self.path, n), self.path, n)
                except RecordError as e:
                    torn = e
                    continue
                if gen.id in done:
                    counts["duplicates"] += 1
                    continue
                done[gen.id] = gen
                good.append(raw.rstrip(b"\n"))
        if torn is not None:
            counts["torn_last_line"] += 1
        if counts or not raw.endswith(b"\n"):
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(b"".join(g + b"\n" for g in good))
                f.flush()
                os.fsync(f.fileno())  # the rewrite replaces fsynced records: it must be on disk first
            os.replace(tmp, self.path)
        return done, counts

    def _append(self, path: Path, record) -> None:
        """Append one line in one write and fsync it: once this returns, the record survives a kill."""
        line = io.BytesIO()
        writer(line).write(record)
        with open(path, "ab") as f:
            f.write(line.getvalue())
            f.flush()
            os.fsync(f.fileno())

    def add(self, gen: Generation) -> None:
        self._append(self.path, gen)

    def fail(self, rid: str, reason: str) -> None:
        self._append(self.failures_path, {"id": rid, "reason": reason})


@dataclass(frozen=True)
class Limits:
    """The limits a prompt must be within to be generated for (``admit``)."""

    context_length: int | None = None  # the target's (max_position_embeddings): prompt + max_new_tokens must fit
    max_length: int | None = None  # merge.max_length: the prompt must leave room for an answer (has_room)
    on_error: str = "fail"  # infer.on_error: a prompt that breaks a limit stops the run, or is left out
    where: str = "prompts"  # the prompts file, for messages


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


def admit(asks: list[Ask], sampling: Sampling, limits: Limits) -> tuple[list[Ask], dict]:
    """The asks within the limits, and {reason: [names]} of those left out (``exceeds_context``,
    ``no_room_in_max_length``). Under ``on_error: fail`` the first one left out is a UserError naming it."""
    kept, left_out = [], {}
    for a in asks:
        n, reason = len(a.ids), None
        if limits.context_length and n + sampling.max_new_tokens > limits.context_length:
            reason, why = (
                "exceeds_context",
                (
                    f"{n} prompt tokens + infer.max_new_tokens {sampling.max_new_tokens} "
                    f"exceed the target's context of {limits.context_length}"
                ),
            )
        elif limits.max_length and not sequences.has_room(n, limits.max_length):
            reason, why = (
                "no_room_in_max_length",
                (f"{n} prompt tokens leave no room for an answer within merge.max_length {limits.max_length}"),
            )
        if reason is None:
            kept.append(a)
            continue
        if limits.on_error == "fail":
            turn = f" at turn {a.turn} ({a.name})" if a.turn > 1 else ""
            raise UserError(
                f"{limits.where}:{a.line}: prompt {a.prompt.id} of source {a.prompt.source}{turn}: {why} "
                "(set infer.on_error: skip to leave such prompts out, counted)"
            )
        left_out.setdefault(reason, []).append(a.name)
    if left_out:
        log.warning("left out before generating: %s", {k: len(v) for k, v in left_out.items()})
    return kept, left_out


def run(
    prompts,
    engine,
    tokenizer,
    sampling: Sampling,
    spec: Spec,
    gates: Gates,
    cache: Cache,
    plan: Plan,
) -> tuple[list[Response], dict]:
    """Generate the ``plan.samples`` answers per prompt (per turn under ``plan.turns: all``) the cache lacks, checking
    the gates as records arrive; return (responses, report). Prompts outside ``plan.limits`` are left out (``admit``).
    Raises GateBreach, or UserError for too many failures, with everything generated kept in the cache."""
    samples, limits = plan.samples, plan.limits

    def ids_of(messages, p):
        return chat.prompt_ids(tokenizer, messages, p.tools, plan.template_kwargs)

    def respond(gen: Generation) -> Response:
        return to_response(gen, tokenizer, spec, sampling)

    done, cache_counts = cache.load()
    lines = {p.id: line for line, p in enumerate(prompts, start=1)}
    asks_of = {p.id: turns.asks(p.messages) for p in prompts} if plan.turns == "all" else {}
    history = {}  # (prompt id, sample) -> the target's answers so far, as assistant messages
    responses, failures, left_out, wanted_all = {}, [], {}, []
    into = Collect(cache, respond, gates, responses, failures)
    generated, progress, tool_ended = 0, [0, 0.0], 0  # progress: new tokens, seconds generating
    for turn in range(1, max(map(len, asks_of.values())) + 1) if asks_of else [0]:
        if turn <= 1:
            asks = [
                Ask(
                    lines[p.id],
                    p,
                    turn,
                    tuple(range(samples)),
                    ids_of(turns.interleave(asks_of[p.id], []) if turn else p.messages, p),
                )
                for p in prompts
            ]
        else:
            asks = [
                Ask(lines[pid], p, turn, (k,), ids_of(turns.interleave(asks_of[pid], answers), p))
                for (pid, k), answers in history.items()
                if len(answers) == turn - 1 < len(asks_of[pid])
                for p in [prompts[lines[pid] - 1]]
            ]
        asks, out = admit(asks, sampling, limits)
        for reason, names in out.items():
            left_out.setdefault(reason, []).extend(names)
        if turn <= 1 and not asks:
            raise UserError(
                f"{limits.where}: no prompt is left to generate for ({len(prompts)} read, left out: "
                f"{ {k: len(v) for k, v in left_out.items()} })"
            )
        wanted = [(a, k, record_id(a.prompt.id, k, a.turn)) for a in asks for k in a.samples]
        wanted_all += [rid for _, _, rid in wanted]
        todo = reuse(wanted, done, cache, respond, gates, responses)
        log.info(
            "%s%d prompts x %d samples: %d already generated (cache %s), %d to generate",
            f"turn {turn}: " if turn else "",
            len(asks),
            samples,
            len(wanted) - len(todo),
            cache.folder,
            len(todo),
        )
        generate(todo, turn, engine, sampling, into, progress)
        generated += len(todo)
        if asks_of:
            tool_ended += extend_history(
                history,
                wanted,
                turn,
                asks_of,
                responses,
                lambda r: answer_message(tokenizer, r.prompt_ids, r.output_ids, spec, sampling.stop_token_ids),
            )
    gates.check()
    if len(failures) > plan.max_failure_rate * len(wanted_all):
        raise UserError(
            f"{len(failures)} of {len(wanted_all)} answers failed (more than infer.max_failure_rate="
            f"{plan.max_failure_rate}); see {cache.failures_path}"
        )
    ordered = sorted(
        (responses[rid] for rid in wanted_all if rid in responses),
        key=lambda r: (lines[prompt_of(r.id)], r.sample, r.turn),
    )
    admitted = len({prompt_of(rid) for rid in wanted_all})
    rep = report(ordered, failures, cache_counts, generated, *progress, gates, admitted)
    if asks_of:
        per_turn = Counter(r.turn for r in ordered)
        rep["turns"] = {
            "mode": "all",
            "answered": dict(sorted(per_turn.items())),
            "unanswered": sum(map(len, asks_of.values())) * samples - len(ordered),
            "ended_at_tool_call": tool_ended,
        }
    return ordered, {**rep, "left_out": {k: len(v) for k, v in left_out.items()}, "left_out_ids": left_out}


def reuse(wanted: list, done: dict, cache: Cache, respond, gates: Gates, responses: dict) -> list:
    """Put the ``wanted`` answers the cache holds (``done``) into ``responses`` and the gates; return the others."""
    for a, _, rid in wanted:
        if rid in done:
            if done[rid].prompt_ids != a.ids:
                raise UserError(
                    f"{cache.path}: record {rid} was generated from other prompt ids; delete the cache folder"
                )
            responses[rid] = respond(done[rid])
            gates.add(responses[rid])
    return [w for w in wanted if w[2] not in done]


@dataclass(frozen=True)
class Collect:
    """Where ``generate`` puts what arrives: each answer into ``cache`` and its response (``respond``) into
    ``responses`` and ``gates``; each failure into the cache's failures file and ``failures``."""

    cache: Cache
    respond: Callable[[Generation], Response]
    gates: Gates
    responses: dict
    failures: list


def generate(todo: list, turn: int, engine, sampling: Sampling, into: Collect, progress: list) -> None:
    """Generate ``todo`` ((ask, sample, record id) each), each answer and failure ``into`` the run's records.
    ``progress`` = [new tokens, seconds] of the whole run, added to."""
    start, (tokens, seconds) = time.perf_counter(), progress
    desc = f"infer turn {turn}" if turn else "infer"
    with tqdm(total=len(todo), desc=desc, unit="answer", dynamic_ncols=True) as bar:
        for i, out in engine.stream([a.ids for a, _, _ in todo], sampling, [rid for _, _, rid in todo]):
            a, k, rid = todo[i]
            if isinstance(out, Failure):
                into.cache.fail(rid, out.reason)
                into.failures.append({"id": rid, "reason": out.reason})
            else:
                gen = Generation(rid, a.prompt.source, a.ids, out.output_ids, out.finish_reason, out.meta, k, a.turn)
                into.cache.add(gen)
                into.responses[rid] = into.respond(gen)
                into.gates.add(into.responses[rid])
                tokens += len(out.output_ids)
                if into.gates.due():
                    into.gates.check()
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / (seconds + time.perf_counter() - start):.1f}")
    progress[:] = [tokens, seconds + time.perf_counter() - start]


def extend_history(history: dict, wanted: list, turn: int, asks_of: dict, responses: dict, message) -> int:
    """Add each answer of ``turn`` (``message`` of its response) to its conversation's history where a turn follows;
    an aborted answer or a tool call (no dataset turn answers it) ends the conversation. Returns how many ended at a
    tool call."""
    tool_ended = 0
    for a, k, rid in wanted:
        r = responses.get(rid)
        if not (0 < turn < len(asks_of[a.prompt.id]) and r and r.finish_reason != "abort"):
            continue
        if r.tool_calls:
            tool_ended += 1
            continue
        history[(a.prompt.id, k)] = history.get((a.prompt.id, k), []) + [message(r)]
    return tool_ended


def report(
    responses: list[Response],
    failures: list,
    cache_counts: Counter,
    generated: int,
    new_tokens: int,
    elapsed: float,
    gates: Gates,
    prompts: int,
) -> dict:
    return {
        "prompts": prompts,
        "answers": len(responses) + len(failures),
        "completions": len(responses),
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
        "failures": len(failures),
        "tokens_in": sum(len(r.prompt_ids) for r in responses),
        "tokens_out": sum(len(r.output_ids) for r in responses),
        "per_source": dict(sorted(Counter(r.source for r in responses).items())),
        "run": {
            "generated": generated,
            "tokens_out": new_tokens,
            "seconds": round(elapsed, 2),
            "tokens_per_s": round(new_tokens / elapsed, 2) if elapsed > 0 and new_tokens else 0.0,
            **{f"cache_{k}": v for k, v in cache_counts.items()},
        },
        "gates": gates.summary(),
    }
