"""The engine's log-probabilities in infer (eaglepipe/infer/run.py, cache.py): kept in the cache and the records
beside the ids, counted in the report, answers cached before engines gave them still served (and said so), infer's
keys for vLLM and SGLang unchanged by them; and the hook a run calls once before its first answer."""

import json
import logging

from infer_helpers import QUESTIONS, Knobs, prompts, run

from eaglepipe.core.fingerprint import code_key
from eaglepipe.core.records import Generation, Prompt, content_id, response_from_json, to_json
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.run import GENERATION_CODE, HISTORY_CODE

# infer's code keys for vLLM and SGLang (turns: last, then turns: all) before engines gave log-probabilities: the
# answers users paid for stay valid as long as these hold (engines/logprobs.py and the client carry the figures).
KEYS_BEFORE_FIGURES = {
    "vllm": (
        "ef115df441196dd49d1009ad275d2c5ce89af69d124485366800b068ea1ce43c",
        "fc93b86ac794168484412fb806e35c05458cd6e0fe9176b3671314926304507a",
    ),
    "sglang": (
        "334ea5e532f8b11bfd0f84eea8f9cab7fcd321f0be19ed2be7d718534b3bc8cb",
        "18fd844dc8e438019b95cd9ce0eb95b7b129cb4921504adf0f441d45c61f8aae",
    ),
}


def test_infers_keys_for_vllm_and_sglang_are_the_ones_before_engines_gave_figures():
    for engine, (last, every) in KEYS_BEFORE_FIGURES.items():
        assert code_key([*GENERATION_CODE, f"engines.{engine}"]) == last, engine
        assert code_key([*GENERATION_CODE, f"engines.{engine}", *HISTORY_CODE]) == every, engine


def test_figures_round_trip_through_the_cache_and_old_lines_read_without(tmp_path):
    cache = Cache(tmp_path)
    scored = Generation("a", "s", [1], [2, 3, 4], "length", {}, 0, 0, [-0.5, None, -1.25])
    cache.add(scored)
    old = {"id": "b", "source": "s", "prompt_ids": [1], "output_ids": [2], "finish_reason": "stop", "sample": 0}
    with open(cache.path, "a") as f:
        f.write(json.dumps(old) + "\n")
    done, counts = cache.load()
    assert done["a"] == scored and done["b"].logprobs is None and not counts
    assert json.loads(cache.path.read_text().splitlines()[0])["logprobs"] == [-0.5, None, -1.25]


def test_records_carry_the_engines_figures_from_the_cache_too(model, tokenizer, target_folder, tmp_path):
    ps = prompts(QUESTIONS[:3])
    responses, report = run(ps, model, tokenizer, target_folder, tmp_path)
    assert all(len(r.logprobs) == len(r.output_ids) and all(f <= 0 for f in r.logprobs) for r in responses)
    assert report["logprobs"] == {"records_with": 3, "records_without": 0, "tokens_without": 0}
    published = [to_json(r) for r in responses]
    assert all(list(p)[-1] == "logprobs" for p in published)  # the last field of a record
    assert [response_from_json(p) for p in published] == responses
    again, report = run(ps, model, tokenizer, target_folder, tmp_path)
    assert report["run"]["generated"] == 0 and [to_json(r) for r in again] == published


def test_answers_cached_before_engines_gave_figures_are_served_counted_and_said(
    model, tokenizer, target_folder, tmp_path, caplog
):
    ps = prompts(QUESTIONS[:3])
    first, _ = run(ps, model, tokenizer, target_folder, tmp_path)
    (path,) = tmp_path.glob("*/generations.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in g.items() if k != "logprobs"}) + "\n" for g in lines[:2]))
    with caplog.at_level(logging.WARNING, logger="eaglepipe.infer.run"):
        again, report = run(ps, model, tokenizer, target_folder, tmp_path)
    assert report["run"]["generated"] == 1
    old = {g["id"] for g in lines[:2]}
    assert [r.logprobs is None for r in again] == [r.id in old for r in again]
    (new,), (before,) = [r for r in again if r.id not in old], [r for r in first if r.id not in old]
    assert max(abs(a - b) for a, b in zip(new.logprobs, before.logprobs)) < 1e-4  # alone now, in a batch of 3 then
    assert [r.output_ids for r in again] == [r.output_ids for r in first]
    assert report["logprobs"] == {"records_with": 1, "records_without": 2, "tokens_without": 0}
    warned = [r.getMessage() for r in caplog.records if "predate engine log-probabilities" in r.getMessage()]
    assert warned == [
        f"2 answers in {path.parent} predate engine log-probabilities: hidden checks them by the target's "
        "likelihood alone; delete the folder to regenerate them with figures"
    ]


def cached_lines(folder) -> int:
    return sum(len(path.read_text().splitlines()) for path in folder.glob("*/generations.jsonl"))


def test_the_hook_runs_once_before_the_first_answer_never_for_a_cached_run(model, tokenizer, target_folder, tmp_path):
    calls = []

    def hook(record_ids, prompt_ids):
        calls.append((record_ids, prompt_ids, cached_lines(tmp_path)))

    ps = prompts(QUESTIONS[:5])
    responses, _ = run(ps[:3], model, tokenizer, target_folder, tmp_path, Knobs(batch_size=2), hook)
    assert calls == [([r.id for r in responses], [r.prompt_ids for r in responses], 0)]
    run(ps[:3], model, tokenizer, target_folder, tmp_path, Knobs(batch_size=2), hook)  # every answer cached
    assert len(calls) == 1
    responses, _ = run(ps, model, tokenizer, target_folder, tmp_path, Knobs(batch_size=2), hook)
    assert calls[1] == ([r.id for r in responses[3:]], [r.prompt_ids for r in responses[3:]], 3)


def test_the_hook_runs_once_in_a_run_of_every_turn(model, tokenizer, target_folder, tmp_path):
    calls = []
    messages = [
        {"role": "user", "content": "Name a planet."},
        {"role": "assistant", "content": "Mars."},
        {"role": "user", "content": "Name another one."},
    ]
    ps = [Prompt(content_id(messages, None), "t", messages), *prompts(QUESTIONS[:1])]
    knobs = Knobs(turns="all")
    responses, report = run(ps, model, tokenizer, target_folder, tmp_path, knobs, lambda *a: calls.append(a))
    assert report["turns"]["answered"] == {1: 2, 2: 1}
    assert calls == [([r.id for r in responses if r.turn == 1], [r.prompt_ids for r in responses if r.turn == 1])]
