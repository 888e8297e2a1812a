"""Every record the pipeline writes; stages read and write records only through this module.

Prompt (``data/prompts/prompts.jsonl`` by prepare; evaluate's ``data/eval/heldout.jsonl`` is the same)
    id        str   stable hash of the content (messages + tools), 16 hex digits
    source    str   name of the source in ``prepare.sources``
    messages  list  OpenAI-style turns ``{role, content}`` (plus ``tool_calls``/``name`` where the data has them),
                    ending with the last user (or tool) turn: the assistant answer to regenerate is dropped
    tools     list  optional, OpenAI-style function definitions passed to the chat template

Generation (one line of the infer cache; what an engine returned, nothing derived)
    id, source, prompt_ids, output_ids, finish_reason ("stop" | "length" | "abort"), meta (engine metadata),
    sample (which of the prompt's ``infer.samples`` answers: 0, 1, ...), turn (0: the answer to the last turn in the
    dataset's context; t >= 1 under ``infer.turns: all``: turn t in the target's own context, turns.py).
    ``id`` (``record_id``): the prompt's id for sample 0, ``<prompt id>.<sample>`` after, plus ``@<turn>`` for t >= 1.
    logprobs: the engine's own raw log-probability (float32 log-softmax of its logits, before temperature and the
    filters) of each output id, rounded to 5 decimals, as long as ``output_ids``; ``null`` for a token the engine
    gave no figure, and for the whole list in answers cached before engines reported them (engines/logprobs.py).

Response (``data/responses/responses.jsonl``, written by infer)
    id, source, prompt_ids, output_ids, finish_reason, sample, turn     exactly as the engine produced them
    text          output_ids decoded with special tokens kept
    reasoning     the reasoning part of the output, derived from the ids (empty for models without reasoning)
    content       the answer part (tool-call tokens included), derived from the ids
    reasoning_closed  False when the output opened a reasoning block and never closed it (truncated)
    tool_calls    calls parsed out of ``content`` for families with known markers (may be empty)
    sampling      the sampling parameters used
    meta          engine metadata (engine name, token counts; not ``derive.PER_RUN``: infer's cache keeps those)
    logprobs      as in Generation (hidden checks them against the states' model: hidden/agreement.py)

Training sequences (``data/sequences/{train,valid}/``, written by merge) are binary, see ``sequences.py``:
    per sample ``input_ids`` (= prompt_ids + output_ids) and ``loss_mask`` (1 exactly on output ids).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

import jsonlines
import orjson

from eaglepipe.core.errors import UserError

FINISH_REASONS = ("stop", "length", "abort")
ROLES = ("system", "user", "assistant", "tool")


class RecordError(UserError, ValueError):
    """A record that breaks the schema; the message names file, line and field."""

    def __init__(self, path, line: int | None, field_name: str | None, problem: str):
        where = f"{path}" + (f":{line}" if line is not None else "")
        what = f" field '{field_name}'" if field_name else ""
        super().__init__(f"{where}:{what} {problem}")
        self.path, self.line, self.field, self.problem = str(path), line, field_name, problem


def content_id(messages: list, tools: list | None) -> str:
    """Stable id of a prompt: sha256 of its canonical JSON, 16 hex digits."""
    blob = json.dumps({"messages": messages, "tools": tools or None}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


@dataclass
class Prompt:
    id: str
    source: str
    messages: list
    tools: list | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        if not self.tools:
            d.pop("tools")
        return d


def record_id(prompt_id: str, sample: int, turn: int = 0) -> str:
    """The id of answer ``sample`` to prompt ``prompt_id`` (at ``turn`` under ``infer.turns: all``)."""
    rid = prompt_id if sample == 0 else f"{prompt_id}.{sample}"
    return rid if turn == 0 else f"{rid}@{turn}"


def prompt_of(rid: str) -> str:
    """The prompt id of record ``rid`` (prompt ids are hex digests: they hold no '.' or '@')."""
    return rid.partition("@")[0].partition(".")[0]


def sample_of(rid: str) -> int:
    """Which answer to its prompt record ``rid`` is (inverse of ``record_id``, with ``prompt_of``)."""
    return int(rid.partition("@")[0].partition(".")[2] or 0)


def turn_of(rid: str) -> int:
    """Which turn of its conversation record ``rid`` answers (0: the last, in the dataset's context)."""
    return int(rid.partition("@")[2] or 0)


@dataclass
class Generation:
    id: str
    source: str
    prompt_ids: list
    output_ids: list
    finish_reason: str
    meta: dict = field(default_factory=dict)
    sample: int = 0
    turn: int = 0
    logprobs: list | None = None


@dataclass
class Response:
    id: str
    source: str
    prompt_ids: list
    output_ids: list
    finish_reason: str
    text: str
    reasoning: str
    content: str
    reasoning_closed: bool
    tool_calls: list
    sampling: dict
    meta: dict
    sample: int = 0
    turn: int = 0
    logprobs: list | None = None


def _check(path, line, rec: dict, name: str, kind, nonempty: bool = False):
    if name not in rec:
        raise RecordError(path, line, name, "is missing")
    value = rec[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise RecordError(path, line, name, f"should be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    if nonempty and not value:
        raise RecordError(path, line, name, "is empty")
    return value


def _check_ids(path, line, rec: dict, name: str, nonempty: bool):
    ids = _check(path, line, rec, name, list, nonempty)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise RecordError(path, line, name, "should hold non-negative integer token ids")
    return ids


def _check_logprobs(path, line, rec: dict) -> list | None:
    """The optional ``logprobs``: absent or null, or one number (or null) per output id."""
    figures = rec.get("logprobs")
    if figures is None:
        return None
    if not isinstance(figures, list) or len(figures) != len(rec["output_ids"]):
        raise RecordError(
            path, line, "logprobs", f"should be null or a list as long as output_ids ({len(rec['output_ids'])})"
        )
    for x in figures:
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or x > 0):
            raise RecordError(
                path, line, "logprobs", f"should hold log-probabilities (numbers <= 0) or null, got {x!r}"
            )
    return figures


def prompt_from_json(rec: dict, path="<prompt>", line=None) -> Prompt:
    _check(path, line, rec, "id", str, True)
    _check(path, line, rec, "source", str, True)
    messages = _check(path, line, rec, "messages", list, True)
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content", ""), str):
            raise RecordError(path, line, "messages", f"holds a malformed turn: {str(m)[:80]}")
    tools = rec.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RecordError(path, line, "tools", "should be a list")
    return Prompt(rec["id"], rec["source"], messages, tools or None)


def _part_of(rid: str, part) -> int | None:
    """``part(rid)`` (sample_of, turn_of), or None for an id where it is no number."""
    try:
        return part(rid)
    except ValueError:
        return None


def generation_from_json(rec: dict, path="<generation>", line=None) -> Generation:
    _check(path, line, rec, "id", str, True)
    _check(path, line, rec, "source", str)
    _check_ids(path, line, rec, "prompt_ids", True)
    _check_ids(path, line, rec, "output_ids", False)
    if rec.get("finish_reason") not in FINISH_REASONS:
        raise RecordError(
            path, line, "finish_reason", f"should be one of {FINISH_REASONS}, got {rec.get('finish_reason')!r}"
        )
    sample = _check(path, line, rec, "sample", int)
    turn = rec.get("turn", 0)
    if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
        raise RecordError(path, line, "turn", f"should be a non-negative integer, got {turn!r}")
    if record_id(prompt_of(rec["id"]), sample, turn) != rec["id"]:
        rid = rec["id"]
        parts = _part_of(rid, sample_of), _part_of(rid, turn_of)
        name = "id" if None in parts else "sample" if parts[0] != sample else "turn" if parts[1] != turn else "id"
        raise RecordError(
            path,
            line,
            name,
            f"sample {sample}, turn {turn} and id {rid!r} disagree (answer k > 0 of "
            "a prompt has the id '<prompt id>.k', turn t of it '<id>@t')",
        )
    return Generation(
        rec["id"],
        rec["source"],
        rec["prompt_ids"],
        rec["output_ids"],
        rec["finish_reason"],
        rec.get("meta") or {},
        sample,
        turn,
        _check_logprobs(path, line, rec),
    )


def response_from_json(rec: dict, path="<response>", line=None) -> Response:
    gen = generation_from_json(rec, path, line)
    for name in ("text", "reasoning", "content"):
        _check(path, line, rec, name, str)
    _check(path, line, rec, "reasoning_closed", bool)
    _check(path, line, rec, "tool_calls", list)
    _check(path, line, rec, "sampling", dict)
    return Response(
        gen.id,
        gen.source,
        gen.prompt_ids,
        gen.output_ids,
        gen.finish_reason,
        rec["text"],
        rec["reasoning"],
        rec["content"],
        rec["reasoning_closed"],
        rec["tool_calls"],
        rec["sampling"],
        gen.meta,
        gen.sample,
        gen.turn,
        gen.logprobs,
    )


class LineError(ValueError):
    """A JSON Lines line that does not parse; ``reason`` is ``not_utf8`` or ``broken_json``."""

    def __init__(self, reason: str, problem: str):
        super().__init__(problem)
        self.reason, self.problem = reason, problem


def _line_error(e: jsonlines.InvalidLineError) -> LineError:
    cause = e.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return LineError("not_utf8", f"is not valid UTF-8 ({cause.reason} at byte {cause.start})")
    return LineError("broken_json", f"is not valid JSON ({cause.msg}, column {cause.colno})")


class _Lines:
    """The non-blank lines of a binary file; ``number`` and ``raw`` are those of the last line handed out."""

    def __init__(self, fp: BinaryIO):
        self.fp, self.number, self.raw = fp, 0, b""

    def __iter__(self):
        for number, raw in enumerate(self.fp, start=1):
            self.number, self.raw = number, raw
            if raw.strip():
                yield raw


def scan_jsonl(fp: BinaryIO) -> Iterator[tuple[int, bytes, object]]:
    """Yield (line number, raw line, value) for each non-blank line of the binary file ``fp``: the line's JSON (any
    type), or a LineError for a line that does not parse (the lines after it are still read)."""
    lines = _Lines(fp)
    reader = jsonlines.Reader(lines, loads=orjson.loads)
    while True:
        try:
            value = reader.read(allow_none=True)
        except EOFError:
            return
        except jsonlines.InvalidLineError as e:
            value = _line_error(e)
        yield lines.number, lines.raw, value


def json_object(value, path, line: int) -> dict:
    """A value from ``scan_jsonl`` as a JSON object; a broken line or another JSON type raises RecordError."""
    if isinstance(value, LineError):
        raise RecordError(path, line, None, value.problem)
    if not isinstance(value, dict):
        raise RecordError(path, line, None, f"should be a JSON object, got {type(value).__name__}")
    return value


def read_jsonl(path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for each non-blank line; a broken line raises RecordError naming it."""
    with open(path, "rb") as f:
        for n, _, value in scan_jsonl(f):
            yield n, json_object(value, path, n)


def read_prompts(path) -> list[Prompt]:
    return [prompt_from_json(obj, path, n) for n, obj in read_jsonl(path)]


def to_json(obj) -> dict:
    """The JSON object of a record: its ``to_json()``, a dataclass's fields in order, or a dict as it is."""
    if hasattr(obj, "to_json"):
        return obj.to_json()
    return obj if isinstance(obj, dict) else asdict(obj)


def writer(fp: BinaryIO) -> jsonlines.Writer:
    """A JSON Lines writer on the binary file ``fp``: each record (``to_json``) as one line of compact UTF-8 JSON,
    keys in the order given."""
    return jsonlines.Writer(fp, dumps=lambda obj: orjson.dumps(to_json(obj)))


def write_jsonl(path, items) -> int:
    """Write records atomically (temp file + rename): a crash never leaves a half-written output."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "wb") as f:
        out = writer(f)
        for item in items:
            out.write(item)
            n += 1
    os.replace(tmp, path)
    return n


def write_json(path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
