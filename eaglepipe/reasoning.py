"""Reasoning and answer, derived from the output ids (never from a server's text field).

``target.reasoning`` names a preset or gives a custom ``{start, end}`` pair of markers:
    none   the model does not reason: everything is content
    think  ``<think>`` ... ``</think>`` (Qwen3, DeepSeek-R1, Kimi K2 thinking, GLM-4.5)

The output is decoded with special tokens kept, then split on the markers. If the prompt already ends with the
opening marker (templates that prefill it), the output starts inside the reasoning block. An opening marker that
never closes (a truncated output) puts everything after it into ``reasoning`` and marks the split unclosed.
"""
from __future__ import annotations

from dataclasses import dataclass

PRESETS = {"none": None, "think": ("<think>", "</think>")}


@dataclass(frozen=True)
class Spec:
    start: str | None
    end: str | None

    @property
    def expects_reasoning(self) -> bool:
        return self.start is not None


@dataclass
class Split:
    reasoning: str
    content: str
    closed: bool


def spec_from_params(value) -> Spec:
    if isinstance(value, dict):
        if not value.get("start") or not value.get("end"):
            raise ValueError(f"target.reasoning {value!r}: a custom spec needs non-empty 'start' and 'end'")
        return Spec(value["start"], value["end"])
    if value not in PRESETS:
        raise ValueError(f"target.reasoning={value!r}: expected one of {sorted(PRESETS)} or {{start, end}}")
    markers = PRESETS[value]
    return Spec(*markers) if markers else Spec(None, None)


def split(text: str, spec: Spec, prompt_tail: str = "") -> Split:
    """Split decoded output ``text``; ``prompt_tail`` is the end of the decoded prompt."""
    if spec.start is None:
        return Split("", text, True)
    prefilled = prompt_tail.rstrip().endswith(spec.start)
    if not prefilled:
        head, sep, rest = text.partition(spec.start)
        if not sep or head.strip():  # no reasoning block at the start of the output
            return Split("", text, True)
        text = rest
    reasoning, sep, content = text.partition(spec.end)
    if not sep:
        return Split(reasoning, "", False)
    return Split(reasoning, content, True)


def derive(tokenizer, prompt_ids: list, output_ids: list, spec: Spec) -> tuple[str, Split]:
    """(text, split) for one record: the output decoded with special tokens kept, and its reasoning split."""
    text = tokenizer.decode(output_ids, skip_special_tokens=False)
    tail = tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False) if spec.start else ""
    return text, split(text, spec, tail)


def mismatch(response, tokenizer, spec: Spec) -> str | None:
    """Re-derive a record's readable fields from its ids; return the first field that disagrees, or None."""
    text, part = derive(tokenizer, response.prompt_ids, response.output_ids, spec)
    for name, want in (("text", text), ("reasoning", part.reasoning), ("content", part.content),
                       ("reasoning_closed", part.closed)):
        if getattr(response, name) != want:
            return name
    return None
