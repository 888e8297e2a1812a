"""Offline stand-ins for reasoning models: a test tokenizer and a scripted engine.

The test tokenizer is the embedded SmolLM2 tokenizer with the families' markers added as special tokens (think tags,
gpt-oss harmony tokens, the tool-call markers of Qwen/Hermes, GLM, Kimi K2 and DeepSeek) and a chat template that
renders tools and, like DeepSeek-R1, Qwen3-Thinking-2507 and Kimi K2.5, ends the prompt with the opening ``<think>``.
Template switches (``chat_template_kwargs``): ``enable_thinking=false`` prefills a closed empty block (Qwen3 with
thinking off), ``prefill_think=false`` leaves the tag to the model (Qwen3 hybrid, Kimi K2 thinking, GLM-4.5),
``harmony=true`` renders gpt-oss's harmony format, ending with ``<|start|>assistant``.

It is saved as a model folder (tokenizer + the embedded model's config and generation config, no weights) so
``target.resolve``, ``target.stop_ids`` and ``target.fingerprint`` work on it; ``served_model_folder`` adds the embedded
weights (a link), for the stage and tests/sglang_server.py (``--reasoning``) to load the same folder. The
scripted engine implements the engine interface and answers with token ids made by this tokenizer, as a reasoning model
served token-exact would.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eaglepipe.engines import Output
from eaglepipe.target import model as target

THINK_TOKENS = ["<think>", "</think>"]
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TOOL_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
]
MARKERS = THINK_TOKENS + HARMONY_TOKENS + TOOL_TOKENS
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CHAT_TEMPLATE = (
    r"""
{%- if harmony is defined and harmony -%}
    {{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nReasoning: medium\n\n'
        + '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
    {%- if tools %}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}{% endif %}
    {{- '<|end|>' }}
    {%- if tools -%}
        {{- '<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n' }}
        {%- for tool in tools %}
            {{- '\n// ' + (tool.function.description or '') + '\ntype ' + tool.function.name
                + ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\n' }}
        {%- endfor %}
        {{- '\n} // namespace functions<|end|>' }}
    {%- endif -%}
    {%- for m in messages -%}
        {%- if m.role == 'assistant' -%}
            {{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' }}
        {%- elif m.role == 'tool' -%}
            {{- '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>commentary<|message|>'
                + m.content + '<|end|>' }}
        {%- else -%}
            {{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}
        {%- endif -%}
    {%- endfor -%}
    {%- if add_generation_prompt -%}{{- '<|start|>assistant' }}{%- endif -%}
{%- else -%}
    {%- set system = messages[0].content if messages[0].role == 'system' else '"""
    + DEFAULT_SYSTEM
    + r"""' -%}
    {{- '<|im_start|>system\n' + system }}
    {%- if tools -%}
        {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
            + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
        {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
        {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
            + '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            + '<args-json-object>}\n</tool_call>' }}
    {%- endif -%}
    {{- '<|im_end|>\n' }}
    {%- for m in messages -%}
        {%- if m.role == 'system' and loop.first -%}
        {%- elif m.role == 'assistant' -%}
            {{- '<|im_start|>assistant\n' + (m.content or '') }}
            {%- for call in (m.tool_calls or []) -%}
                {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": '
                    + (call.function.arguments | tojson) + '}\n</tool_call>' }}
            {%- endfor -%}
            {{- '<|im_end|>\n' }}
        {%- elif m.role == 'tool' -%}
            {{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
        {%- else -%}
            {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
        {%- endif -%}
    {%- endfor -%}
    {%- if add_generation_prompt -%}
        {{- '<|im_start|>assistant\n' }}
        {%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' }}
        {%- elif prefill_think is not defined or prefill_think -%}{{- '<think>\n' }}
        {%- endif -%}
    {%- endif -%}
{%- endif -%}
"""
)


def build_model_folder(folder: Path, weights: bool = False) -> Path:
    """Write the test model folder (tokenizer with the markers, the template, the embedded config) to ``folder``;
    ``weights``: with the embedded model's weights too (linked, not copied). The markers' ids lie past the model's
    embeddings (config vocab_size): the weights never generate them and cannot read them."""
    embedded = target.resolve("embedded")
    tok = target.load_tokenizer(embedded)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(embedded / name, folder / name)
    if weights:
        for path in embedded.glob("*.safetensors"):
            (folder / path.name).symlink_to(path)
    return folder


_CACHE: dict = {}


def model_folder(tmp_path_factory) -> Path:
    """The test model folder, built once per test session."""
    if "folder" not in _CACHE:
        _CACHE["folder"] = build_model_folder(tmp_path_factory.mktemp("reasoning-model") / "model")
    return _CACHE["folder"]


def served_model_folder(tmp_path_factory) -> Path:
    """The test model folder with the embedded weights, built once per test session."""
    if "served" not in _CACHE:
        _CACHE["served"] = build_model_folder(tmp_path_factory.mktemp("reasoning-model") / "served", weights=True)
    return _CACHE["served"]


def reasoning_tokenizer(tmp_path_factory):
    """The test tokenizer, loaded once per test session."""
    if "tokenizer" not in _CACHE:
        _CACHE["tokenizer"] = target.load_tokenizer(model_folder(tmp_path_factory))
    return _CACHE["tokenizer"]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- a reasoning model, scripted ----------------------------------------------------------------------------------


def think_answer(question: str, tools: list | None = None) -> tuple[str, str]:
    """(reasoning, answer) a reasoning model might give; with tools, the answer is a Hermes-style tool call."""
    reasoning = f"The user asks: {question} Let me think step by step about it."
    if tools:
        name = tools[0]["function"]["name"]
        return reasoning, f'<tool_call>\n{{"name": "{name}", "arguments": {{"query": "{question}"}}}}\n</tool_call>'
    return reasoning, f"Here is my answer to: {question}"


class ScriptedEngine:
    """The engine interface (``name``, ``identity()``, ``describe()``, ``stream()``, ``generate()``) over a script.

    ``script(prompt_text) -> (output text, finish_reason)`` writes each answer as text; the engine returns it as
    token ids of the test tokenizer, the way a token-exact server returns ``output_ids``. ``served`` counts the
    answers handed out, so a test can see how much compute a failing run spent."""

    name = "scripted"

    def __init__(self, tokenizer, script, label: str = "reasoning"):
        self.tokenizer, self.script, self.label = tokenizer, script, label
        self.served = 0

    def identity(self) -> dict:
        return {"script": self.label}

    def describe(self) -> dict:
        return {"engine": self.name, **self.identity()}

    def stream(self, prompts: list[list[int]], sampling, rids: list[str]):
        for i, prompt in enumerate(prompts):  # one at a time, lazily: a stopped run asks for nothing more
            text, finish = self.script(self.tokenizer.decode(prompt, skip_special_tokens=False))
            out = ids(self.tokenizer, text)
            if finish == "length":
                out = out[: sampling.max_new_tokens]
            self.served += 1
            yield i, Output(out, finish, {"engine": self.name, "rid": rids[i]})


def question_of(prompt_text: str) -> str:
    """The last user turn of a rendered ChatML or harmony prompt."""
    if "<|im_start|>user\n" in prompt_text:
        return prompt_text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    return prompt_text.rsplit("<|start|>user<|message|>", 1)[1].split("<|end|>", 1)[0]


def reasoning_model(prompt_text: str) -> tuple[str, str]:
    """A thinking model under a template that opened ``<think>``: reasoning, ``</think>``, answer, end of turn."""
    tools = [{"function": {"name": "search"}}] if "<tools>" in prompt_text else None
    thought, answer = think_answer(question_of(prompt_text), tools)
    return f"{thought}\n</think>\n\n{answer}<|im_end|>", "stop"


def reasoning_dropped(prompt_text: str) -> tuple[str, str]:
    """The same model, served with the thinking dropped from its answers (the seed's failure)."""
    _, answer = think_answer(question_of(prompt_text))
    return f"{answer}<|im_end|>", "stop"


def harmony_model(prompt_text: str) -> tuple[str, str]:
    """gpt-oss: analysis channel, then a final answer, or a function call on the commentary channel."""
    question = question_of(prompt_text)
    thought = f"User asks: {question} Need to answer briefly."
    if "namespace functions" in prompt_text:
        return (
            f"<|channel|>analysis<|message|>{thought} Use the search tool.<|end|><|start|>assistant<|channel|>"
            f'commentary to=functions.search <|constrain|>json<|message|>{{"query": "{question}"}}<|call|>'
        ), "stop"
    return (
        f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant<|channel|>final<|message|>"
        f"Answer: {question}<|return|>"
    ), "stop"
