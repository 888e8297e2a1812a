"""infer.turns: all: every turn answered after the target's own earlier answers, resumed at the turn a kill cut,
and joined into one training sequence only where the ids extend."""

import json

import pytest
from infer_helpers import NONE, QUESTIONS, Knobs, prompts, run

from eaglepipe.core import config
from eaglepipe.core.records import Prompt, content_id, to_json, write_jsonl
from eaglepipe.target import chat
from eaglepipe.target import model as target
from eaglepipe.text import derive, turns


# ---------------------------------------------------------------------------------------------- every turn answered
def chats():
    """A three-turn conversation (the dataset's answers in it), a two-turn one whose first answer calls a tool, and a
    single-turn prompt."""
    three = [
        {"role": "user", "content": "Name a planet."},
        {"role": "assistant", "content": "DATASET ANSWER ONE"},
        {"role": "user", "content": "Name another one."},
        {"role": "assistant", "content": "DATASET TWO"},
        {"role": "user", "content": "Which is larger?"},
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    tool = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "DATASET SUN"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    return [Prompt(content_id(m, None), "t", m) for m in (three, tool)] + prompts(QUESTIONS[:1])


def test_every_turn_is_answered_after_the_targets_own_earlier_answers(model, tokenizer, target_folder, tmp_path):
    ps = chats()
    responses, report = run(ps, model, tokenizer, target_folder, tmp_path, Knobs(turns="all"))
    assert [(r.id, r.turn) for r in responses] == [
        (f"{ps[0].id}@1", 1),
        (f"{ps[0].id}@2", 2),
        (f"{ps[0].id}@3", 3),
        (f"{ps[1].id}@1", 1),
        (f"{ps[1].id}@2", 2),
        (f"{ps[2].id}@1", 1),
    ]
    stops = target.stop_ids(target_folder, tokenizer)
    by_id = {r.id: r for r in responses}
    for p in ps:
        asks, answers = turns.asks(p.messages), []
        for t in range(1, len(asks) + 1):
            r = by_id[f"{p.id}@{t}"]
            assert r.prompt_ids == chat.prompt_ids(tokenizer, turns.interleave(asks, answers))
            answers.append(derive.answer_message(tokenizer, r.prompt_ids, r.output_ids, NONE, stops))
            assert answers[-1]["content"] and answers[-1]["content"] in r.text
    text = tokenizer.decode(by_id[f"{ps[0].id}@3"].prompt_ids)
    assert "DATASET" not in text and by_id[f"{ps[0].id}@1"].content.removesuffix("<|im_end|>") in text
    tool_turn = tokenizer.decode(by_id[f"{ps[1].id}@1"].prompt_ids)  # the call and its result stay, as context
    assert "sunny" in tool_turn and "DATASET SUN" not in tool_turn
    assert report["turns"] == {"mode": "all", "answered": {1: 3, 2: 2, 3: 1}, "unanswered": 0, "ended_at_tool_call": 0}
    _, again = run(ps, model, tokenizer, target_folder, tmp_path, Knobs(turns="last"))  # another cache: nothing shared
    assert again["run"]["generated"] == 3 and "turns" not in again


def test_a_conversation_cut_after_turn_2_resumes_at_turn_3(model, tokenizer, target_folder, tmp_path):
    """The cache as a kill after turn 2 leaves it (every finished answer is fsync'd before the next starts): the
    rerun generates turn 3 only and publishes what an uninterrupted run does."""
    ps = chats()
    full, _ = run(ps, model, tokenizer, target_folder, tmp_path / "full", Knobs(turns="all", temperature=0.8))
    run(ps, model, tokenizer, target_folder, tmp_path / "cut", Knobs(turns="all", temperature=0.8))
    cache = next((tmp_path / "cut").glob("*/generations.jsonl"))
    lines = cache.read_text().splitlines()
    cache.write_text("".join(line + "\n" for line in lines if json.loads(line)["id"] != f"{ps[0].id}@3"))
    resumed, report = run(ps, model, tokenizer, target_folder, tmp_path / "cut", Knobs(turns="all", temperature=0.8))
    assert report["run"]["generated"] == 1
    assert [to_json(r) for r in resumed] == [to_json(r) for r in full]


@pytest.mark.parametrize("template, joined", [(None, True), ("rewrites history", False)])
def test_turns_share_a_training_sequence_only_where_the_ids_extend(
    model, tokenizer, target_folder, tmp_path, template, joined
):
    """SmolLM's template renders the target's answers back to the ids it generated: merge joins a conversation's
    turns into one sequence with a masked segment per turn. A template that rewrites history (here, every earlier
    answer shown as its length) cannot: each turn is its own sequence. Either way every masked token is an output
    id, in the context it was generated in."""
    from copy import deepcopy

    from eaglepipe.dataset import merge, sequences

    tok = deepcopy(tokenizer)
    if template:
        tok.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
            "[an answer of {{ m.content | length }} characters]"
            "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
    ps = chats()[:1]
    responses, _ = run(ps, model, tok, target_folder, tmp_path / "cache", Knobs(turns="all", max_new_tokens=16))
    write_jsonl(tmp_path / "responses.jsonl", responses)
    eot = target.end_of_turn_id(target_folder, tokenizer)
    stats = merge.run(
        tmp_path / "responses.jsonl",
        tmp_path / "seq",
        tok,
        NONE,
        eot,
        config.Merge(valid_fraction=0.0, max_length=1024),
    )
    seqs = list(sequences.read(tmp_path / "seq", "train"))
    by_id = {r.id: r for r in responses}
    if joined:
        assert stats["turns"] == {"joined": 2, "apart": 0} and [s[0] for s in seqs] == [f"{ps[0].id}@3"]
    else:
        assert stats["turns"] == {"joined": 0, "apart": 2} and len(seqs) == 3
    for rid, _, ids, mask in seqs:
        last = by_id[rid]
        assert ids.tolist() == last.prompt_ids + last.output_ids
        covered = [r for r in responses if r.turn <= last.turn] if joined else [last]
        assert ids[mask.bool()].tolist() == [t for r in covered for t in r.output_ids]
