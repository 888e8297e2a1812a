"""Tests of the evaluate run over benchmarks: a turn's answer as a serving engine returns it, later turns asked after
the target's own greedy answer, and the figures per benchmark, category and turn."""

from pathlib import Path

import pytest
from e2e import untrained_drafter

from eaglepipe.core import config
from eaglepipe.dataset import benchmarks
from eaglepipe.evaluate import decode
from eaglepipe.evaluate import run as evaluate
from eaglepipe.target import model as target
from eaglepipe.text import reasoning

LAYERS = [2, 15, 27]
HELDOUT = Path(__file__).resolve().parents[2] / "data/eval/heldout.jsonl"


@pytest.fixture(scope="module")
def chat(tokenizer, target_folder):
    return evaluate.Chat(tokenizer, {}, reasoning.spec_of("none"), target.stop_ids(target_folder, tokenizer))


def test_an_answer_is_the_output_without_its_stop_token(tokenizer, chat):
    prompt = chat.ids([{"role": "user", "content": "Hi"}])
    output = tokenizer("Hello there.", add_special_tokens=False)["input_ids"] + sorted(chat.stops)[:1]
    assert chat.answer(prompt, output) == {"role": "assistant", "content": "Hello there."}
    assert chat.answer(prompt, output[:-1]) == {"role": "assistant", "content": "Hello there."}  # cut short


def test_an_answer_keeps_reasoning_apart_as_the_target_s_format_says(tokenizer, chat):
    think = evaluate.Chat(tokenizer, {}, reasoning.spec_of("think"), chat.stops)
    prompt = think.ids([{"role": "user", "content": "Hi"}])
    output = tokenizer("<think>Greet back.</think>Hello.", add_special_tokens=False)["input_ids"]
    assert think.answer(prompt, output) == {
        "role": "assistant",
        "content": "Hello.",
        "reasoning_content": "Greet back.",
    }
    assert chat.answer(prompt, output)["content"] == "<think>Greet back.</think>Hello."  # none: all content


@pytest.fixture(scope="module")
def ran(model, chat, target_folder):
    """An untrained drafter started from the target (a few drafts accepted), on 2 held-out prompts, 2 MT-bench
    questions (4 turns) and 1 HumanEval problem."""
    drafter = untrained_drafter(target_folder, LAYERS)
    choice = {"heldout": config.Benchmark(n=2), "mtbench": config.Benchmark(n=2), "humaneval": config.Benchmark(n=1)}
    conversations, _ = benchmarks.select(choice, HELDOUT)
    return conversations, evaluate.run(conversations, chat, model, drafter, config.Evaluate(max_new_tokens=10))


def test_turn_2_is_asked_after_the_targets_own_greedy_answer_to_turn_1(ran, chat, model):
    conversations, metrics = ran
    rows = metrics["decoded"]["mtbench"]
    assert [(r["id"], r["turn"], r["index"]) for r in rows] == [
        (c.id, t, 2 * i + t - 1) for i, c in enumerate(conversations[2:4]) for t in (1, 2)
    ]
    for c, (first, second) in zip(conversations[2:4], zip(rows[::2], rows[1::2])):
        assert first["prompt_ids"] == chat.ids(c.messages_for([]))
        answer = chat.answer(first["prompt_ids"], first["output_ids"])
        assert answer["content"] and second["prompt_ids"] == chat.ids(c.messages_for([answer]))
        assert first["output_ids"] == decode.greedy(model, first["prompt_ids"], 10, chat.stops)


def test_figures_per_benchmark_category_and_turn(ran):
    _, metrics = ran
    b = metrics["benchmarks"]
    assert list(b) == ["heldout", "mtbench", "humaneval"] and metrics["lossless"]
    assert (b["mtbench"]["prompts"], b["mtbench"]["turns"]) == (2, 4)
    assert sorted(b["mtbench"]["per_turn"]) == ["1", "2"]
    assert sum(t["verification_steps"] for t in b["mtbench"]["per_turn"].values()) == b["mtbench"]["verification_steps"]
    assert sum(c["tokens"] for c in b["mtbench"]["per_category"].values()) == b["mtbench"]["tokens"]
    assert "per_category" not in b["humaneval"] and "per_turn" not in b["heldout"]
    for figures in b.values():
        assert len(figures["acceptance_rate_per_position"]) == 3 and figures["acceptance_length"] >= 1
        assert figures["beats_baseline"] == (figures["acceptance_length"] > figures["baseline_acceptance_length"])
    rows = metrics["positions"]
    assert {(r["benchmark"], r["method"]) for r in rows} == {(n, f"{n} {m}") for n in b for m in ("eagle", "ngram")}
    assert [r["acceptance_rate"] for r in rows if r["method"] == "mtbench eagle"] == b["mtbench"][
        "acceptance_rate_per_position"
    ]
