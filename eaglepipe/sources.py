"""Source readers: where a source's records come from, and one converter per prompt-source format, each turning a
raw record into OpenAI-style messages.

A converter takes one raw record (a dict) and returns ``(messages, tools, rules)``: the conversation cut after its
last user (or tool) turn (the assistant answer that will be regenerated is dropped, earlier assistant turns stay) and
the keys of the conversation rules that changed or concern it (``_prompt_turns``; the README states each rule). A
broken record raises ``BadRecord(reason, field, problem)``, a record with no prompt in it ``LeftOut``; ``read_source``
turns either into a ``records.RecordError`` naming file, line (or JSON array index, or dataset row) and field, and
carries the reason so the prepare report can count it.

Where records come from (``raw_records``), told by the path: a JSON Lines or JSON array file, gzip-compressed when its
name ends in ``.gz``, streamed (memory does not grow with its size); a file cut short, or a JSON array broken so that
no later record can be found, ends in a ``Damage``: its byte offset, its size and the records read before it. A
``datasets`` ``save_to_disk`` folder, a ``.parquet`` or ``.arrow`` file, or a folder of them, read through the
``datasets`` library with the hub switched off: arrow memory-mapped, parquet streamed. ``pkg:<package>/<path>`` is a
file inside an installed package, found without importing it (``resolve``).

Formats (field layouts of the public datasets they are named after; ``config.FORMATS`` lists the fields each reads,
which a source's ``columns`` may map onto differently named ones):
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
    mtbench           ``turns``: the user turns of one question (FastChat's mt_bench/question.jsonl); the prompt is
                      the first (a later turn needs the target's answer to the one before it)
"""
from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

import ijson

from eaglepipe.config import CACHE, PACKAGE_PATH
from eaglepipe.errors import UserError
from eaglepipe.hashing import file_hash
from eaglepipe.records import LineError, Prompt, RecordError, content_id, scan_jsonl


class BadRecord(ValueError):
    """A record that cannot become a prompt; ``reason`` is the short key counted in the report. ``damage`` is None
    but for a ``Damage``."""

    damage: dict | None = None

    def __init__(self, reason: str, field: str | None, problem: str):
        super().__init__(problem)
        self.reason, self.field, self.problem = reason, field, problem


class LeftOut(BadRecord):
    """A record with no prompt in it (an empty conversation, no user turn with text): left out by a rule and counted
    by reason, whatever ``on_error`` says; it is no error."""


# ---------------------------------------------------------------------------------------------------------- paths

def resolve(path: str) -> Path:
    """The file or folder a source's ``path`` names. ``pkg:<package>/<file>`` is ``<file>`` inside the installed
    top-level package ``<package>``, found with ``importlib.util.find_spec``, which locates a top-level package
    without running it (a package's own imports may need what is not installed: the data packages are installed
    ``--no-deps``). Raises FileNotFoundError when the package is not installed or lacks the file."""
    match = PACKAGE_PATH.fullmatch(path)
    if not match:
        return Path(path)
    spec = importlib.util.find_spec(match["package"])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{path}: no installed package {match['package']} (requirements.txt and the "
                                "Makefile's venv recipe install the data packages: make venv)")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / match["file"]).exists():
            return Path(folder) / match["file"]
    raise FileNotFoundError(f"{path}: the package {match['package']} (in {', '.join(spec.submodule_search_locations)})"
                            f" has no {match['file']}")


# ---------------------------------------------------------------------------------------------------------- files

CHUNK = 1 << 16
"""Bytes read at a time from a JSON array file; a record may span any number of chunks."""


def identity(path: str) -> dict:
    """What identifies a source file in a report: its path and sha256, and for a ``pkg:`` path its package
    (``package_file``)."""
    return {"path": path, **(package_file(path) if PACKAGE_PATH.fullmatch(path) else {"sha256": file_hash(path)})}


