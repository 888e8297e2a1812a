"""merge: sequences are prompt_ids + output_ids exactly, the loss mask covers exactly the output, the policy for
end-of-turn, truncation and aborts is applied and counted, splits are deterministic, bad records are refused."""

import json
from collections import Counter
from dataclasses import replace

import pytest

from eaglepipe.core import config
from eaglepipe.core.records import Generation, RecordError, prompt_of, record_id, write_jsonl
from eaglepipe.dataset import merge, sequences
from eaglepipe.engines import Sampling
from eaglepipe.target import model as target
from eaglepipe.text import derive

NONE = derive.spec_from_params("none")
PARAMS = config.Merge(seed=0, valid_fraction=0.25, max_length=64, shard_tokens=100)


def response(tokenizer, rid, prompt_len, output, finish="stop", source="s", sample=0):
    gen = Generation(record_id(rid, sample), source, list(range(10, 10 + prompt_len)), output, finish, {}, sample)
    return derive.to_response(gen, tokenizer, NONE, Sampling())


@pytest.fixture(scope="module")
def eot(target_folder, tokenizer):
    return target.end_of_turn_id(target_folder, tokenizer)


def test_end_of_turn_is_the_chatml_im_end(eot, tokenizer):
    assert tokenizer.convert_ids_to_tokens(eot) == "<|im_end|>"


def test_sequence_is_prompt_plus_output_and_mask_is_the_output(tokenizer, eot):
    counts = Counter()
    r = response(tokenizer, "a", 5, [100, 101, eot])
    ids, mask = sequences.build(r, eot, 64, counts)
    assert ids == r.prompt_ids + r.output_ids
    assert mask == [0] * 5 + [1] * 3
    assert not counts


def test_stop_without_end_of_turn_gets_it_appended_and_counted(tokenizer, eot):
    counts = Counter()
    ids, mask = sequences.build(response(tokenizer, "a", 4, [100, 101]), eot, 64, counts)
    assert ids[-1] == eot and mask == [0] * 4 + [1] * 3
    assert counts == {"end_of_turn_appended": 1}
    ids, _ = sequences.build(response(tokenizer, "b", 4, [100, 101], "length"), eot, 64, counts)
    assert ids[-1] == 101 and counts["end_of_turn_appended"] == 1


def test_length_cap_abort_and_long_prompts_are_counted(tokenizer, eot):
    counts = Counter()
    ids, mask = sequences.build(response(tokenizer, "a", 6, list(range(200, 220)), "length"), eot, 10, counts)
    assert len(ids) == 10 and mask == [0] * 6 + [1] * 4
    assert sequences.build(response(tokenizer, "b", 10, [100], "length"), eot, 10, counts) is None
    assert sequences.build(response(tokenizer, "c", 3, [100], "abort"), eot, 10, counts) is None
    assert counts == {"truncated": 1, "left_out_prompt_too_long": 1, "left_out_abort": 1}


def run_merge(tmp_path, tokenizer, eot, records, name="out"):
    path = tmp_path / f"{name}.jsonl"
    write_jsonl(path, records)
    stats = merge.run(path, tmp_path / name, tokenizer, NONE, eot, PARAMS)
    return stats, {split: list(sequences.read(tmp_path / name, split)) for split in ("train", "valid")}


def test_shards_split_and_shuffle_are_deterministic_and_stable(tmp_path, tokenizer, eot):
    records = [response(tokenizer, f"r{i}", 3 + i % 5, [100 + i, eot], source=f"s{i % 2}") for i in range(40)]
    stats, data = run_merge(tmp_path, tokenizer, eot, records)
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert len(index["train"]["shards"]) > 1  # shard_tokens=100 forces several shards
    assert stats["train"]["samples"] + stats["valid"]["samples"] == 40
    assert 0 < stats["valid"]["samples"] < 20
    by_id = {r.id: r for r in records}
    for rid, source, ids, mask in data["train"] + data["valid"]:
        assert list(ids) == by_id[rid].prompt_ids + by_id[rid].output_ids and source == by_id[rid].source
        assert mask.sum() == len(by_id[rid].output_ids)
    assert stats["train"]["trained_tokens"] == sum(int(m.sum()) for *_, m in data["train"])

    again, data2 = run_merge(tmp_path, tokenizer, eot, list(reversed(records)), "again")
    assert [d[0] for d in data2["train"]] == [d[0] for d in data["train"]]  # input order does not matter
    more, data3 = run_merge(
        tmp_path, tokenizer, eot, records + [response(tokenizer, f"n{i}", 4, [7, eot]) for i in range(20)], "more"
    )
    assert {d[0] for d in data["valid"]} <= {d[0] for d in data3["valid"]}  # adding data moves nothing
    assert {d[0] for d in data["train"]} <= {d[0] for d in data3["train"]}


