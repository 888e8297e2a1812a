"""gpt-oss harmony message framing (openai-cookbook articles/openai-harmony.md), shared by the reasoning split and
the tool-call parser.

A message is ``<|start|>HEADER<|message|>BODY`` ended by one of ``TERMINATORS``; the header names the role, the
channel (``<|channel|>analysis``, ``commentary``, ``final``), maybe a recipient (``to=functions.NAME``) and a
content type (``<|constrain|>json``).
"""

from __future__ import annotations

import re

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
TERMINATORS = ("<|end|>", "<|return|>", "<|call|>")

_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z0-9_\-]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


def header(text: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header such as
    ``assistant<|channel|>commentary to=functions.get_weather <|constrain|>json``."""
    c, r = _CHANNEL.search(text), _RECIPIENT.search(text)
    return (c.group(1) if c else None), (r.group(1) if r else None)


def messages(text: str):
    """Yield (start, body_start, body_end, end, header, terminator) for each message in ``text``; the first message
    may begin without ``<|start|>`` (the prompt wrote it). A message without ``<|message|>`` ends the scan; one
    without a terminator runs to the end of ``text`` with terminator ``""``."""
    pos, n = 0, len(text)
    while pos < n:
        b = text.find(MESSAGE, pos)
        if b < 0:
            return
        s = text.rfind(START, pos, b)
        start = s if s >= 0 else pos
        body = b + len(MESSAGE)
        ends = [(i, t) for t in TERMINATORS if (i := text.find(t, body)) >= 0]
        if ends:
            i, t = min(ends)
            yield start, body, i, i + len(t), text[start:b], t
            pos = i + len(t)
        else:
            yield start, body, n, n, text[start:b], ""
            return