def package_file(path: str) -> dict:
    """What identifies the file a ``pkg:`` path names, for a report: its package's distribution and version (as
    pinned in requirements.txt) and the file's sha256."""
    package = PACKAGE_PATH.fullmatch(path)["package"]
    dists = importlib.metadata.packages_distributions().get(package, [])
    return {"distribution": ", ".join(dists), "version": ", ".join(importlib.metadata.version(d) for d in dists),
            "sha256": file_hash(resolve(path))}


class Damage(BadRecord):
    """The unreadable tail of a file: it starts at byte ``offset`` and runs to the end of the file (``size`` bytes),
    after ``records_before`` records read whole. ``damage`` is its entry in the prepare report. In a gzipped file
    the bytes are those of the decompressed data (``decompressed: true``): a break in a gzip stream cannot be
    placed on a byte of the compressed file, and nothing after it can be decompressed."""

    def __init__(self, offset: int, size: int, records_before: int, cause: str, gzipped: bool = False):
        data = " of its decompressed data" if gzipped else ""
        super().__init__("damaged", None, f"is damaged from byte {offset}{data} to its end ({size} bytes): {cause}")
        self.cause = cause
        self.damage = {"offset": offset, "bytes": size, "records_before": records_before}
        if gzipped:
            self.damage["decompressed"] = True


