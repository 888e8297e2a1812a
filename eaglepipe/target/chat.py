"""Chat templating: a prompt's messages (and tools) to token ids with the target tokenizer's own template."""

from __future__ import annotations


def render(tokenizer, messages: list, tools: list | None = None, template_kwargs: dict | None = None) -> str:
    """The prompt text exactly as the target's chat template writes it, ending with the generation prompt."""
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )


def prompt_ids(tokenizer, messages: list, tools: list | None = None, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the rendered prompt. The template writes its own special tokens (BOS included), so the
    tokenizer must not add them a second time."""
    text = render(tokenizer, messages, tools, template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
