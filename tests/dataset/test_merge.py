"""merge: sequences are prompt_ids + output_ids exactly, the loss mask covers exactly the output, the policy for
end-of-turn, truncation and aborts is applied and counted, splits are deterministic, bad records are refused; the
engine's log-probabilities follow their ids through appends, truncation, joined turns and the shards, and the index
says the run's sampling, engines and how many records carry figures, and the dtype the engine computed in (from
infer's engine.json beside the responses)."""

import json
import math
import re
import sys
from collections import Counter
from dataclasses import replace

import pytest
from sglang_server import distribution, free_port

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import Generation, RecordError, prompt_of, record_id, write_json, write_jsonl
from eaglepipe.dataset import merge, sequences
from eaglepipe.engines import Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.engines.launch import servers
from eaglepipe.engines.sglang import SGLangEngine
from eaglepipe.engines.vllm import VLLMEngine
from eaglepipe.target import model as target
from eaglepipe.text import derive

NONE = derive.spec_from_params("none")
PARAMS = config.Merge(seed=0, valid_fraction=0.25, max_length=64, shard_tokens=100)
NAN = float("nan")


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
    built = sequences.build(r, eot, 64, counts)
    assert built.ids == r.prompt_ids + r.output_ids
    assert built.mask == [0] * 5 + [1] * 3
    assert not counts


def test_stop_without_end_of_turn_gets_it_appended_and_counted(tokenizer, eot):
    counts = Counter()
    built = sequences.build(response(tokenizer, "a", 4, [100, 101]), eot, 64, counts)
    assert built.ids[-1] == eot and built.mask == [0] * 4 + [1] * 3
    assert counts == {"end_of_turn_appended": 1}
    built = sequences.build(response(tokenizer, "b", 4, [100, 101], "length"), eot, 64, counts)
    assert built.ids[-1] == 101 and counts["end_of_turn_appended"] == 1


def test_length_cap_abort_and_long_prompts_are_counted(tokenizer, eot):
    counts = Counter()
    built = sequences.build(response(tokenizer, "a", 6, list(range(200, 220)), "length"), eot, 10, counts)
    assert len(built.ids) == 10 and built.mask == [0] * 6 + [1] * 4
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


def scored(r, figures, engine="hf"):
    """``r`` with the engine's log-probabilities ``figures`` (one per output id) and its engine named in meta."""
    return replace(r, logprobs=figures, meta={**r.meta, "engine": engine})


def same(got, want) -> bool:
    """Equal lists of figures, NaN equal to NaN, each at float32 precision."""
    return len(got) == len(want) and all(
        (math.isnan(a) and math.isnan(b)) or abs(a - b) < 1e-6 for a, b in zip(got, want, strict=True)
    )


def test_engine_figures_sit_on_the_output_ids_nan_on_the_prompt_and_an_appended_end_of_turn(tokenizer, eot):
    counts = Counter()
    built = sequences.build(scored(response(tokenizer, "a", 3, [100, 101]), [-0.5, None]), eot, 64, counts)
    assert built.ids == [10, 11, 12, 100, 101, eot] and counts == {"end_of_turn_appended": 1}
    assert same(built.engine_logprob, [NAN, NAN, NAN, -0.5, NAN, NAN])  # None: no figure; the eot is merge's
    kept = sequences.build(scored(response(tokenizer, "b", 3, [100, eot]), [-0.25, -1.5]), eot, 64, counts)
    assert same(kept.engine_logprob, [NAN, NAN, NAN, -0.25, -1.5])  # an eot the engine gave keeps its figure
    cut = sequences.build(
        scored(response(tokenizer, "c", 3, [7] * 9, "length"), [-0.1 * k for k in range(9)]), eot, 6, counts
    )
    assert len(cut.engine_logprob) == len(cut.ids) == 6 and same(cut.engine_logprob[3:], [0.0, -0.1, -0.2])
    bare = sequences.build(response(tokenizer, "d", 3, [100, eot]), eot, 64, counts)
    assert bare.engine_logprob is not None and all(math.isnan(x) for x in bare.engine_logprob)


def test_joined_turns_keep_each_turns_figures_and_the_shards_carry_them(tmp_path, tokenizer, eot):
    one = scored(turn(tokenizer, "c", 1, [10, 11], [100, 101, eot]), [-0.1, -0.2, -0.3])
    two = scored(turn(tokenizer, "c", 2, [10, 11, 100, 101, eot, 12, 13], [102]), [-0.4])  # stop: eot appended
    other = turn(tokenizer, "d", 1, [10, 11], [100, 101, eot])  # an answer cached before engines reported figures
    stats, data = run_merge(tmp_path, tokenizer, eot, [one, two, other])
    assert stats["turns"] == {"joined": 1, "apart": 0}
    stored = {
        s.id: s.engine_logprob.tolist()
        for split in ("train", "valid")
        for s in sequences.read_samples(tmp_path / "out", split)
    }
    assert same(stored["c@2"], [NAN, NAN, -0.1, -0.2, -0.3, NAN, NAN, -0.4, NAN])
    assert len(stored["d@1"]) == 5 and all(math.isnan(x) for x in stored["d@1"])
    for split in ("train", "valid"):
        for rid, _source, ids, mask in sequences.read(tmp_path / "out", split):  # the four-item reader is unchanged
            assert len(ids) == len(mask) == len(stored[rid])
    policy = json.loads((tmp_path / "out" / "index.json").read_text())["policy"]
    assert policy["sampling"] == Sampling().to_json() and policy["engines"] == ["hf"]
    assert policy["engine_logprobs"] == {"records_with": 2, "records_without": 1}


