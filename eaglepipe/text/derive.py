"""A record's readable fields, derived from its ids (never from a server's text): the output decoded with special
tokens kept, split into reasoning and content (reasoning.py), the content's tool calls parsed (toolcalls.py).
"""

from __future__ import annotations

from eaglepipe.core.records import Generation, Response
from eaglepipe.engines import Sampling
from eaglepipe.text import toolcalls
from eaglepipe.text.reasoning import Spec, Split, spec_of, split

PROMPT_TAIL_TOKENS = 16  # how much of the prompt's end is decoded to see whether the template opened a block


def spec_from_params(value, tool_calls: str | None = None) -> Spec:
    """The spec for ``target.reasoning`` (preset name or ``{start, end}``, see reasoning.py) and
    ``target.tool_calls`` (a family of config.TOOL_CALLS, or None: not parsed, not checked)."""
    if tool_calls not in (None, "none", *toolcalls.PARSERS):
        raise ValueError(f"target.tool_calls={tool_calls!r}: expected one of {['none', *toolcalls.PARSERS]}")
    return spec_of(value, tool_calls)


def split_ids(tokenizer, prompt_ids: list, output_ids: list, spec: Spec) -> tuple[str, Split]:
    """(text, split) for one record: the output decoded with special tokens kept, and its reasoning split (the end of
    the prompt tells whether the template opened a reasoning block)."""
    text = tokenizer.decode(output_ids, skip_special_tokens=False)
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False) if spec.kind != "none" else ""
    return text, split(text, spec, tail)


def answer_message(tokenizer, prompt_ids: list, output_ids: list, spec: Spec, stops) -> dict:
    """The assistant message a serving engine returns for an output (the next turn's history): the ids less trailing
    stop ids, split into ``content`` and ``reasoning_content`` (only when there is reasoning)."""
    end = len(output_ids)
    while end and output_ids[end - 1] in stops:
        end -= 1
    _, part = split_ids(tokenizer, prompt_ids, output_ids[:end], spec)
    return {"role": "assistant", "content": part.content} | (
        {"reasoning_content": part.reasoning} if part.reasoning else {}
    )


def readable(tokenizer, prompt_ids: list, output_ids: list, spec: Spec) -> dict:
    """Every readable field of a record, derived from its ids: text, reasoning, content, reasoning_closed, and
    tool_calls (parsed from content for ``spec.tools``; a call that does not parse is an ``{"error", "raw"}`` entry,
    never an exception)."""
    text, part = split_ids(tokenizer, prompt_ids, output_ids, spec)
    return {
        "text": text,
        "reasoning": part.reasoning,
        "content": part.content,
        "reasoning_closed": part.closed,
        "tool_calls": toolcalls.parse(part.content, spec.tools),
    }


PER_RUN = ("server", "rid", "attempts", "latency_s", "cached_tokens")
"""Meta keys that tell how one run got an answer (the server engines': which server, request id and attempt, how long,
how much of the prompt the server had cached): kept in infer's cache, left out of the published records, so that the
same answers publish the same bytes whatever the retries and the scheduling."""


def to_response(gen: Generation, tokenizer, spec: Spec, sampling: Sampling | None) -> Response:
    """The published record: the generation's ids, every readable field derived from them, its meta less
    ``PER_RUN``. ``sampling`` None (unknown) is stored as {}."""
    f = readable(tokenizer, gen.prompt_ids, gen.output_ids, spec)
    return Response(
        gen.id,
        gen.source,
        gen.prompt_ids,
        gen.output_ids,
        gen.finish_reason,
        f["text"],
        f["reasoning"],
        f["content"],
        f["reasoning_closed"],
        f["tool_calls"],
        sampling.to_json() if sampling else {},
        {k: v for k, v in gen.meta.items() if k not in PER_RUN},
        gen.sample,
        gen.turn,
    )


def mismatch(response, tokenizer, spec: Spec) -> str | None:
    """Re-derive a record's readable fields from its ids; return the first field that disagrees, or None.
    ``tool_calls`` is checked only when the spec names a tool-call family."""
    want = readable(tokenizer, response.prompt_ids, response.output_ids, spec)
    names = ["text", "reasoning", "content", "reasoning_closed"] + (["tool_calls"] if spec.tools is not None else [])
    for name in names:
        if getattr(response, name) != want[name]:
            return name
    return None


def markup(tokenizer) -> tuple[str, ...]:
    """The strings of the tokenizer's special and added tokens (framing, not answer text), longest first."""
    added = [getattr(t, "content", str(t)) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    return tuple(sorted(set(added) | set(tokenizer.all_special_tokens), key=len, reverse=True))
