"""Reasoning and answer split out of a decoded output (derive.py decodes the ids; ``derive.spec_from_params`` checks
the tool-call family and builds the Spec with ``spec_of``).

``target.reasoning`` names a preset or gives a custom ``{start, end}`` pair of markers:
    none     the model does not reason: everything is content
    think    ``<think>`` ... ``</think>`` (Qwen3, Qwen3.5, DeepSeek-R1 / V3.1, Kimi K2 thinking / K2.5, GLM-4.5+)
    harmony  gpt-oss: the ``analysis`` channel is reasoning, every other message is content
docs/reasoning-and-tools.md records each family's markers and template behaviour, with sources.

Every character of the output (decoded with special tokens kept) lands in one segment (``reasoning``, ``content``
or ``marker``), in order: ``"".join(segments) == text``. Cases (``think`` and custom specs):
- the prompt ends with the opening marker: the output starts inside the reasoning block;
- the output closes a block it never opened: everything before the first closing marker is reasoning;
- the opening marker repeated at the start of a block the template opened is a marker;
- no closing marker (a truncated output): everything after the opening marker is reasoning, ``closed`` is False;
- a tool-call opener (``Spec.interrupts``) inside an unclosed block ends the reasoning there: the call is content;
- no markers at all: everything is content;
- several blocks: every block's body is reasoning (joined by a newline); the text between blocks is content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from eaglepipe.core.config import Markers
from eaglepipe.text import harmony

THINK = ("<think>", "</think>")
# Tool-call openers that end an unclosed think block (Qwen/Hermes/GLM, Kimi K2 (both spellings), DeepSeek).
TOOL_OPENERS = ("<tool_call>", "<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", "<｜tool▁calls▁begin｜>")
PRESETS = ("none", "think", "harmony")


@dataclass(frozen=True)
class Spec:
    """How a target marks its reasoning, and which tool-call family its content holds (``spec_of``)."""

    kind: str  # none | tags | harmony
    start: str | None = None  # tags: the opening marker; harmony: the analysis header (informational)
    end: str | None = None
    interrupts: tuple = ()  # tags: markers that end an unclosed block (kept in content)
    tools: str | None = None  # tool-call family parsed out of content; None = not parsed, not checked

    @property
    def expects_reasoning(self) -> bool:
        return self.kind != "none"


@dataclass
class Split:
    """One output split: its reasoning, its content, whether the last block closed, and every segment in order."""

    reasoning: str
    content: str
    closed: bool  # False when the output ends inside a reasoning block (truncated)
    segments: list = field(default_factory=list)  # [(kind, text)], kind in reasoning | content | marker


def spec_of(value, tool_calls: str | None = None) -> Spec:
    """The spec for ``target.reasoning``: a preset name or config.Markers, with the tool-call family ``tool_calls``
    unchecked (``derive.spec_from_params`` checks it)."""
    if value == "none":
        return Spec("none", tools=tool_calls)
    if value == "think":
        return Spec("tags", *THINK, TOOL_OPENERS, tool_calls)
    if value == "harmony":
        return Spec("harmony", f"{harmony.CHANNEL}analysis{harmony.MESSAGE}", "<|end|>", (), tool_calls)
    if not isinstance(value, Markers):
        raise ValueError(f"target.reasoning={value!r}: expected one of {list(PRESETS)} or {{start, end}}")
    return Spec("tags", value.start, value.end, (), tool_calls)


# --- think-style tags -------------------------------------------------------------------------------------------


def _prefilled(tail: str, start: str) -> bool:
    """The template ended the prompt with the opening marker (whitespace after it allowed)."""
    return tail.rstrip().endswith(start)


def _split_tags(text: str, spec: Spec, tail: str) -> Split:
    """The split under ``<think>``-style markers (the cases in the module's docstring); ``tail``: the prompt's end."""
    start, end = spec.start, spec.end
    segs: list = []  # (kind, text, block number)
    closed, block = True, 0
    in_block = _prefilled(tail, start)
    if not in_block:
        s, e = text.find(start), text.find(end)
        in_block = e >= 0 and (s < 0 or e < s)  # closes a block it never opened: the block was open from the start
    fresh = in_block  # inside a block and nothing but whitespace read of it yet
    repeat = re.compile(r"\s*" + re.escape(start))
    pos, n = 0, len(text)
    while pos < n:
        if not in_block:
            s = text.find(start, pos)
            if s < 0:
                segs.append(("content", text[pos:], None))
                break
            block += 1
            segs += [("content", text[pos:s], None), ("marker", start, None)]
            pos, in_block, fresh = s + len(start), True, True
            continue
        m = repeat.match(text, pos) if fresh else None
        if m:
            segs += [("reasoning", m.group(0)[: -len(start)], block), ("marker", start, None)]
            pos = m.end()
            continue
        fresh = False
        e = text.find(end, pos)
        if e < 0:
            cut = min((i for i in (text.find(x, pos) for x in spec.interrupts) if i >= 0), default=-1)
            if cut >= 0:  # a tool-call section opened inside the block: it ends the reasoning, the call is content
                segs.append(("reasoning", text[pos:cut], block))
                pos, in_block = cut, False
                continue
            segs.append(("reasoning", text[pos:], block))
            pos = n
            break
        segs += [("reasoning", text[pos:e], block), ("marker", end, None)]
        pos, in_block = e + len(end), False
    if in_block and pos >= n:  # the output ends inside a block: truncated (or it opened a block and stopped)
        closed = False
    return _assemble(segs, closed)


# --- gpt-oss harmony --------------------------------------------------------------------------------------------


def _split_harmony(text: str, tail: str) -> Split:
    """The split of gpt-oss harmony messages: the analysis channel is reasoning, every other message is content
    (a tool call whole, with its header); ``tail``: the prompt's end."""
    # The prompt ends with an open header (``<|start|>assistant``): parse it with the output, then drop its part.
    i = tail.rfind(harmony.START)
    head = tail[i:] if i >= 0 and not any(t in tail[i:] for t in harmony.TERMINATORS) else ""
    full = head + text
    segs: list = []  # (kind, text, message number)
    closed, pos = True, 0
    for k, (start, body, body_end, end, header, term) in enumerate(harmony.messages(full)):
        channel, recipient = harmony.header(header)
        if start > pos:
            segs.append(("content", full[pos:start], None))
        if channel == "analysis" and recipient is None:
            segs += [("marker", full[start:body], None), ("reasoning", full[body:body_end], k), ("marker", term, None)]
            closed = bool(term)
        elif recipient is not None:  # a tool call: kept whole, so its header reaches the tool-call parser
            segs.append(("content", full[start:end], None))
        else:  # final answer, commentary preamble: the body is content, the framing is markup
            segs += [("marker", full[start:body], None), ("content", full[body:body_end], None), ("marker", term, None)]
        pos = end
    if pos < len(full):
        segs.append(("content", full[pos:], None))
    cut, out = len(head), []
    for kind, s, g in segs:  # drop the part that came from the prompt
        if cut >= len(s):
            cut -= len(s)
            continue
        out.append((kind, s[cut:], g))
        cut = 0
    return _assemble(out, closed)


def _assemble(segs: list, closed: bool) -> Split:
    """The Split of ``segs`` ((kind, text, block or message number) each): the blocks' reasoning joined by newlines."""
    bodies: dict = {}
    for kind, s, g in segs:
        if kind == "reasoning":
            bodies[g] = bodies.get(g, "") + s
    reasoning = "\n".join(b for b in bodies.values() if b)
    content = "".join(s for k, s, _ in segs if k == "content")
    return Split(reasoning, content, closed, [(k, s) for k, s, _ in segs if s])


# --- entry points -----------------------------------------------------------------------------------------------


def split(text: str, spec: Spec, prompt_tail: str = "") -> Split:
    """Split decoded output ``text``; ``prompt_tail`` is the end of the decoded prompt."""
    if spec.kind == "none":
        return Split("", text, True, [("content", text)] if text else [])
    if spec.kind == "harmony":
        return _split_harmony(text, prompt_tail)
    return _split_tags(text, spec, prompt_tail)
