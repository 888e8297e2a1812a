"""Tool calls parsed out of a record's content, for model families with known tool-call markers.

``target.tool_calls`` names the family (formats and sources in docs/reasoning-and-tools.md):
    none          nothing is parsed
    hermes        ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``   Qwen2.5, Qwen3, Hermes
    qwen3_coder   ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``
                  Qwen3-Coder, Qwen3.5
    glm45         ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>``  GLM-4.5 .. 4.7
    kimi_k2       ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
                  {...}<|tool_call_end|><|tool_calls_section_end|>``  Kimi K2, K2 thinking, K2.5
    deepseek_v3   ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
                  <｜tool▁call▁end｜><｜tool▁calls▁end｜>``  DeepSeek-V3, V3-0324, R1, R1-0528
    deepseek_v31  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``  DeepSeek-V3.1, V3.2
    harmony       gpt-oss: a message whose header names ``to=functions.NAME`` (commentary channel), body JSON

Parsing reads the content string only: ids and text fields never change, the call's markers stay in ``content``.
Each call is ``{"type": "function", "function": {"name": ..., "arguments": {...}}}`` (the shape prompts use; ``id``
too when the model writes one). A call that does not parse (bad JSON, no name, unterminated) becomes
``{"error": <why>, "raw": <its text>}``, never fatal.
"""

from __future__ import annotations

import json
import re

from eaglepipe.text import harmony


def _call(name, arguments, **extra) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **extra}


def _error(why: str, raw: str) -> dict:
    return {"error": why, "raw": raw}


def is_error(call: dict) -> bool:
    return "error" in call


def count_errors(calls: list) -> int:
    return sum(1 for c in calls if is_error(c))


def _json_object(text: str):
    """A JSON object (dict) from ``text``, or raise ValueError with the reason."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"arguments are not JSON ({e.msg} at {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"arguments are a JSON {type(value).__name__}, not an object")
    return value


def _blocks(content: str, open_: str, close: str):
    """Yield (inner text, raw text, closed) per ``open_ ... close`` block; an unterminated last one runs to the end."""
    pos = 0
    while (s := content.find(open_, pos)) >= 0:
        e = content.find(close, s + len(open_))
        if e < 0:
            yield content[s + len(open_) :], content[s:], False
            return
        yield content[s + len(open_) : e], content[s : e + len(close)], True
        pos = e + len(close)


def _hermes(content: str) -> list:
    calls = []
    for inner, raw, closed in _blocks(content, "<tool_call>", "</tool_call>"):
        try:
            if not closed:
                raise ValueError("no </tool_call>")
            obj = _json_object(inner.strip())
            name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str) or not name:
                raise ValueError("no function name")
            if isinstance(args, str):  # some models write the arguments as a JSON string
                args = _json_object(args)
            if not isinstance(args, dict):
                raise ValueError("arguments are not an object")
            calls.append(_call(name, args))
        except ValueError as e:
            calls.append(_error(str(e), raw))
    return calls


_XML_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _qwen3_coder(content: str) -> list:
    calls = []
    for inner, raw, closed in _blocks(content, "<tool_call>", "</tool_call>"):
        m = _XML_FUNCTION.match(inner) if closed else None
        if not m:
            calls.append(_error("not <function=NAME>...</function> inside a closed <tool_call>", raw))
            continue
        # Values are text; the template adds a newline each side.
        args = {k.strip(): v.removeprefix("\n").removesuffix("\n") for k, v in _XML_PARAMETER.findall(m.group(2))}
        calls.append(_call(m.group(1).strip(), args))
    return calls


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_value(text: str):
    """GLM writes values raw: JSON where it parses (numbers, objects, booleans), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _glm45(content: str) -> list:
    calls = []
    for inner, raw, closed in _blocks(content, "<tool_call>", "</tool_call>"):
        name = re.split(r"<arg_key>|\n", inner, maxsplit=1)[0].strip()
        rest = inner[inner.find("<arg_key>") :] if "<arg_key>" in inner else ""
        leftover = _GLM_ARG.sub("", rest).strip()
        if not closed or not name or leftover:
            why = "no </tool_call>" if not closed else "no function name" if not name else "malformed arguments"
            calls.append(_error(why, raw))
            continue
        calls.append(_call(name, {k.strip(): _glm_value(v.strip()) for k, v in _GLM_ARG.findall(rest)}))
    return calls


