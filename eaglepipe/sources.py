"""Source readers: one converter per prompt-source format, each turning a raw record into OpenAI-style messages.

A converter takes one raw record (a dict) and returns ``(messages, tools)``, the conversation cut after its last user
(or tool) turn: the assistant answer that will be regenerated is dropped, earlier assistant turns stay.
A broken record raises ``BadRecord(reason, field, problem)``; ``read_source`` turns it into a ``records.RecordError``
naming file, line (or JSON array index) and field, and carries the reason so skipped records can be counted.
Files are streamed (memory does not grow with their size); a file cut short, or a JSON array broken so that no later
record can be found, ends in a ``Damage``: its byte offset, its size and the records read before it.

Formats (field layouts of the public datasets they are named after):
    sharegpt          ``conversations``: turns ``{from, value}`` (human/gpt/system/function_call/observation...) or
                      ``{role, content}``; optional ``system`` and ``tools`` (LLaMA-Factory's layout)
    openai            ``messages``: turns ``{role, content}``; optional ``tools`` (e.g. HuggingFaceH4/ultrachat_200k)
    glaive            ``system`` ("SYSTEM: ... -" then JSON function definitions) and a ``chat`` transcript of
                      "USER:", "ASSISTANT:" (with "<functioncall> {...}") and "FUNCTION RESPONSE:" turns
                      (glaiveai/glaive-function-calling-v2)
    opencodeinstruct  ``input`` prompt, ``output`` answer, plus ids and metadata (nvidia/OpenCodeInstruct)
    magicoder         ``problem``/``solution`` (Magicoder-OSS-Instruct-75K) or ``instruction``/``response``
                      (Magicoder-Evol-Instruct-110K)
    alpaca            ``instruction``, optional ``input``, ``output`` (tatsu-lab/alpaca)
"""
from __future__ import annotations

import json
import os
import re
from typing import BinaryIO, Iterator

import ijson

from eaglepipe.records import LineError, Prompt, RecordError, content_id, scan_jsonl


class BadRecord(ValueError):
    """A record that cannot become a prompt; ``reason`` is the short key counted in the report. ``damage`` is None
    but for a ``Damage``."""

    damage: dict | None = None

    def __init__(self, reason: str, field: str | None, problem: str):
        super().__init__(problem)
        self.reason, self.field, self.problem = reason, field, problem


# ---------------------------------------------------------------------------------------------------------- files

CHUNK = 1 << 16
"""Bytes read at a time from a JSON array file; a record may span any number of chunks."""


class Damage(BadRecord):
    """The unreadable tail of a file: it starts at byte ``offset`` and runs to the end of the file (``size`` bytes),
    after ``records_before`` records read whole. ``damage`` is its entry in the prepare report."""

    def __init__(self, offset: int, size: int, records_before: int, cause: str):
        super().__init__("damaged", None, f"is damaged from byte {offset} to its end ({size} bytes): {cause}")
        self.damage = {"offset": offset, "bytes": size, "records_before": records_before}


def _skip(f: BinaryIO, offset: int, comma: bool) -> int:
    """The offset of the first byte from ``offset`` on that is neither JSON whitespace nor, with ``comma``, the first
    comma met."""
    f.seek(offset)
    while (b := f.read(1)) and (b in b" \t\r\n" or comma and b == b","):
        comma = comma and b != b","
        offset += 1
    return offset


def _jsonl(f: BinaryIO) -> Iterator[tuple[int, dict | BadRecord]]:
    """(line, object or BadRecord) per non-blank line: a broken line does not stop the lines after it. A last line
    that lacks its newline and does not parse was cut short: it is the file's Damage."""
    size = os.fstat(f.fileno()).st_size
    for index, (n, raw, item) in enumerate(scan_jsonl(f)):
        if isinstance(item, LineError) and not raw.endswith(b"\n"):
            item = Damage(size - len(raw), len(raw), index,
                          f"its last line is cut short and {item.problem} (record index {index}, counted from 0)")
        elif isinstance(item, LineError):
            item = BadRecord(item.reason, None, item.problem)
        yield n, item


def _parser(target):
    """An incremental parser of a JSON array: bytes sent to it send each item to ``target`` as soon as it is whole."""
    return ijson.items_coro(target, "item", use_float=True)


