"""The infer run: prompts -> the target's own tokens -> records, resumable and incremental.

Every finished generation is appended (and fsync'd) to a cache file keyed by a fingerprint of everything that
decides the ids: the model, the engine, the sampling parameters, the chat-template arguments and the code that
renders and generates. A rerun with the same fingerprint reuses what is there (resume after Ctrl-C or kill -9;
adding a source generates only its prompts); a different fingerprint gets a fresh cache, so records made under
different code, params or models never mix. Readable fields (text, reasoning, content, tool calls) are derived from
the ids when the output is published, so changing how they are derived regenerates nothing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from . import chat, reasoning, toolcalls
from .engines import Failure, Sampling
from .gates import Gates
from .records import Generation, RecordError, Response, dumps, generation_from_json, record_id

log = logging.getLogger(__name__)
PACKAGE = Path(__file__).resolve().parent
# The code that decides which ids a prompt gets; a change here starts a new cache.
GENERATION_CODE = ["chat.py", "target.py", "engines/__init__.py"]


def fingerprint(model_fp: str, engine_name: str, engine_identity: dict, sampling: Sampling, template_kwargs: dict) -> str:
    h = hashlib.sha256()
    for name in GENERATION_CODE + [f"engines/{engine_name}.py"]:
        h.update((PACKAGE / name).read_bytes())
    blob = {"model": model_fp, "engine": engine_name, "identity": engine_identity, "sampling": sampling.to_json(),
            "template": template_kwargs}
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
        """Finished generations by id. A torn last line (a kill mid-write) is dropped and counted; a duplicate id
        keeps its first record and is counted."""
        done, counts = {}, Counter()
        if not self.path.exists():
            return done, counts
        lines = self.path.read_bytes().split(b"\n")
        good = []
        for n, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                gen = generation_from_json(json.loads(raw), self.path, n)
            except (json.JSONDecodeError, UnicodeDecodeError, RecordError):
                if n >= len(lines) - 1:  # only the last line can be torn by a kill
                    counts["torn_last_line"] += 1
                    continue
                raise
            if gen.id in done:
                counts["duplicates"] += 1
                continue
            done[gen.id] = gen
            good.append(raw)
        if counts:  # rewrite without the torn line / duplicates so appends start on a clean line
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(b"".join(g + b"\n" for g in good))
            os.replace(tmp, self.path)
        return done, counts

    def _append(self, path: Path, line: str) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def add(self, gen: Generation) -> None:
        self._append(self.path, dumps(gen))

    def fail(self, rid: str, reason: str) -> None:
        self._append(self.failures_path, json.dumps({"id": rid, "reason": reason}))


def to_response(gen: Generation, tokenizer, spec: reasoning.Spec, sampling: Sampling | None) -> Response:
    """The published record: the generation's ids untouched, and every readable field derived from them
    (reasoning split by ``spec``, tool calls parsed for ``spec.tools``; a call that does not parse is kept as an
    ``{"error", "raw"}`` entry and counted in the report, never fatal). ``sampling`` None (unknown) is stored as {}."""
    f = reasoning.readable(tokenizer, gen.prompt_ids, gen.output_ids, spec)
    return Response(gen.id, gen.source, gen.prompt_ids, gen.output_ids, gen.finish_reason, f["text"], f["reasoning"],
                    f["content"], f["reasoning_closed"], f["tool_calls"], sampling.to_json() if sampling else {},
                    gen.meta, gen.sample)


def run(prompts, engine, tokenizer, sampling: Sampling, spec: reasoning.Spec, gates: Gates, cache: Cache,
        template_kwargs: dict, max_failure_rate: float = 0.0, samples: int = 1) -> tuple[list[Response], dict]:
    """Generate the ``samples`` answers per prompt that the cache lacks, check the gates as records arrive, and
    return (responses, report). Raises GateBreach (or RuntimeError for too many failures) after keeping everything
    generated in the cache."""
    if samples < 1 or samples > 1 and sampling.temperature <= 0:
        raise ValueError(f"infer.samples={samples}: needs 1, or more with temperature > 0 (greedy answers to one "
                         "prompt are all the same)")
    ids = {p.id: chat.prompt_ids(tokenizer, p.messages, p.tools, template_kwargs) for p in prompts}
    wanted = [(p, k, record_id(p.id, k)) for p in prompts for k in range(samples)]
    done, cache_counts = cache.load()
    responses = {}
    for p, _, rid in wanted:
        if rid in done:
            if done[rid].prompt_ids != ids[p.id]:
                raise RuntimeError(f"{cache.path}: record {rid} was generated from other prompt ids; "
                                   "delete the cache folder")
            responses[rid] = to_response(done[rid], tokenizer, spec, sampling)
            gates.add(responses[rid])
    todo = [w for w in wanted if w[2] not in done]
    log.info("%d prompts x %d samples: %d already generated (cache %s), %d to generate", len(prompts), samples,
             len(wanted) - len(todo), cache.folder, len(todo))
    failures, new_tokens, start = [], 0, time.perf_counter()
    with tqdm(total=len(todo), desc="infer", unit="answer", dynamic_ncols=True) as bar:
        for i, out in engine.stream([ids[p.id] for p, _, _ in todo], sampling, [rid for _, _, rid in todo]):
            p, k, rid = todo[i]
            if isinstance(out, Failure):
                cache.fail(rid, out.reason)
                failures.append({"id": rid, "reason": out.reason})
            else:
                gen = Generation(rid, p.source, ids[p.id], out.output_ids, out.finish_reason, out.meta, k)
                cache.add(gen)
                responses[rid] = to_response(gen, tokenizer, spec, sampling)
                gates.add(responses[rid])
                new_tokens += len(out.output_ids)
                if gates.due():
                    gates.check()
            bar.update(1)
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.1f}")
    gates.check()
    elapsed = time.perf_counter() - start
    if len(failures) > max_failure_rate * len(wanted):
        raise RuntimeError(f"{len(failures)} of {len(wanted)} answers failed (more than infer.max_failure_rate="
                           f"{max_failure_rate}); see {cache.failures_path}")
    ordered = [responses[rid] for _, _, rid in wanted if rid in responses]
    return ordered, report(ordered, failures, cache_counts, len(todo), new_tokens, elapsed, gates, len(prompts))


def report(responses: list[Response], failures: list, cache_counts: Counter, generated: int, new_tokens: int,
           elapsed: float, gates: Gates, prompts: int) -> dict:
    by_source = Counter(r.source for r in responses)
    return {
        "prompts": prompts,
        "answers": len(responses) + len(failures),
        "completions": len(responses),
        "finish_reason": dict(Counter(r.finish_reason for r in responses)),
        "empty_outputs": sum(1 for r in responses if not r.output_ids),
        "with_reasoning": sum(1 for r in responses if Gates.reasoned(r)),
        "unclosed_reasoning": sum(1 for r in responses if not r.reasoning_closed),
        "unclosed_reasoning_at_stop": sum(1 for r in responses
                                          if not r.reasoning_closed and r.finish_reason == "stop"),
        "tool_calls": {"records": sum(1 for r in responses if r.tool_calls),
                       "calls": sum(len(r.tool_calls) - toolcalls.count_errors(r.tool_calls) for r in responses),
                       "parse_failures": sum(toolcalls.count_errors(r.tool_calls) for r in responses)},
        "failures": len(failures),
        "tokens_in": sum(len(r.prompt_ids) for r in responses),
        "tokens_out": sum(len(r.output_ids) for r in responses),
        "per_source": dict(sorted(by_source.items())),
        "this_run": {"generated": generated, "tokens_out": new_tokens, "seconds": round(elapsed, 2),
                     "tokens_per_s": round(new_tokens / elapsed, 2) if elapsed > 0 and new_tokens else 0.0,
                     **{f"cache_{k}": v for k, v in cache_counts.items()}},
        "gates": gates.summary(),
    }