class _Gunzip(io.RawIOBase):
    """The decompressed bytes of a gzip file, seekable (a seek backwards decompresses again from the start). Where
    the compressed data ends early or is corrupt, the stream ends there and ``error`` says why."""

    def __init__(self, path):
        self.gz, self.error = gzip.open(path, "rb"), None

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.gz.tell()

    def readinto(self, buffer) -> int:
        try:
            data = self.gz.read1(len(buffer))
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            self.error = e
            return 0
        buffer[:len(data)] = data
        return len(data)

    def seek(self, offset, whence=io.SEEK_SET):
        if whence == io.SEEK_END:  # the decompressed size is known only once everything is read
            while self.readinto(bytearray(CHUNK)):
                pass
            return self.tell()
        return self.gz.seek(offset, whence)

    def close(self):
        self.gz.close()
        super().close()


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
    for index, (n, raw, item) in enumerate(scan_jsonl(f)):
        if isinstance(item, LineError) and not raw.endswith(b"\n"):  # the last line: f is at the end of the file
            item = Damage(f.tell() - len(raw), len(raw), index,
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
        yield index, Damage(start, f.seek(0, io.SEEK_END) - start, index, cause)


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


@contextmanager
def _open(path: Path):
    """``(binary file, gunzip)``: the file, or for a ``.gz`` name its decompressed data (``gunzip`` is then the
    decompressor, whose ``error`` tells where the compressed data broke off; None for a plain file)."""
    if path.suffix != ".gz":
        with open(path, "rb") as f:
            yield f, None
        return
    gunzip = _Gunzip(path)
    with io.BufferedReader(gunzip, CHUNK) as f:
        yield f, gunzip


def _json_records(path: Path) -> Iterator[tuple[int, str | None, dict | BadRecord]]:
    """The records of a JSON Lines or JSON array file, plain or gzipped (``raw_records``)."""
    with _open(path) as (f, gunzip):
        f.seek(_skip(f, 0, comma=False))
        unit = "JSON array index" if f.read(1) == b"[" else None
        f.seek(0)
        pos, count = 0, 0
        for pos, item in _json_array(f) if unit else _jsonl(f):
            if gunzip and isinstance(item, Damage):
                break_off = f"; the gzip stream breaks off: {gunzip.error}" if gunzip.error else ""
                d = item.damage
                item = Damage(d["offset"], d["bytes"], d["records_before"], item.cause + break_off, gzipped=True)
            yield pos, unit, item
            if isinstance(item, Damage):
                return
            count += 1
        if gunzip and gunzip.error:  # the records decompressed so far end whole, and nothing after them is readable
            end = f.seek(0, io.SEEK_END)
            yield (count if unit else pos + 1), unit, Damage(end, 0, count, f"the gzip stream breaks off after the "
                                                             f"last whole record: {gunzip.error}", gzipped=True)


DATASET_FILES = (".parquet", ".arrow")


def _is_dataset(path: Path) -> bool:
    """Whether ``path`` is read through ``datasets``: a folder, or a .parquet or .arrow file."""
    return path.is_dir() or path.suffix in DATASET_FILES


def _open_dataset(path: Path):
    """The rows of a Hugging Face dataset on disk as an iterable: a ``save_to_disk`` folder (``load_from_disk``) or
    ``.arrow`` files (``Dataset.from_file``), memory-mapped; ``.parquet`` files, streamed a record batch at a time
    (``load_dataset("parquet", streaming=True)``, which copies nothing). Offline: the hub is switched off before
    ``datasets`` is imported."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        raise UserError(f"{path}: holds the splits {', '.join(splits)}: name one of them, e.g. {path / splits[0]}")
    if (path / "state.json").is_file():
        return datasets.load_from_disk(str(path))
    files = sorted(p for p in path.iterdir() if p.suffix in DATASET_FILES) if path.is_dir() else [path]
    kinds = {p.suffix for p in files}
    if len(kinds) != 1:
        raise UserError(f"{path}: should be a datasets save_to_disk folder, or .parquet or .arrow files "
                        f"(found {'both kinds' if kinds else 'neither'})")
    if kinds == {".arrow"}:
        return datasets.concatenate_datasets([datasets.Dataset.from_file(str(p)) for p in files])
    return datasets.load_dataset("parquet", data_files=[str(p) for p in files], split="train", streaming=True,
                                 cache_dir=str(CACHE / "datasets"))  # where it keeps a lock file, no data


def _no_nulls(value):
    """``value`` without the None entries of its objects: arrow gives every row every key of a struct column, with
    None where the record had no such key."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def _dataset_records(path: Path, columns: tuple) -> Iterator[tuple[int, str, dict]]:
    """The rows of a dataset on disk (``raw_records``); ``columns`` must be among its columns."""
    import pyarrow

    try:
        rows = _open_dataset(path)
        missing = sorted(set(columns) - set(rows.column_names or columns))
        if missing:
            raise UserError(f"{path}: has no column {', '.join(missing)} (its columns: {', '.join(rows.column_names)})")
        for row, rec in enumerate(rows):
            yield row, "dataset row", _no_nulls(rec)
    except (OSError, ValueError, pyarrow.ArrowException) as e:
        raise UserError(f"{path}: not readable as a dataset ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def raw_records(path, columns: tuple = ()) -> Iterator[tuple[int, str | None, dict | BadRecord]]:
    """Yield ``(position, unit, record or BadRecord)`` for every record of a source, streamed: memory does not grow
    with its size. ``path`` may be a ``pkg:`` path (``resolve``); ``columns`` are the columns a dataset must have.

    A folder, a ``.parquet`` or an ``.arrow`` file is a dataset (position: the row, from 0; unit ``dataset row``). A
    file is told by content: one whose first non-blank character is ``[`` is a JSON array (position: the array index,
    from 0; unit ``JSON array index``), anything else JSON Lines (position: the line number, from 1; unit None); a file
    that cannot be read to its end ends with a ``Damage``."""
    path = resolve(str(path))
    yield from _dataset_records(path, columns) if _is_dataset(path) else _json_records(path)


# ------------------------------------------------------------------------------------------------- turns and fields

ROLE_NAMES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool", "function_response": "tool", "ipython": "tool",
}
OTHER_ASSISTANTS = ("chatgpt", "bing", "bard", "model")
"""Assistant role names that name another chatbot (ShareGPT keeps the one that answered)."""


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
        raise LeftOut("empty_conversation", name, "holds no turns")
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


def _role(value, field: str, rules: set) -> str:
    if not isinstance(value, str) or value.lower() not in ROLE_NAMES:
        raise BadRecord("unknown_role", field, f"has an unknown role {value!r}")
    if value.lower() in OTHER_ASSISTANTS:
        rules.add("other_assistant_names")
    return ROLE_NAMES[value.lower()]


def _turns(turns: list, field: str, role_key: str, content_key: str, rules: set) -> list[dict]:
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
        message = {"role": _role(turn.get(role_key), f"{where}.{role_key}", rules), "content": content}
        if "name" in turn:
            message["name"] = _text(turn, "name", where=where)
        if "tool_calls" in turn:
            message["tool_calls"] = _calls(turn["tool_calls"], f"{where}.tool_calls")
        messages.append(message)
    return messages


# ------------------------------------------------------------------------------------------- conversation rules

def _mergeable(m: dict) -> bool:
    """A turn that is text alone: no tool result, no tool calls, no speaker's name."""
    return m["role"] != "tool" and not m.get("tool_calls") and "name" not in m


def _prompt_turns(messages: list, field: str, rules: set) -> list:
    """The conversation as a prompt, by the conversation rules (README, prepare), each adding its key to ``rules``
    when it changes or concerns the record: empty turns are dropped, assistant turns before the first user turn are
    dropped, consecutive turns of one role are merged, and the conversation is cut after its last user (or tool)
    turn, which drops the final assistant answer. A tool turn without a ``name`` gets the name of the call it
    answers. A conversation with no user turn left raises LeftOut."""
    kept = [m for m in messages if m["content"].strip() or m["role"] == "tool" or m.get("tool_calls")]
    if len(kept) < len(messages):
        rules.add("empty_turns_dropped")
    first_user = next((i for i, m in enumerate(kept) if m["role"] == "user"), None)
    if first_user is None:
        raise LeftOut("no_user_turn", field, "has no user turn with text")
    if any(m["role"] == "assistant" for m in kept[:first_user]):
        rules.add("leading_assistant_dropped")
        kept = [m for i, m in enumerate(kept) if i >= first_user or m["role"] != "assistant"]
    if kept[0]["role"] == "system":
        rules.add("system_first")
    if any(m["role"] == "system" for m in kept[1:]):
        rules.add("system_not_first")
    merged = []
    for m in kept:
        if merged and merged[-1]["role"] == m["role"] and _mergeable(merged[-1]) and _mergeable(m):
            merged[-1] = {**merged[-1], "content": f"{merged[-1]['content']}\n\n{m['content']}"}
            rules.add("consecutive_turns_merged")
        else:
            merged.append(dict(m))
    last = max(i for i, m in enumerate(merged) if m["role"] in ("user", "tool"))
    if last == len(merged) - 1:
        rules.add("ends_without_answer")
    called = None
    for m in merged[:last + 1]:
        if m.get("tool_calls"):
            called = m["tool_calls"][0]["function"]["name"]
        elif m["role"] == "tool" and called and "name" not in m:
            m["name"] = called
    return merged[:last + 1]


# ----------------------------------------------------------------------------------------------------- converters

def sharegpt(rec: dict) -> tuple[list, list | None, set]:
    turns, rules = _list(rec, "conversations"), set()
    shape = ("role", "content") if isinstance(turns[0], dict) and "role" in turns[0] else ("from", "value")
    messages = _turns(turns, "conversations", *shape, rules)
    if any(isinstance(t, dict) and str(t.get(shape[0])).lower() in ("user", "assistant") for t in turns):
        rules.add("user_assistant_names")
    system = _text(rec, "system", required=False)
    if system.strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return _prompt_turns(messages, "conversations", rules), _tools(rec.get("tools")), rules


def openai(rec: dict) -> tuple[list, list | None, set]:
    rules = set()
    messages = _turns(_list(rec, "messages"), "messages", "role", "content", rules)
    return _prompt_turns(messages, "messages", rules), _tools(rec.get("tools")), rules


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


def glaive(rec: dict) -> tuple[list, list | None, set]:
    system = re.sub(r"^\s*SYSTEM:\s*", "", _text(rec, "system", required=False)).strip()
    messages, rules = _glaive_chat(_text(rec, "chat")), set()
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return _prompt_turns(messages, "chat", rules), _glaive_functions(system), rules


def opencodeinstruct(rec: dict) -> tuple[list, list | None, set]:
    return [{"role": "user", "content": _text(rec, "input")}], None, set()


def magicoder(rec: dict) -> tuple[list, list | None, set]:
    name = "problem" if "problem" in rec or "instruction" not in rec else "instruction"
    return [{"role": "user", "content": _text(rec, name)}], None, set()


def alpaca(rec: dict) -> tuple[list, list | None, set]:
    instruction, extra = _text(rec, "instruction"), _text(rec, "input", required=False)
    return [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra.strip() else instruction}], None, set()