def _sections(content: str, opener: str, closer: str, call: re.Pattern, read, missing_end: str) -> list:
    """Calls from sections ``opener`` .. ``closer`` of ``call`` matches alone (Kimi K2, DeepSeek). ``read(match)``
    gives ``_call(...)`` or raises ValueError; a bad section or call becomes an error entry."""
    calls = []
    for inner, raw, closed in _blocks(content, opener, closer):
        found = list(call.finditer(inner))
        if not closed or not found or call.sub("", inner).strip():
            calls.append(_error(missing_end if not closed else "malformed tool-call section", raw))
        for m in found:
            try:
                calls.append(read(m))
            except ValueError as e:
                calls.append(_error(str(e), m.group(0)))
    return calls


def _named(name: str) -> str:
    if not name:
        raise ValueError("no function name")
    return name


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([^<]*?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL
)


def _kimi_call(m: re.Match) -> dict:
    call_id = m.group(1)
    name = _named(call_id.split(":")[0].split(".")[-1])  # functions.get_weather:0 -> get_weather
    return _call(name, _json_object(m.group(2).strip()), id=call_id)


def _kimi_k2(content: str) -> list:
    return [
        c
        for opener, closer in (
            ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
            ("<|tool_call_section_begin|>", "<|tool_call_section_end|>"),
        )
        for c in _sections(content, opener, closer, _KIMI_CALL, _kimi_call, "no section end")
    ]


_DS_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_V3_BODY = re.compile(r"^([^\n]+)\n```(?:json)?\n(.*)\n```\s*$", re.DOTALL)


def _deepseek_v31_call(m: re.Match) -> dict:
    return _call(_named(m.group(1).strip()), _json_object(m.group(2).strip()))


def _deepseek_v3_call(m: re.Match) -> dict:
    if m.group(1).strip() != "function":
        raise ValueError(f"call type {m.group(1).strip()!r}, expected 'function'")
    body = _DS_V3_BODY.match(m.group(2))
    if not body:
        raise ValueError("not NAME\\n```json\\n{...}\\n```")
    return _call(_named(body.group(1).strip()), _json_object(body.group(2).strip()))


def _deepseek(content: str, read) -> list:
    return _sections(content, *_DS_CALLS, _DS_CALL, read, "no <｜tool▁calls▁end｜>")


def _harmony(content: str) -> list:
    calls = []
    for start, body, body_end, end, header, term in harmony.messages(content):
        _, recipient = harmony.header(header)
        if recipient is None or not recipient.startswith("functions."):
            continue  # an answer, a preamble, or a built-in tool (python, browser.*)
        raw = content[start:end]
        name = recipient[len("functions.") :]
        kind = header.split(harmony.CONSTRAIN, 1)[1].strip() if harmony.CONSTRAIN in header else ""
        try:
            if term != "<|call|>":
                raise ValueError(f"ends with {term or 'nothing'}, not <|call|>")
            if not name:
                raise ValueError("no function name")
            if kind and "json" not in kind:
                calls.append(_call(name, content[body:body_end]))  # a declared non-JSON payload, kept as text
                continue
            calls.append(_call(name, _json_object(content[body:body_end].strip())))
        except ValueError as e:
            calls.append(_error(str(e), raw))
    return calls


PARSERS = {
    "hermes": _hermes,
    "qwen3_coder": _qwen3_coder,
    "glm45": _glm45,
    "kimi_k2": _kimi_k2,
    "deepseek_v3": lambda c: _deepseek(c, _deepseek_v3_call),
    "deepseek_v31": lambda c: _deepseek(c, _deepseek_v31_call),
    "harmony": _harmony,
}


def parse(content: str, family: str | None) -> list:
    """The tool calls in ``content`` for ``family`` (``None``/``none``: no parsing). Never raises on model output."""
    if family in (None, "none"):
        return []
    if family not in PARSERS:
        raise ValueError(f"tool-call family {family!r}: expected one of {['none', *PARSERS]}")
    try:
        return PARSERS[family](content)
    except Exception as e:  # noqa: BLE001 - a parser bug must not stop a run; the record keeps its ids
        return [_error(f"parser failed: {type(e).__name__}: {e}", content)]
