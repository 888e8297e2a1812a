"""Reasoning split: the presets and their validation, each family's real output shapes. Records derived from ids and
the property test over thousands of random and adversarial token sequences are in test_reasoning_records.py."""

import pytest
from helpers import with_
from text_helpers import HARMONY, NONE, THINK, parts

from eaglepipe.core import config
from eaglepipe.text import derive, reasoning

# --- presets and their validation -------------------------------------------------------------------------------


def test_presets_and_custom_specs():
    assert not NONE.expects_reasoning and THINK.expects_reasoning and HARMONY.expects_reasoning
    assert (THINK.start, THINK.end) == ("<think>", "</think>")
    params = config.parse(
        with_(target={"reasoning": {"start": "<r>", "end": "</r>"}, "tool_calls": "hermes"})
    ).target  # what the stages pass
    custom = derive.spec_from_params(params.reasoning, params.tool_calls)
    assert (custom.kind, custom.start, custom.end, custom.tools) == ("tags", "<r>", "</r>", "hermes")
    assert reasoning.split("<r>why</r>answer", custom).reasoning == "why"


@pytest.mark.parametrize(
    "bad",
    [
        "thinking",
        {"start": "<r>"},
        {"start": "", "end": "</r>"},
        {"start": "<r>", "end": "<r>"},
        {"start": "<r>", "end": "</r>", "x": 1},
    ],
)
def test_bad_specs_are_refused_with_the_key(bad):
    with pytest.raises(config.ConfigError, match="target.reasoning"):
        config.parse(with_(target={"reasoning": bad}))
    with pytest.raises(ValueError, match="target.reasoning"):
        derive.spec_from_params(bad)


def test_unknown_tool_family_is_refused():
    with pytest.raises(ValueError, match="target.tool_calls"):
        derive.spec_from_params("think", "openai")


# --- the families' real shapes (docs/reasoning-and-tools.md) ------------------------------------------------------

PREFILLED = "<|im_start|>assistant\n<think>\n"  # DeepSeek-R1, Qwen3-Thinking-2507, Qwen3.5 (ChatML shown)
OPEN = "<|im_start|>assistant\n"  # Qwen3 hybrid (thinking on), Kimi K2 thinking, GLM-4.5


@pytest.mark.parametrize(
    "text, tail, want",
    [
        # prefilled opening tag: only the closing tag is generated
        ("Two and two.\n</think>\n\n4<|im_end|>", PREFILLED, ("Two and two.\n", "\n\n4<|im_end|>", True)),
        # Kimi K2.5 prefills "<think>" without a newline
        ("sum</think>4<|im_end|>", "<|im_assistant|>assistant<|im_middle|><think>", ("sum", "4<|im_end|>", True)),
        # the model opens the block itself
        ("<think>\nsum\n</think>\n\n4<|im_end|>", OPEN, ("\nsum\n", "\n\n4<|im_end|>", True)),
        # DeepSeek-R1-0528 writes <think> although the template opened it: the repeat is a marker
        ("<think>\nsum</think>4", PREFILLED, ("\nsum", "4", True)),
        # DeepSeek-R1 (before its template opened the tag) starts thinking without <think>
        ("sum</think>4", "<｜Assistant｜>", ("sum", "4", True)),
        # truncated inside the reasoning: reasoning holds it all, flagged unclosed
        ("Let me think about", PREFILLED, ("Let me think about", "", False)),
        ("<think>Let me", OPEN, ("Let me", "", False)),
        # no think tags at all (a template without them; the embedded SmolLM2): all content
        ("4<|im_end|>", OPEN, ("", "4<|im_end|>", True)),
        # thinking switched off: Qwen3 prefills a closed empty block, GLM-4.5 "\n<think></think>", V3.1 "</think>"
        ("4<|im_end|>", OPEN + "<think>\n\n</think>\n\n", ("", "4<|im_end|>", True)),
        ("4", "<|assistant|>\n<think></think>", ("", "4", True)),
        ("4", "<｜Assistant｜></think>", ("", "4", True)),
        # Kimi K2 / GLM-4.5 / Qwen3.5 open a tool call before closing the block: the call ends the reasoning
        (
            "need a tool<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|>",
            "<think>",
            (
                "need a tool",
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
                "<|tool_call_end|><|tool_calls_section_end|>",
                True,
            ),
        ),
        (
            "<think>need a tool<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
            "<|assistant|>",
            ("need a tool", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", True),
        ),
        # a tool call inside a block that does close later is reasoning text
        ("I could write <tool_call> here</think>no", PREFILLED, ("I could write <tool_call> here", "no", True)),
        # empty and whitespace-only blocks
        ("<think></think>4", OPEN, ("", "4", True)),
        ("<think>\n\n</think>4", OPEN, ("\n\n", "4", True)),
        # several blocks: every body is reasoning, the text between them is content
        ("<think>a</think>b<think>c</think>d", OPEN, ("a\nc", "bd", True)),
        # a stray closing tag after a closed block is content
        ("a</think>b</think>c", PREFILLED, ("a", "b</think>c", True)),
    ],
)
def test_think_shapes(text, tail, want):
    got = reasoning.split(text, THINK, tail)
    assert (got.reasoning, got.content, got.closed) == want
    assert parts(got) == text


def test_a_user_turn_mentioning_think_is_not_a_prefill():
    tail = "use the <think> tag<|im_end|>\n<|im_start|>assistant\n"
    assert reasoning.split("4", THINK, tail).content == "4"


HARMONY_TAIL = "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"


@pytest.mark.parametrize(
    "text, tail, want",
    [
        # openai-cookbook articles/openai-harmony.md, "Example output"
        (
            '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
            "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
            HARMONY_TAIL,
            ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", True),
        ),
        # "Receiving tool calls": the call stays whole in content for the tool-call parser
        (
            "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
            "<|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>',
            HARMONY_TAIL,
            (
                "Need to use function get_weather.",
                "<|start|>assistant<|channel|>commentary to=functions.get_weather "
                '<|constrain|>json<|message|>{"location":"San Francisco"}<|call|>',
                True,
            ),
        ),
        # the recipient in the role part of the header, and a preamble on the commentary channel
        (
            "<|channel|>analysis<|message|>plan<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Plan: look it up"
            "<|end|><|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>",
            HARMONY_TAIL,
            (
                "plan",
                "Plan: look it up<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>",
                True,
            ),
        ),
        # truncated inside the analysis channel
        ("<|channel|>analysis<|message|>User asks", HARMONY_TAIL, ("User asks", "", False)),
        # a template that opened the analysis message itself
        (
            "thinking<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
            HARMONY_TAIL + "<|channel|>analysis<|message|>",
            ("thinking", "4", True),
        ),
        # several analysis messages (a built-in tool call on the analysis channel is not reasoning)
        (
            "<|channel|>analysis<|message|>a<|end|>"
            "<|start|>assistant<|channel|>analysis to=python<|message|>1+1<|call|>",
            HARMONY_TAIL,
            ("a", "<|start|>assistant<|channel|>analysis to=python<|message|>1+1<|call|>", True),
        ),
        # not harmony at all: all content
        ("4", HARMONY_TAIL, ("", "4", True)),
    ],
)
def test_harmony_shapes(text, tail, want):
    got = reasoning.split(text, HARMONY, tail)
    assert (got.reasoning, got.content, got.closed) == want
    assert parts(got) == text
