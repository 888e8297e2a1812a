"""What a user checks by eye before trusting a run (``make inspect``): a few random records with prompt, reasoning,
content and tool calls shown apart, their token counts, and whether each still re-derives from its ids.

The prompt is the record's own ``prompt_ids`` decoded with special tokens kept; a long field shows its start and its
end (a prompt mostly its end), ``max_chars`` in all. A record that answers one turn of a conversation (``infer.turns:
all``, ids ``<id>@<turn>``) is shown with every turn of its conversation, in order. Streams (never holds) published
responses or an infer cache's generations (``.cache/infer/<fingerprint>/generations.jsonl``; fields derived from ids).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

from eaglepipe.core.records import generation_from_json, prompt_of, response_from_json, scan_jsonl
from eaglepipe.text import derive, toolcalls

RULE = 100
PROMPT_TAIL_SHARE = 3 / 4  # a long prompt shows mostly its end: the last turns, the ones the answer follows


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(bool(line.strip()) for line in f)


def record(obj: dict, path, line_no: int, tokenizer=None, spec=None):
    """A response record; a bare generation (an infer cache line) gets its readable fields derived from its ids."""
    if "text" in obj:
        return response_from_json(obj, path, line_no)
    gen = generation_from_json(obj, path, line_no)
    if tokenizer is None or spec is None:
        raise ValueError(f"{path}:{line_no} is a generation without readable fields: deriving them needs params.yaml")
    return derive.to_response(gen, tokenizer, spec, None)


def sample(path: Path, n: int, seed: int, source: str | None = None, tokenizer=None, spec=None) -> tuple[int, list]:
    """(records in the file, up to ``n`` of them picked at random with ``seed``, in file order)."""
    path = Path(path)
    if source is None:
        total = count_lines(path)
        picked = set(random.Random(seed).sample(range(total), min(n, total)))
        out, k = [], 0
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if k in picked:
                    out.append(record(json.loads(line), path, line_no, tokenizer, spec))
                k += 1
        return total, out
    matching = []  # filtering by source needs a look at every record
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                obj = json.loads(line)
                if obj.get("source") == source:
                    matching.append((line_no, obj))
    picked = sorted(random.Random(seed).sample(range(len(matching)), min(n, len(matching))))
    return len(matching), [record(matching[i][1], path, matching[i][0], tokenizer, spec) for i in picked]


def conversations(path: Path, picked: list, tokenizer=None, spec=None) -> list[list]:
    """Each picked record alone, or with every turn of its conversation in turn order when it answers one (a
    conversation picked twice is shown once); a line that does not parse and a repeated id are passed over."""
    key = lambda r: (prompt_of(r.id), r.sample)  # noqa: E731
    wanted = {key(r) for r in picked if r.turn}
    turns, seen = defaultdict(list), set()
    if wanted:
        with open(path, "rb") as f:
            for line_no, _, obj in scan_jsonl(f):
                if not isinstance(obj, dict) or obj.get("id") in seen or not isinstance(obj.get("id"), str):
                    continue
                conversation = (prompt_of(obj["id"]), obj.get("sample", 0))
                if conversation in wanted:
                    seen.add(obj["id"])
                    turns[conversation].append(record(obj, path, line_no, tokenizer, spec))
    out, shown = [], set()
    for r in picked:
        if not r.turn:
            out.append([r])
        elif key(r) not in shown:
            shown.add(key(r))
            out.append(sorted(turns[key(r)], key=lambda t: t.turn))
    return out


def clip(text: str, max_chars: int, tail_share: float = 1 / 3) -> str:
    """``text``, or when it is longer than ``max_chars`` (0: no limit) its start and its end (``tail_share`` of
    ``max_chars``) around a note of how many characters are left out."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    n_tail = int(max_chars * tail_share)
    head, tail = text[: max_chars - n_tail], text[len(text) - n_tail :]
    return f"{head}\n[... {len(text) - len(head) - len(tail)} more characters ...]\n{tail}"


def section(title: str, body: str, max_chars: int, tail_share: float = 1 / 3) -> list:
    """A titled field, clipped; the blank lines around it are not shown."""
    shown = body.strip("\n")
    return [
        f"-- {title} " + "-" * max(3, RULE - len(title) - 4),
        clip(shown, max_chars, tail_share) if shown else "(empty)" if not body else "(blank lines only)",
    ]


