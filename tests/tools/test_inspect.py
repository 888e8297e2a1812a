"""What ``make inspect`` shows of one record: the prompt the target saw (its prompt_ids decoded), abbreviated to
``--max-chars`` with the last user turn kept, beside the reasoning and the content."""

import pytest
from reasoning_fixtures import ids, reasoning_tokenizer

from eaglepipe.core.records import Generation, write_jsonl
from eaglepipe.engines import Sampling
from eaglepipe.target import chat
from eaglepipe.text import derive
from eaglepipe.tools import inspect

THINK = derive.spec_from_params("think")
SYSTEM = "You follow the house style guide. " * 60  # far longer than --max-chars
QUESTION = "Which river flows through Vienna?"
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Name a river."},
    {"role": "assistant", "content": "The Rhine."},
    {"role": "user", "content": QUESTION},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return reasoning_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def rec(tok):
    gen = Generation(
        "p1",
        "s",
        chat.prompt_ids(tok, MESSAGES),
        ids(tok, "Rivers of Austria.</think>The Danube.<|im_end|>"),
        "stop",
        {},
    )
    return derive.to_response(gen, tok, THINK, Sampling())


def part(out: str, title: str) -> str:
    """The body of section ``title`` in a record's output (the lines after its title line)."""
    return out.split(f"-- {title}", 1)[1].split("\n", 1)[1].split("\n-- ", 1)[0]


def test_a_long_prompt_shows_its_start_and_its_last_turns(tok, rec):
    out = inspect.show(rec, tok, THINK, max_chars=600)
    prompt = part(out, "prompt")
    assert prompt.count(QUESTION) == 1 and "Name a river." in prompt and "The Rhine." in prompt  # the last turns
    assert "<|im_start|>system\nYou follow the house style guide." in prompt  # the start of the system turn
    assert "more characters ...]" in prompt and len(prompt) < 650  # the middle left out
    assert prompt.rstrip().endswith("<|im_start|>assistant\n<think>")  # what the template opened for the answer
    assert part(out, "reasoning").strip() == "Rivers of Austria."
    assert part(out, "content").strip() == "The Danube.<|im_end|>"


def test_max_chars_0_shows_the_whole_prompt_as_decoded(tok, rec):
    out = inspect.show(rec, tok, THINK, max_chars=0)
    assert tok.decode(rec.prompt_ids, skip_special_tokens=False).strip("\n") in out
    assert SYSTEM.strip() in out


def test_a_published_record_read_back_shows_its_prompt_and_without_a_tokenizer_says_why_not(tok, rec, tmp_path):
    path = tmp_path / "responses.jsonl"
    write_jsonl(path, [rec])
    assert QUESTION in part(inspect.render(path, 1, 0, tok, THINK), "prompt")
    assert "not decoded" in part(inspect.render(path, 1, 0), "prompt")


def test_a_turn_is_shown_with_every_turn_of_its_conversation(tok, tmp_path):
    """Records of infer.turns: all: picking turn 2 shows turns 1 and 2 of its conversation, in order, each with the
    prompt it was answered in; a record of another conversation stays apart."""
    first = [{"role": "user", "content": "Name a river."}]
    one = derive.to_response(
        Generation("p1@1", "s", chat.prompt_ids(tok, first), ids(tok, "The Danube.<|im_end|>"), "stop", {}, 0, 1),
        tok,
        THINK,
        Sampling(),
    )
    second = first + [{"role": "assistant", "content": "The Danube."}, {"role": "user", "content": QUESTION}]
    two = derive.to_response(
        Generation("p1@2", "s", chat.prompt_ids(tok, second), ids(tok, "Vienna's.<|im_end|>"), "stop", {}, 0, 2),
        tok,
        THINK,
        Sampling(),
    )
    other = derive.to_response(
        Generation("p2", "s", chat.prompt_ids(tok, first), ids(tok, "The Rhine.<|im_end|>"), "stop", {}),
        tok,
        THINK,
        Sampling(),
    )
    write_jsonl(tmp_path / "r.jsonl", [one, two, other])
    out = inspect.render(tmp_path / "r.jsonl", 3, 0, tok, THINK)
    assert out.count("conversation p1, sample 0: 2 turn(s)") == 1  # picked twice, shown once
    assert out.index("id p1@1 | turn 1") < out.index("id p1@2 | turn 2") and "id p2 | source" in out
    turn_two = out.split("id p1@2 | turn 2", 1)[1].split("\n==", 1)[0]
    assert "The Danube." in part(turn_two, "prompt") and QUESTION in part(turn_two, "prompt")