class _Count:
    """A parser target that only counts the items."""

    def __init__(self):
        self.n = 0

    def send(self, _item):
        self.n += 1


def _json_array(f: BinaryIO) -> Iterator[tuple[int, object]]:
    """(array index, item) per item of a JSON array file, read ``CHUNK`` bytes at a time: memory holds a chunk and
    the items ending in it, whatever the file's size. When the file is cut short, or broken so that no later item can
    be told apart, the last pair is (index of the first item not read, Damage)."""
    items, index, at, error = ijson.sendable_list(), 0, 0, None
    ended_in = 0  # offset of the chunk in which the last item so far ended
    parser = _parser(items)
    while True:
        chunk = f.read(CHUNK)
        try:
            parser.send(chunk) if chunk else parser.close()
        except ijson.JSONError as e:
            error = e
        if items:
            ended_in = at
        for item in items:
            yield index, item
            index += 1
        items.clear()
        if error or not chunk:
            break
        at += len(chunk)
    if error:
        start = _tail_start(f, index, ended_in)
        cause = f"the JSON array breaks off ({_first_line(error)})"
        yield index, Damage(start, os.fstat(f.fileno()).st_size - start, index, cause)


def _first_line(error: Exception) -> str:
    """The first line of the parser's message (the lines after it point into the text)."""
    message = error.args[0] if error.args else ""
    if isinstance(message, bytes):
        message = message.decode("utf-8", "replace")
    return (message.strip().splitlines() or ["not valid JSON"])[0]


def _tail_start(f: BinaryIO, count: int, ended_in: int) -> int:
    """Where the unreadable tail of a JSON array file starts: the first byte after its first ``count`` items and the
    separator after them (whitespace, a comma). The file is parsed again up to ``ended_in``, the chunk in which the
    last of those items ended, and that chunk one byte at a time."""
    if count == 0:
        return _skip(f, _skip(f, 0, comma=False) + 1, comma=False)
    done = _Count()
    parser = _parser(done)
    f.seek(0)
    while f.tell() < ended_in:
        parser.send(f.read(min(CHUNK, ended_in - f.tell())))
    end = ended_in
    while done.n < count:
        parser.send(f.read(1))
        end += 1
    return _skip(f, end, comma=True)


def raw_records(path) -> Iterator[tuple[int, bool, dict | BadRecord]]:
    """Yield ``(position, is_array_index, record or BadRecord)`` for a JSON Lines file or a JSON array file, streamed:
    memory does not grow with the file. A file that cannot be read to its end ends with a ``Damage``.

    The kind is told by content: a file whose first non-blank character is ``[`` is a JSON array (position is the
    array index, from 0), anything else is JSON Lines (position is the line number, from 1)."""
    with open(path, "rb") as f:
        f.seek(_skip(f, 0, comma=False))
        is_array = f.read(1) == b"["
        f.seek(0)
        for pos, item in _json_array(f) if is_array else _jsonl(f):
            yield pos, is_array, item


# ------------------------------------------------------------------------------------------------- turns and fields

ROLE_NAMES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool", "function_response": "tool", "ipython": "tool",
}