def tokens(tokenizer, text: str) -> str:
    return (
        f"~{len(tokenizer(text, add_special_tokens=False)['input_ids'])}"
        if tokenizer is not None and text
        else "0"
        if not text
        else "?"
    )


def closed_note(r) -> str:
    if r.reasoning_closed:
        return "closed" if r.reasoning else "none"
    if r.finish_reason == "stop":
        return "NEVER CLOSED although the model stopped: is the thinking missing?"
    return f"never closed: cut short ({r.finish_reason})"


def call_line(call: dict) -> str:
    if toolcalls.is_error(call):
        return f"PARSE FAILURE: {call['error']}\n     raw: {call['raw']!r}"
    f = call["function"]
    args = f["arguments"] if isinstance(f["arguments"], str) else json.dumps(f["arguments"], ensure_ascii=False)
    return f"{f['name']}({args})" + (f"  [id {call['id']}]" if call.get("id") else "")


def show(r, tokenizer=None, spec=None, max_chars: int = 1200, index: str = "") -> str:
    """One record, its parts apart."""
    check = ""
    if tokenizer is not None and spec is not None:
        bad = derive.mismatch(r, tokenizer, spec)
        check = " | re-derived from ids: " + ("ok" if bad is None else f"MISMATCH in '{bad}'")
    turn = f" | turn {r.turn}" if r.turn else ""
    head = f"== {index}id {r.id}{turn} | source {r.source} | finish {r.finish_reason} "
    errors = toolcalls.count_errors(r.tool_calls)
    lines = [
        head + "=" * max(3, RULE - len(head)),
        f"tokens: prompt {len(r.prompt_ids)} | output {len(r.output_ids)} (reasoning "
        f"{tokens(tokenizer, r.reasoning)}, content {tokens(tokenizer, r.content)}) | tool calls "
        f"{len(r.tool_calls) - errors}" + (f" + {errors} unparsed" if errors else "") + check,
    ]
    if tokenizer is not None:
        lines += section(
            "prompt (its prompt_ids decoded)",
            tokenizer.decode(r.prompt_ids, skip_special_tokens=False),
            max_chars,
            PROMPT_TAIL_SHARE,
        )
    else:
        lines += section("prompt", "(not decoded: that needs the tokenizer, from --params)", 0)
    lines += section(f"reasoning ({closed_note(r)})", r.reasoning, max_chars)
    lines += section("content", r.content, max_chars)
    if r.tool_calls:
        lines.append("-- tool calls " + "-" * (RULE - 14))
        lines += [f"  {i}. {call_line(c)}" for i, c in enumerate(r.tool_calls, start=1)]
    return "\n".join(lines)


def report_line(report: dict) -> str:
    """One line of the run report (metrics/infer.json) for context."""
    n = report.get("completions", 0) or 1
    tc = report.get("tool_calls", {})
    return (
        f"run report: {report.get('completions', 0)} records | with reasoning {report.get('with_reasoning', 0)} "
        f"({100 * report.get('with_reasoning', 0) / n:.1f}%) | unclosed {report.get('unclosed_reasoning', 0)} | "
        f"finish {report.get('finish_reason', {})} | tool calls {tc.get('calls', 0)} in {tc.get('records', 0)} "
        f"records, {tc.get('parse_failures', 0)} unparsed | gates {report.get('gates', {})}"
    )


def render(
    path: Path,
    n: int = 3,
    seed: int = 0,
    tokenizer=None,
    spec=None,
    max_chars: int = 1200,
    source: str | None = None,
    report: dict | None = None,
) -> str:
    total, picked = sample(Path(path), n, seed, source, tokenizer, spec)
    where = f"{path}" + (f" (source {source})" if source else "")
    out = [report_line(report)] if report else []
    out.append(f"{where}: {total} records; showing {len(picked)} picked at random (--seed {seed})")
    groups = conversations(Path(path), picked, tokenizer, spec)
    for i, group in enumerate(groups, start=1):
        if group[0].turn:
            out += [
                "",
                f"#### {i}/{len(groups)} conversation {prompt_of(group[0].id)}, sample {group[0].sample}: "
                f"{len(group)} turn(s)",
            ]
            out += [part for r in group for part in ("", show(r, tokenizer, spec, max_chars))]
        else:
            out += ["", show(group[0], tokenizer, spec, max_chars, f"{i}/{len(groups)} ")]
    return "\n".join(out)