def test_records_of_two_sampling_policies_are_refused_naming_the_file(tmp_path, tokenizer, eot):
    first = response(tokenizer, "a", 3, [100, eot])
    second = replace(response(tokenizer, "b", 3, [101, eot]), sampling=Sampling(temperature=0.5).to_json())
    with pytest.raises(UserError, match=r"out\.jsonl:2: record b was sampled with .*one sampling policy"):
        run_merge(tmp_path, tokenizer, eot, [first, second])
    assert not (tmp_path / "out").exists()


# ---- the engine's dtype, from infer's engine.json ----------------------------------------------------------------
def merged_engine_dtype(base, tokenizer, eot, described: dict | None, engine: str = "hf"):
    """index.json's ``engine_dtype`` after merging one answer of ``engine`` whose folder holds an engine.json of
    ``described`` (an engine's ``describe()``, written as infer writes it), or none."""
    base.mkdir()
    if described is not None:
        kept = {k: v for k, v in described.items() if k != "servers"}  # infer reports the servers, never keeps them
        write_json(base / "engine.json", {"fingerprint": "fp", **kept})
    run_merge(base, tokenizer, eot, [scored(response(tokenizer, "a", 3, [100, eot]), [-0.5, -0.25], engine)])
    return json.loads((base / "out" / "index.json").read_text())["policy"]["engine_dtype"]


def test_the_in_process_engines_dtype_is_read_from_engine_json(tmp_path, tokenizer, eot, model):
    """The hf engine's ("torch.float32"); none without engine.json (answers merged from elsewhere) or where the
    records name another engine than engine.json's."""
    described = HFEngine(model, tokenizer.pad_token_id).describe()
    assert described["dtype"] == "torch.float32"
    assert merged_engine_dtype(tmp_path / "hf", tokenizer, eot, described) == "float32"
    assert merged_engine_dtype(tmp_path / "absent", tokenizer, eot, None) is None
    assert merged_engine_dtype(tmp_path / "another", tokenizer, eot, described, engine="vllm") is None


def launched(tmp_path, target_folder, dtype: str) -> config.Servers:
    """A launched server's section as infer's engine gets it (``servers``: ``--dtype`` unless auto); never started."""
    never = [sys.executable, "-c", "import sys; sys.exit(3)"]
    launch = config.Launch(model_path=str(target_folder), port=free_port(), log=str(tmp_path / "log"), command=never)
    return servers(config.Servers(launch=launch), target_folder, dtype)


def test_a_servers_dtype_is_its_launchs_or_what_it_reports(tmp_path, tokenizer, eot, target_folder, monkeypatch):
    """A launched vLLM or SGLang: its --dtype (SGLang at auto says auto: unknown); a vLLM given by url says none, an
    SGLang given by url what its server_info says."""
    site = distribution(distribution(tmp_path / "site", "vllm", "0.32.0"), "sglang", "0.5.0")
    monkeypatch.setenv("PYTHONPATH", str(site))
    vllm = VLLMEngine(launched(tmp_path, target_folder, "bfloat16"), tokenizer, interpreter=sys.executable)
    vllm.identity()  # predicted from the launch: nothing starts
    assert merged_engine_dtype(tmp_path / "vllm", tokenizer, eot, vllm.describe(), "vllm") == "bfloat16"
    sglang = SGLangEngine(launched(tmp_path, target_folder, "float16"), tokenizer)
    sglang.identity()
    assert merged_engine_dtype(tmp_path / "sglang", tokenizer, eot, sglang.describe(), "sglang") == "float16"
    sglang_auto = SGLangEngine(launched(tmp_path, target_folder, "auto"), tokenizer)
    sglang_auto.identity()
    assert merged_engine_dtype(tmp_path / "sglang-auto", tokenizer, eot, sglang_auto.describe(), "sglang") is None
    assert vllm.launched.proc is None and sglang.launched.proc is None and sglang_auto.launched.proc is None
    by_url = {"engine": "vllm", "identity": {"model": "m", "vllm_version": "0.32.0", "dtype": None}, "launched": None}
    assert merged_engine_dtype(tmp_path / "vllm-url", tokenizer, eot, by_url, "vllm") is None
    reported = {"engine": "sglang", "identity": {"model_path": "m", "dtype": "half"}, "launched": None}
    assert merged_engine_dtype(tmp_path / "sglang-url", tokenizer, eot, reported, "sglang") == "float16"
    names = ("torch.bfloat16", "torch.float16", "float", "float32", "auto", None)
    assert [merge.normalised_dtype(name) for name in names] == ["bfloat16", "float16", "float32", "float32", None, None]


@pytest.mark.parametrize(
    "text",
    ["{not json", "[]", '{"engine": "vllm", "identity": "float32"}', '{"engine": "hf", "dtype": 32}', "\xff"],
)
def test_a_malformed_engine_json_is_refused_naming_it(tmp_path, tokenizer, eot, text):
    (tmp_path / "engine.json").write_bytes(text.encode("latin-1"))
    path = re.escape(str(tmp_path / "engine.json"))
    with pytest.raises(UserError, match=rf"^{path}: .*infer writes it beside responses\.jsonl .*\(rerun infer\)$"):
        run_merge(tmp_path, tokenizer, eot, [response(tokenizer, "a", 3, [100, eot])])
    assert not (tmp_path / "out").exists()