def mtbench(rec: dict) -> tuple[list, list | None, set]:
    turns = _list(rec, "turns")
    first = _text({"turns[0]": turns[0]}, "turns[0]")  # the first turn, named as errors name it
    return [{"role": "user", "content": first}], None, {"later_turns_dropped"} if len(turns) > 1 else set()


FORMATS = {f.__name__: f for f in (sharegpt, openai, glaive, opencodeinstruct, magicoder, alpaca, mtbench)}


# -------------------------------------------------------------------------------------------------------- prompts

def to_prompt(rec, fmt: str, source: str) -> tuple[Prompt, set]:
    """One raw record of format ``fmt`` as a Prompt and the keys of the conversation rules that concern it (raises
    BadRecord)."""
    if not isinstance(rec, dict):
        raise BadRecord("not_object", None, f"should be a JSON object, got {type(rec).__name__}")
    messages, tools, rules = FORMATS[fmt](rec)
    return Prompt(content_id(messages, tools), source, messages, tools), rules


def _as_named(field: str | None, columns: dict) -> str | None:
    """A format field in an error, named as the data names it (``messages[2].role`` read from column ``chat`` is
    ``chat[2].role``)."""
    head = re.match(r"[^.\[]+", field or "")
    return columns[head[0]] + field[head.end():] if head and head[0] in columns else field