def _text(rec: dict, name: str, required: bool = True, where: str = "") -> str:
    """A string field; missing, non-string or blank raises (unless not required and absent or empty).
    ``where`` prefixes the field name in errors (e.g. ``conversations[2]``)."""
    field = f"{where}.{name}" if where else name
    if name not in rec or rec[name] is None:
        if required:
            raise BadRecord("missing_field", field, "is missing")
        return ""
    value = rec[name]
    if not isinstance(value, str):
        raise BadRecord("wrong_type", field, f"should be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise BadRecord("empty_field", field, "is empty")
    return value


def _list(rec: dict, name: str) -> list:
    if name not in rec:
        raise BadRecord("missing_field", name, "is missing")
    if not isinstance(rec[name], list):
        raise BadRecord("wrong_type", name, f"should be a list, got {type(rec[name]).__name__}")
    if not rec[name]:
        raise BadRecord("empty_conversation", name, "holds no turns")
    return rec[name]


def _tools(value, field: str = "tools") -> list | None:
    """OpenAI-style tools ``[{"type": "function", "function": {...}}]`` from a list (or its JSON string) of either
    that shape or bare function definitions ``{name, description, parameters}``."""
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRecord("bad_tools", field, f"is not valid JSON ({e.msg})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRecord("bad_tools", field, "should be a list of function definitions")
    tools = [t if "function" in t else {"type": "function", "function": t} for t in value]
    if not all(isinstance(t["function"], dict) and isinstance(t["function"].get("name"), str) for t in tools):
        raise BadRecord("bad_tools", field, "holds a function definition without a name")
    return tools


def _as_call(obj) -> dict | None:
    """``{"name": ..., "arguments": ...}`` (arguments a dict or its JSON string) as an OpenAI tool call with the
    arguments as a dict, as chat templates expect; None if it is not one."""
    try:
        args = obj.get("arguments", {})
        args = json.loads(args) if isinstance(args, str) else args
    except (AttributeError, json.JSONDecodeError):
        return None
    if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
        return None
    return {"type": "function", "function": {"name": obj["name"], "arguments": args}}


def _tool_call(text: str) -> dict | None:
    """The call written as JSON in ``text``, or None if it does not parse. Glaive writes the arguments as a
    single-quoted JSON string, which is accepted too."""
    fixed = re.sub(r"""("arguments"\s*:\s*)'(.*)'(\s*}\s*)$""", lambda m: m[1] + json.dumps(m[2]) + m[3], text.strip(),
                   flags=re.DOTALL)
    try:
        return _as_call(json.loads(fixed))
    except json.JSONDecodeError:
        return None


def _call_turn(content: str, call_text: str) -> dict:
    """An assistant turn that calls a function: the source's text stays as content (a template without tool
    support still sees the call) and the call, when it parses, is also given as ``tool_calls``."""
    turn = {"role": "assistant", "content": content}
    call = _tool_call(call_text)
    if call:
        turn["tool_calls"] = [call]
    return turn


def _calls(value, field: str) -> list:
    """OpenAI ``tool_calls`` (``[{"type": "function", "function": {name, arguments}}, ...]``), checked."""
    ok = isinstance(value, list) and value and all(isinstance(c, dict) for c in value)
    calls = [_as_call(c.get("function")) for c in value] if ok else [None]
    if None in calls:
        raise BadRecord("bad_tool_calls", field, "should be a list of {type, function: {name, arguments}}")
    return calls


def _role(value, field: str) -> str:
    if not isinstance(value, str) or value.lower() not in ROLE_NAMES:
        raise BadRecord("unknown_role", field, f"has an unknown role {value!r}")
    return ROLE_NAMES[value.lower()]


def _turns(turns: list, field: str, role_key: str, content_key: str) -> list[dict]:
    """Turns in either ``{from, value}`` or ``{role, content}`` shape to OpenAI messages."""
    messages = []
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise BadRecord("wrong_type", where, f"should be an object, got {type(turn).__name__}")
        content = _text(turn, content_key, required=False, where=where)
        if turn.get(role_key) == "function_call":  # LLaMA-Factory: the call's JSON as the turn's text
            messages.append(_call_turn(content, content))
            continue
        message = {"role": _role(turn.get(role_key), f"{where}.{role_key}"), "content": content}
        if "name" in turn:
            message["name"] = _text(turn, "name", where=where)
        if "tool_calls" in turn:
            message["tool_calls"] = _calls(turn["tool_calls"], f"{where}.tool_calls")
        messages.append(message)
    return messages


# ----------------------------------------------------------------------------------------------------- converters

def _prompt_turns(messages: list, field: str) -> list:
    """The conversation up to its last user (or tool) turn: the final assistant answer is dropped. A tool turn
    without a ``name`` gets the name of the call it answers."""
    if not any(m["role"] == "user" for m in messages):
        raise BadRecord("no_user_turn", field, "has no user turn")
    last = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool"))
    messages, called = messages[:last + 1], None
    for m in messages:
        if not m["content"].strip() and not m.get("tool_calls"):
            raise BadRecord("empty_turn", field, f"has an empty {m['role']} turn")
        if m.get("tool_calls"):
            called = m["tool_calls"][0]["function"]["name"]
        elif m["role"] == "tool" and called and "name" not in m:
            m["name"] = called
    return messages


def sharegpt(rec: dict) -> tuple[list, list | None]:
    turns = _list(rec, "conversations")
    shape = ("role", "content") if isinstance(turns[0], dict) and "role" in turns[0] else ("from", "value")
    messages = _turns(turns, "conversations", *shape)
    system = _text(rec, "system", required=False)
    if system.strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return _prompt_turns(messages, "conversations"), _tools(rec.get("tools"))


def openai(rec: dict) -> tuple[list, list | None]:
    messages = _turns(_list(rec, "messages"), "messages", "role", "content")
    return _prompt_turns(messages, "messages"), _tools(rec.get("tools"))


GLAIVE_TAGS = re.compile(r"(?:^|(?<=\s))(USER|ASSISTANT|FUNCTION RESPONSE):")
GLAIVE_EOS = "<|endoftext|>"
GLAIVE_CALL = "<functioncall>"


def _glaive_functions(system: str) -> list | None:
    """The JSON function definitions that follow the header of a glaive system prompt, or None if they don't parse."""
    start = system.find("{")
    if start < 0:
        return None
    decoder, functions, pos = json.JSONDecoder(), [], start
    try:
        while pos < len(system):
            obj, pos = decoder.raw_decode(system, pos)
            functions.append(obj)
            while pos < len(system) and system[pos].isspace():
                pos += 1
        return _tools(functions, "system")
    except (json.JSONDecodeError, BadRecord):
        return None


def _glaive_chat(chat: str) -> list[dict]:
    parts = GLAIVE_TAGS.split(chat)  # [text before the first tag, tag, text, tag, text, ...]
    if parts[0].strip():
        raise BadRecord("bad_transcript", "chat", "does not start with USER:, ASSISTANT: or FUNCTION RESPONSE:")
    messages = []
    for tag, text in zip(parts[1::2], parts[2::2]):
        text = text.replace(GLAIVE_EOS, "").strip()
        if tag == "USER":
            messages.append({"role": "user", "content": text})
        elif tag == "FUNCTION RESPONSE":
            messages.append({"role": "tool", "content": text})
        elif GLAIVE_CALL in text:
            messages.append(_call_turn(text, text.split(GLAIVE_CALL, 1)[1]))
        else:
            messages.append({"role": "assistant", "content": text})
    return messages


def glaive(rec: dict) -> tuple[list, list | None]:
    system = re.sub(r"^\s*SYSTEM:\s*", "", _text(rec, "system", required=False)).strip()
    messages = _glaive_chat(_text(rec, "chat"))
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return _prompt_turns(messages, "chat"), _glaive_functions(system)


def opencodeinstruct(rec: dict) -> tuple[list, list | None]:
    return [{"role": "user", "content": _text(rec, "input")}], None


def magicoder(rec: dict) -> tuple[list, list | None]:
    name = "problem" if "problem" in rec or "instruction" not in rec else "instruction"
    return [{"role": "user", "content": _text(rec, name)}], None


def alpaca(rec: dict) -> tuple[list, list | None]:
    instruction, extra = _text(rec, "instruction"), _text(rec, "input", required=False)
    return [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra.strip() else instruction}], None


FORMATS = {f.__name__: f for f in (sharegpt, openai, glaive, opencodeinstruct, magicoder, alpaca)}


# -------------------------------------------------------------------------------------------------------- prompts

def to_prompt(rec, fmt: str, source: str) -> Prompt:
    """One raw record of format ``fmt`` as a Prompt (raises BadRecord)."""
    if not isinstance(rec, dict):
        raise BadRecord("not_object", None, f"should be a JSON object, got {type(rec).__name__}")
    messages, tools = FORMATS[fmt](rec)
    return Prompt(content_id(messages, tools), source, messages, tools)


def read_source(path, fmt: str, source: str) -> Iterator[Prompt | RecordError]:
    """Each record of a source file as a Prompt, or as a RecordError (with ``.reason``, and ``.damage``: None, or
    for the unreadable tail of a damaged file ``{offset, bytes, records_before}``) when it is broken."""
    for pos, is_index, rec in raw_records(path):
        try:
            if isinstance(rec, BadRecord):
                raise rec
            yield to_prompt(rec, fmt, source)
        except BadRecord as bad:
            problem = bad.problem + (f" (record at JSON array index {pos}, counted from 0)" if is_index else "")
            err = RecordError(path, pos, bad.field, problem)
            err.reason, err.damage = bad.reason, bad.damage
            yield err
