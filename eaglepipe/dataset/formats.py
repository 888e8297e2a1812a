"""Prompt-source formats: one converter per format, each turning a raw record (a dict) into OpenAI-style messages.

A converter returns ``(messages, tools, rules)``: the conversation cut after its last user (or tool) turn (the
answer to regenerate dropped, earlier assistant turns kept) and the keys of the conversation rules that changed or
concern it (``_prompt_turns``; README). A broken record raises ``BadRecord(reason, field, problem)``, a record with
no prompt in it ``LeftOut``.

``CONVERTERS`` maps each format of ``config.FORMATS`` (which lists the fields each reads, that a source's ``columns``
may rename) to its converter. Field layouts, named after the public datasets:
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

Imports the standard library only: ``config`` imports this module.
"""

from __future__ import annotations

import json
import re


class BadRecord(ValueError):
    """A record that cannot become a prompt; ``reason``: the key the report counts. ``damage``: None but for a
    ``sources.Damage``."""

    damage: dict | None = None

    def __init__(self, reason: str, field: str | None, problem: str):
        super().__init__(problem)
        self.reason, self.field, self.problem = reason, field, problem


class LeftOut(BadRecord):
    """A record with no prompt in it (no turns, no user turn with text): left out and counted, whatever
    ``on_error`` says; no error."""


# ------------------------------------------------------------------------------------------------- turns and fields

ROLE_NAMES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
    "function_response": "tool",
    "ipython": "tool",
}
OTHER_ASSISTANTS = ("chatgpt", "bing", "bard", "model")
"""Assistant role names that name another chatbot (ShareGPT keeps the one that answered)."""


MEDIA = ("image", "image_url", "input_image", "video", "video_url", "audio", "input_audio")
"""Content part types that are not text (OpenAI's and Hugging Face's multi-part messages): refused."""


def _text(rec: dict, name: str, required: bool = True, where: str = "") -> str:
    """A string field; missing, non-string or blank raises (unless not required and absent or empty). ``where``
    prefixes the field name in errors (e.g. ``conversations[2]``)."""
    field = f"{where}.{name}" if where else name
    if name not in rec or rec[name] is None:
        if required:
            raise BadRecord("missing_field", field, "is missing")
        return ""
    value = rec[name]
    media = (
        [part.get("type") for part in value if isinstance(part, dict) and part.get("type") in MEDIA]
        if isinstance(value, list)
        else []
    )
    if media:
        raise BadRecord(
            "media",
            field,
            f"carries {', '.join(sorted(set(media)))} parts: prompts are text only "
            "(a multimodal target is served through its language model)",
        )
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
    """``{"name": ..., "arguments": dict or its JSON}`` as an OpenAI tool call, arguments a dict as chat templates
    expect; None if it is not one."""
    try:
        args = obj.get("arguments", {})
        args = json.loads(args) if isinstance(args, str) else args
    except (AttributeError, json.JSONDecodeError):
        return None
    if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
        return None
    return {"type": "function", "function": {"name": obj["name"], "arguments": args}}


def _tool_call(text: str) -> dict | None:
    """The call written as JSON in ``text``, or None; glaive's single-quoted JSON arguments parse too."""
    fixed = re.sub(
        r"""("arguments"\s*:\s*)'(.*)'(\s*}\s*)$""",
        lambda m: m[1] + json.dumps(m[2]) + m[3],
        text.strip(),
        flags=re.DOTALL,
    )
    try:
        return _as_call(json.loads(fixed))
    except json.JSONDecodeError:
        return None


def _call_turn(content: str, call_text: str) -> dict:
    """An assistant turn with the source's text as content and the call, when it parses, as ``tool_calls``."""
    call = _tool_call(call_text)
    return {"role": "assistant", "content": content, **({"tool_calls": [call]} if call else {})}


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
    """The conversation as a prompt by the conversation rules (README), each adding its key to ``rules`` when it
    changes or concerns the record: empty turns and assistant turns before the first user turn are dropped,
    consecutive turns of one role merged, and the conversation cut after its last user (or tool) turn. A tool turn
    without a ``name`` gets the name of the call it answers. No user turn left raises LeftOut."""
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
    for m in merged[: last + 1]:
        if m.get("tool_calls"):
            called = m["tool_calls"][0]["function"]["name"]
        elif m["role"] == "tool" and called and "name" not in m:
            m["name"] = called
    return merged[: last + 1]


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
GLAIVE_ROLES = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}


def _glaive_functions(system: str) -> list | None:
    """The JSON function definitions after a glaive system prompt's header, or None if they don't parse."""
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
        if tag == "ASSISTANT" and GLAIVE_CALL in text:
            messages.append(_call_turn(text, text.split(GLAIVE_CALL, 1)[1]))
        else:
            messages.append({"role": GLAIVE_ROLES[tag], "content": text})
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


CONVERTERS = {
    "sharegpt": sharegpt,
    "openai": openai,
    "glaive": glaive,
    "opencodeinstruct": opencodeinstruct,
    "magicoder": magicoder,
    "alpaca": alpaca,
    "mtbench": mtbench,
}
