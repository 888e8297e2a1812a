"""infer: token-exact records, resumable after Ctrl-C or kill -9, incremental, never mixing fingerprints."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from eaglepipe import config, chat, derive, infer, target
from eaglepipe.engines import Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.gates import Gates
from eaglepipe.records import Prompt, content_id, prompt_of, read_jsonl, response_from_json, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 plus 2?",
             "Say hello in Spanish.", "Name a planet.", "What do bees make?", "Spell 'cat' backwards.",
             "What is the opposite of hot?"]
GATES = {"warmup": 4, "every": 4, "min_reasoning": 0.9, "max_truncated": 1.0, "max_empty": 0.5}


def prompts(questions, source="t"):
    out = []
    for q in questions:
        messages = [{"role": "user", "content": q}]
        out.append(Prompt(content_id(messages, None), source, messages))
    return out


def run(prompt_list, model, tokenizer, folder, cache_dir, max_new_tokens=12, batch_size=4, samples=1,
        temperature=0.0):
    engine = HFEngine(model, tokenizer.pad_token_id, batch_size)
    sampling = Sampling(temperature=temperature, max_new_tokens=max_new_tokens,
                        stop_token_ids=tuple(target.stop_ids(folder, tokenizer)))
    fp = infer.fingerprint(target.fingerprint(folder), "hf", engine.identity(), sampling, {})
    spec = derive.spec_from_params("none")
    return infer.run(prompt_list, engine, tokenizer, sampling, spec, Gates(config.Gates(**GATES), False),
                     infer.Cache(Path(cache_dir) / fp), {}, samples=samples)


def test_records_are_token_exact(model, tokenizer, target_folder, tmp_path):
    ps = prompts(QUESTIONS[:3])
    responses, report = run(ps, model, tokenizer, target_folder, tmp_path)
    assert [r.id for r in responses] == [p.id for p in ps]
    stops = target.stop_ids(target_folder, tokenizer)
    for p, r in zip(ps, responses):
        assert r.prompt_ids == chat.prompt_ids(tokenizer, p.messages)
        assert r.text == tokenizer.decode(r.output_ids, skip_special_tokens=False)
        assert r.content == r.text and r.reasoning == ""
        # the same ids as a bare, unbatched greedy model.generate
        bare = model.generate(torch.tensor([r.prompt_ids]), max_new_tokens=12, do_sample=False,
                              eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)[0, len(r.prompt_ids):].tolist()
        assert r.output_ids == bare[:len(r.output_ids)]
        assert r.finish_reason == ("stop" if r.output_ids[-1] in stops else "length")
    assert report["tokens_out"] == sum(len(r.output_ids) for r in responses)
    assert sum(report["finish_reason"].values()) == 3


def test_rows_leaving_the_batch_keep_every_answer_exact(model, tokenizer, target_folder, tmp_path):
    """Eight prompts in one batch finish at different steps (rows leave as they finish); each answer is still the
    one the prompt gets alone."""
    ps = prompts(QUESTIONS)
    batched, _ = run(ps, model, tokenizer, target_folder, tmp_path / "a", max_new_tokens=16, batch_size=8)
    assert len({len(r.output_ids) for r in batched}) > 1, "the rows should finish at different steps"
    alone, _ = run(ps, model, tokenizer, target_folder, tmp_path / "b", max_new_tokens=16, batch_size=1)
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]


def test_samples_per_prompt_are_distinct_records_and_grow_incrementally(model, tokenizer, target_folder, tmp_path):
    ps = prompts(QUESTIONS[:3])
    responses, report = run(ps, model, tokenizer, target_folder, tmp_path, samples=2, temperature=1.0)
    assert [r.id for r in responses] == [i for p in ps for i in (p.id, f"{p.id}.1")]
    assert [r.sample for r in responses] == [0, 1] * 3
    assert [prompt_of(r.id) for r in responses] == [p.id for p in ps for _ in (0, 1)]
    assert report["prompts"] == 3 and report["answers"] == 6
    assert any(a.output_ids != b.output_ids for a, b in zip(responses[::2], responses[1::2]))
    again, report = run(ps, model, tokenizer, target_folder, tmp_path, samples=3, temperature=1.0)
    assert report["run"]["generated"] == 3  # only the third answer of each prompt
    assert [r.output_ids for r in again if r.sample < 2] == [r.output_ids for r in responses]
    with pytest.raises(config.ConfigError, match="need temperature > 0"):  # refused before any model is loaded
        config.parse({"prepare": {"sources": []}, "infer": {"samples": 2, "temperature": 0.0}})


def test_adding_a_source_generates_only_its_prompts(model, tokenizer, target_folder, tmp_path):
    first = prompts(QUESTIONS[:3], "a")
    _, report = run(first, model, tokenizer, target_folder, tmp_path)
    assert report["run"]["generated"] == 3
    responses, report = run(first + prompts(QUESTIONS[3:5], "b"), model, tokenizer, target_folder, tmp_path)
    assert report["run"]["generated"] == 2
    assert len(responses) == 5 and report["per_source"] == {"a": 3, "b": 2}


def test_other_params_never_reuse_a_cache(model, tokenizer, target_folder, tmp_path):
    ps = prompts(QUESTIONS[:2])
    run(ps, model, tokenizer, target_folder, tmp_path, max_new_tokens=6)
    _, report = run(ps, model, tokenizer, target_folder, tmp_path, max_new_tokens=7)
    assert report["run"]["generated"] == 2
    assert len(list(tmp_path.iterdir())) == 2


def test_torn_last_line_and_duplicates_are_dropped_and_counted(tmp_path):
    cache = infer.Cache(tmp_path)
    line = json.dumps({"id": "a", "source": "s", "prompt_ids": [1], "output_ids": [2], "finish_reason": "stop",
                       "sample": 0})
    cache.path.write_text(line + "\n" + line + "\n" + line[:20])
    done, counts = cache.load()
    assert list(done) == ["a"] and counts == {"duplicates": 1, "torn_last_line": 1}
    assert cache.path.read_text() == line + "\n"


def write_params(tmp_path, **infer_overrides):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["infer"].update(batch_size=1, max_new_tokens=24, samples=1, temperature=0.0, **infer_overrides)
    params["infer"]["gates"].update(GATES)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def stage(tmp_path, params):
    return [sys.executable, str(ROOT / "stages/infer.py"), "--params", str(params), "--prompts",
            str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "out"), "--report", str(tmp_path / "report.json"),
            "--timings", str(tmp_path / "timings.json"), "--cache", str(tmp_path / "cache")]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_run_resumes_with_every_record_once(tmp_path, sig):
    ps = prompts(QUESTIONS)
    write_jsonl(tmp_path / "prompts.jsonl", ps)
    cmd = stage(tmp_path, write_params(tmp_path))
    # A shell running the tests in the background leaves SIGINT ignored in its children; a user's Ctrl-C is not.
    restore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=restore_sigint)
    deadline = time.time() + 120
    cache_file = None
    while time.time() < deadline and proc.poll() is None:  # wait until some, not all, records are in the cache
        files = list((tmp_path / "cache").glob("*/generations.jsonl"))
        if files and 2 <= len(files[0].read_text().splitlines()) <= len(ps) // 2:  # far from the end
            cache_file = files[0]
            break
        time.sleep(0.05)
    assert cache_file is not None, "the stage never reached the middle of its run"
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not (tmp_path / "out" / "responses.jsonl").exists()
    done_before = len({json.loads(l)["id"] for l in cache_file.read_text().splitlines() if l.endswith("}")})

    subprocess.run(cmd, check=True, capture_output=True)
    records = [response_from_json(obj) for _, obj in read_jsonl(tmp_path / "out" / "responses.jsonl")]
    assert sorted(r.id for r in records) == sorted(p.id for p in ps)
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert timings["generated"] == len(ps) - done_before


def test_hf_engine_ignores_sampling_defaults_of_the_model_folder(target_folder, tokenizer, tmp_path):
    """Only the explicit sampling params count: a generation_config.json with a repetition penalty and a top_k
    (which transformers would otherwise apply) changes nothing."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(target_folder, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(repetition_penalty=1.8, top_k=3, no_repeat_ngram_size=2)
    (folder / "generation_config.json").write_text(json.dumps(config))
    ids = [chat.prompt_ids(tokenizer, [{"role": "user", "content": "Write a haiku about rain."}])]
    sampling = Sampling(max_new_tokens=24, stop_token_ids=(tokenizer.eos_token_id,))
    plain = HFEngine(target.load_model(target_folder), tokenizer.pad_token_id).generate(ids, sampling)[0]
    tweaked = HFEngine(target.load_model(folder), tokenizer.pad_token_id).generate(ids, sampling)[0]
    assert tweaked.output_ids == plain.output_ids


def test_sampling_filters_follow_sglang():
    from eaglepipe.engines.hf import pick

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    top = logits.argmax(-1)
    draw = lambda **kw: pick(logits, Sampling(temperature=1.0, **kw), torch.Generator().manual_seed(1))  # noqa: E731
    for only_the_top in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert torch.equal(draw(**only_the_top), top), only_the_top
    assert torch.equal(draw(), draw())  # seeded
    probs = torch.softmax(logits, -1)
    for _ in range(20):  # top_k=3 only ever draws among the three best; top_p=0.5 among the nucleus
        seed = torch.Generator().manual_seed(_)
        picked = pick(logits, Sampling(temperature=1.0, top_k=3), seed)
        assert all(p in row for p, row in zip(picked.tolist(), logits.topk(3).indices.tolist()))
        picked = pick(logits, Sampling(temperature=1.0, top_p=0.5), seed)
        sorted_probs, order = probs.sort(-1, descending=True)
        for row, p in enumerate(picked.tolist()):
            rank = order[row].tolist().index(p)
            assert sorted_probs[row, :rank].sum() <= 0.5
    assert torch.equal(pick(logits, Sampling(), None), top)  # temperature 0: greedy