def test_the_answers_to_one_prompt_share_a_split(tmp_path, tokenizer, eot):
    records = [response(tokenizer, f"p{i}", 3, [100 + k, eot], sample=k) for i in range(40) for k in range(3)]
    stats, data = run_merge(tmp_path, tokenizer, eot, records)
    side = {}
    for split in ("train", "valid"):
        for rid, *_ in data[split]:
            side.setdefault(prompt_of(rid), set()).add(split)
    assert len(side) == 40 and all(len(s) == 1 for s in side.values())
    assert 0 < stats["valid"]["samples"] < 60 and stats["valid"]["samples"] % 3 == 0


def test_a_sample_that_does_not_match_its_id_is_refused(tmp_path):
    from eaglepipe.core.records import generation_from_json

    rec = {"id": "abc.2", "source": "s", "prompt_ids": [1], "output_ids": [2], "finish_reason": "stop", "sample": 1}
    with pytest.raises(RecordError, match=r"x.jsonl:7: field 'sample'"):
        generation_from_json(rec, "x.jsonl", 7)
    assert prompt_of(generation_from_json({**rec, "sample": 2}, "x.jsonl", 7).id) == "abc"
    with pytest.raises(RecordError, match=r"x.jsonl:7: field 'turn'"):
        generation_from_json({**rec, "id": "abc.1@2", "turn": 3}, "x.jsonl", 7)
    with pytest.raises(RecordError, match=r"x.jsonl:7: field 'id'"):
        generation_from_json({**rec, "id": "abc.x"}, "x.jsonl", 7)
    assert generation_from_json({**rec, "id": "abc.1@2", "turn": 2}, "x.jsonl", 7).turn == 2


def test_an_inconsistent_record_is_refused_with_file_line_and_field(tmp_path, tokenizer, eot):
    good = response(tokenizer, "a", 3, [100, eot])
    bad = replace(response(tokenizer, "b", 3, [101, eot]), content="something else")
    path = tmp_path / "r.jsonl"
    write_jsonl(path, [good, bad])
    with pytest.raises(RecordError, match=r"r\.jsonl:2: field 'text'|r\.jsonl:2: field 'content'"):
        merge.run(path, tmp_path / "out", tokenizer, NONE, eot, PARAMS)
    broken = json.loads(path.read_text().splitlines()[0])
    del broken["output_ids"]
    path.write_text(json.dumps(broken) + "\n")
    with pytest.raises(RecordError, match=r"r\.jsonl:1: field 'output_ids' is missing"):
        merge.run(path, tmp_path / "out", tokenizer, NONE, eot, PARAMS)


def turn(tokenizer, pid, t, prompt_ids, output, sample=0):
    gen = Generation(record_id(pid, sample, t), "s", prompt_ids, output, "stop", {}, sample, t)
    return derive.to_response(gen, tokenizer, NONE, Sampling())


def test_turns_that_extend_each_other_share_a_sequence_and_others_stand_apart(tmp_path, tokenizer, eot):
    """Turn 2's prompt is turn 1's prompt and output, then a user turn: one sequence, both outputs masked. Turn 3's
    prompt rewrote the history (as a template that drops it does): a sequence of its own."""
    one = turn(tokenizer, "c", 1, [10, 11], [100, 101, eot])
    two = turn(tokenizer, "c", 2, [10, 11, 100, 101, eot, 12, 13], [102, eot])
    three = turn(tokenizer, "c", 3, [10, 11, 99, eot, 12, 13, 102, eot, 14], [103, eot])
    other = turn(tokenizer, "d", 1, [10, 11], [100, 101, eot])  # another conversation: never joined to c
    stats, data = run_merge(tmp_path, tokenizer, eot, [one, two, three, other])
    got = {rid: (list(ids), mask.tolist()) for rid, _, ids, mask in data["train"] + data["valid"]}
    assert got == {
        "c@2": (two.prompt_ids + two.output_ids, [0, 0, 1, 1, 1, 0, 0, 1, 1]),
        "c@3": (three.prompt_ids + three.output_ids, [0] * 9 + [1, 1]),
        "d@1": (other.prompt_ids + other.output_ids, [0, 0, 1, 1, 1]),
    }
    assert stats["turns"] == {"joined": 1, "apart": 1}
    assert {prompt_of(rid) for rid in got} == {"c", "d"}