def read_source(path, fmt: str, source: str, columns: dict | None = None,
                rules=None) -> Iterator[Prompt | RecordError]:
    """Each record of a source (``raw_records``) as a Prompt, or as a RecordError when it is broken or left out:
    ``.reason``; ``.left_out``, True for a record the rules leave out (no prompt in it, no error); ``.damage``, None
    or for the unreadable tail of a damaged file ``{offset, bytes, records_before}``. ``columns`` maps format fields
    onto the record's own names for them; ``rules`` (a Counter), when given, counts the prompts each conversation
    rule concerns."""
    columns, file = columns or {}, resolve(str(path))
    for pos, unit, rec in raw_records(file, tuple(columns.values())):
        try:
            if isinstance(rec, BadRecord):
                raise rec
            if isinstance(rec, dict) and columns:  # a mapped field is read from its column only
                rec = {**{k: v for k, v in rec.items() if k not in columns},
                       **{field: rec[column] for field, column in columns.items() if column in rec}}
            prompt, applied = to_prompt(rec, fmt, source)
            if rules is not None:
                rules.update(applied)
            yield prompt
        except BadRecord as bad:
            problem = bad.problem + (f" (record at {unit} {pos}, counted from 0)" if unit else "")
            err = RecordError(file, pos, _as_named(bad.field, columns), problem)
            err.reason, err.damage, err.left_out = bad.reason, bad.damage, isinstance(bad, LeftOut)
            yield err
