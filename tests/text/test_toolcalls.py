"""Tool-call parsers: each family's documented format (docs/reasoning-and-tools.md), several calls, text around
them, and malformed calls that are counted, never fatal, and never change the ids or the content."""

import pytest
from reasoning_fixtures import ids, reasoning_tokenizer

from eaglepipe.core.records import Generation
from eaglepipe.engines import Sampling
from eaglepipe.infer.run import tally
from eaglepipe.target import chat
from eaglepipe.text import derive, toolcalls


def call(name, args, **extra):
    return {"type": "function", "function": {"name": name, "arguments": args}, **extra}


WEATHER = {"location": "Paris", "unit": "celsius"}

CASES = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>',
        [call("get_weather", WEATHER), call("get_time", {})],
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>",
        [call("get_weather", WEATHER)],
    ),
    "glm45": (
        "Checking.<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>get_time</tool_call>",
        [call("get_weather", {"location": "Paris", "days": 3}), call("get_time", {})],
    ),
    "kimi_k2": (
        "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"location": "Paris", "unit": "celsius"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
        [call("get_weather", WEATHER, id="functions.get_weather:0"), call("get_time", {}, id="functions.get_time:1")],
    ),
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"location": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
        "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        [call("get_weather", WEATHER), call("get_time", {})],
    ),
    "deepseek_v31": (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "Paris", "unit": "celsius"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        [call("get_weather", WEATHER)],
    ),
    "harmony": (
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location": "Paris", "unit": "celsius"}<|call|>',
        [call("get_weather", WEATHER)],
    ),
}


@pytest.mark.parametrize("family", list(CASES))
def test_documented_formats_parse(family):
    content, want = CASES[family]
    assert toolcalls.parse(content, family) == want


@pytest.mark.parametrize("family", list(CASES))
def test_plain_answers_have_no_calls(family):
    assert toolcalls.parse("The weather in Paris is mild.<|im_end|>", family) == []


def test_none_parses_nothing():
    assert toolcalls.parse(CASES["hermes"][0], "none") == [] and toolcalls.parse(CASES["hermes"][0], None) == []


def test_harmony_recipient_in_the_role_and_non_json_payloads():
    content = (
        '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.shell <|constrain|>text<|message|>ls -l<|call|>"
        "<|start|>assistant<|channel|>analysis to=python<|message|>1+1<|call|>"
    )  # built-in tool: not a function
    assert toolcalls.parse(content, "harmony") == [call("lookup", {"q": 1}), call("shell", "ls -l")]


MALFORMED = {
    "hermes": [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": {"a"',
    ],  # truncated
    "qwen3_coder": ["<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>"],
    "glm45": ["<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>", "<tool_call>f\n<arg_key>a</arg_key><arg_value>1"],
    "kimi_k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops}"
        "<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}",
    ],
    "deepseek_v3": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ],
    "deepseek_v31": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ],
    "harmony": [
        "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{bad}<|call|>",
        '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ',
    ],
}


@pytest.mark.parametrize("family, content", [(f, c) for f, cs in MALFORMED.items() for c in cs])
def test_a_malformed_call_is_an_error_entry(family, content):
    calls = toolcalls.parse(content, family)
    assert calls and toolcalls.count_errors(calls) >= 1
    bad = next(c for c in calls if toolcalls.is_error(c))
    assert bad["error"] and bad["raw"] and bad["raw"] in content


def test_one_bad_call_does_not_hide_the_good_ones():
    content = (
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>\nnot json\n</tool_call>'
        '<tool_call>\n{"name": "g", "arguments": "{\\"x\\": 2}"}\n</tool_call>'
    )
    calls = toolcalls.parse(content, "hermes")
    assert calls[0] == call("f", {}) and toolcalls.is_error(calls[1]) and calls[2] == call("g", {"x": 2})


def test_a_parser_crash_is_an_error_entry(monkeypatch):
    monkeypatch.setitem(toolcalls.PARSERS, "hermes", lambda c: 1 / 0)
    assert toolcalls.parse("<tool_call>", "hermes") == [
        {"error": "parser failed: ZeroDivisionError: division by zero", "raw": "<tool_call>"}
    ]


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="tool-call family"):
        toolcalls.parse("x", "openai")


# --- through the record: ids untouched, markers kept in content, failures counted ---------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return reasoning_tokenizer(tmp_path_factory)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
        },
    }
]


def test_tools_reach_the_chat_template(tok):
    text = chat.render(tok, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert '"name": "get_weather"' in text and "<tool_call>" in text


def test_tool_call_tokens_stay_in_ids_and_content(tok):
    spec = derive.spec_from_params("think", "hermes")
    prompt = chat.prompt_ids(tok, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    good = ids(
        tok,
        'Need the tool.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"location": '
        '"Paris"}}\n</tool_call><|im_end|>',
    )
    bad = ids(
        tok, 'Need the tool.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"loc</tool_call><|im_end|>'
    )
    responses = []
    for rid, out in (("good", good), ("bad", bad)):
        r = derive.to_response(Generation(rid, "tools", prompt, list(out), "stop", {}), tok, spec, Sampling())
        assert r.output_ids == out  # parsing never alters the ids
        assert tok.convert_tokens_to_ids("<tool_call>") in r.output_ids
        assert r.content.startswith("\n\n<tool_call>\n") and r.content.endswith("</tool_call><|im_end|>")
        assert r.reasoning == "Need the tool."
        assert derive.mismatch(r, tok, spec) is None
        responses.append(r)
    assert responses[0].tool_calls == [call("get_weather", {"location": "Paris"})]
    assert toolcalls.count_errors(responses[1].tool_calls) == 1
    assert tally(responses)["tool_calls"] == {"records": 2, "calls": 1, "parse_failures": 1}
