"""A conversation's assistant turns, each answered by the target in the context of its own earlier answers.

A prompt's ``messages`` are cut at the assistant messages that answer in words (``asks``): turn k's prompt is the
conversation up to the k-th such message, the answers to turns 1..k-1 replaced by the target's own as an engine
returns them (``interleave``, ``derive.answer_message``). An assistant message that calls tools is no turn: it stays
as context. This module decides the prompt ids of later turns: infer's fingerprint hashes it (``infer.turns: all``).
"""

from __future__ import annotations


def asks(messages: list) -> list[list]:
    """``messages`` split at every assistant message without tool calls (dropped: the target's answer replaces it).
    One list per turn; the last ends the prompt."""
    out, current = [], []
    for m in messages:
        if m.get("role") == "assistant" and not m.get("tool_calls"):
            out.append(current)
            current = []
        else:
            current.append(m)
    return out + [current]


def interleave(asks_: list[list], answers: list[dict]) -> list:
    """The chat that asks turn ``len(answers) + 1``: ask 1, answer 1, ask 2, ..., ask ``len(answers) + 1``."""
    if len(answers) >= len(asks_):
        raise ValueError(f"a conversation of {len(asks_)} turn(s) has no turn {len(answers) + 1}")
    out = []
    for ask, answer in zip(asks_, answers):
        out += [*ask, answer]
    return out + asks_[len(answers)]
