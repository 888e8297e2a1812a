"""A conversation's assistant turns, each answered by the target in the context of its own earlier answers.

A prompt's ``messages`` (records.py) hold the dataset's conversation up to its last user (or tool) turn. Its turns
are cut at the assistant messages that answer in words (``asks``): turn k's prompt is the conversation up to the
k-th such message, with the answers to turns 1..k-1 replaced by the target's own (``interleave``). An assistant
message that calls tools is not a turn: the tool results after it answer exactly its calls, so it stays as the
dataset has it, as context.

A turn's answer enters the next turn's context as a serving engine returns it (``derive.answer_message``); the chat
template then renders that history as it renders any chat (a template that drops history reasoning drops it).

This module and derive.py decide the prompt ids of every turn after the first, so they are part of infer's
fingerprint under ``infer.turns: all`` (infer.py).
"""
from __future__ import annotations


def asks(messages: list) -> list[list]:
    """The messages before each turn's answer: ``messages`` cut after every assistant message without tool calls
    (the dataset's answer, which the target's replaces). One list per turn; the last ends the prompt."""
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
