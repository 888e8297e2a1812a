"""Regression: a reasoning model's thinking silently lost from the training data (../shared/seed).

The real infer run (real cache, real gates, params.yaml's gate settings) is driven by a scripted engine that serves a
reasoning model's answers as token ids of the test tokenizer (reasoning_fixtures.py), so these tests run offline:
1. the seed's run replayed: every record keeps non-empty reasoning, and merge accepts every record;
2. the same run with the reasoning dropped from the served answers fails its gate within the warm-up, keeps what it
   generated in the cache and publishes nothing; merge refuses a published record whose reasoning was blanked;
3. the prefilled-opening-tag template, an output with no closing tag, gpt-oss harmony channels;
4. the real stage, as a subprocess, on the embedded model (not a reasoning model) under ``target.reasoning: think``.
1 and 2 also run end to end over HTTP (``test_1_e2e_*``, ``test_2_e2e_*``): stages/infer.py as a subprocess with
``infer.engine: sglang`` against tests/sglang_server.py on loopback, both loading one model folder (the test
tokenizer and the embedded weights), the server serving a reasoning model's output ids (``--reasoning wrap``) or the
same with the thinking dropped (``--reasoning drop``); with the prefilling template and with the one that leaves
``<think>`` to the model.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from reasoning_fixtures import (
    ScriptedEngine,
    harmony_model,
    ids,
    model_folder,
    question_of,
    reasoning_dropped,
    reasoning_model,
    reasoning_tokenizer,
    served_model_folder,
    think_answer,
)
from sglang_server import THOUGHT, configure, free_port, start_server, stats, stop_server

from eaglepipe.core import config
from eaglepipe.core.records import Prompt, RecordError, content_id, response_from_json, write_json, write_jsonl
from eaglepipe.dataset import merge
from eaglepipe.engines import Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import GateBreach, Gates
from eaglepipe.infer.run import InferRun, Plan
from eaglepipe.target import chat
from eaglepipe.target import model as target
from eaglepipe.text import derive
from eaglepipe.tools import inspect

ROOT = Path(__file__).resolve().parents[2]
GATES = config.load(ROOT / "params.yaml").infer.gates  # the project's own settings
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]
MERGE = config.Merge(shard_tokens=100000)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return reasoning_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory)


def prompts(n, tools_every=4, source="glaive"):
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Question {i}: what is {i} times {i + 1}?"}]
        tools = TOOLS if tools_every and i % tools_every == 0 else None
        out.append(Prompt(content_id(messages, tools), source, messages, tools))
    return out


def run(ps, engine, tok, folder, cache_dir, spec, template_kwargs=None, max_new_tokens=256):
    sampling = Sampling(max_new_tokens=max_new_tokens, stop_token_ids=tuple(target.stop_ids(folder, tok)))
    gates = Gates(GATES, spec.expects_reasoning, derive.markup(tok))
    return InferRun(engine, tok, sampling, spec, gates, Cache(Path(cache_dir)), Plan(template_kwargs or {})).run(ps)


def test_1_seed_run_replayed_every_record_keeps_its_reasoning(tok, folder, tmp_path):
    ps = prompts(40)
    spec = derive.spec_from_params("think", "hermes")
    engine = ScriptedEngine(tok, reasoning_model)
    responses, rep = run(ps, engine, tok, folder, tmp_path / "cache", spec)
    assert len(responses) == 40 and engine.served == 40
    think = tok.convert_tokens_to_ids("</think>")
    for p, r in zip(ps, responses):
        thought, _ = think_answer(p.messages[-1]["content"], p.tools)
        assert think in r.output_ids  # the thinking is in the ids ...
        assert r.reasoning.strip() == thought  # ... and in the readable field
        assert r.reasoning_closed and r.content.endswith("<|im_end|>") and "</think>" not in r.content
        if p.tools:
            assert r.tool_calls == [
                {"type": "function", "function": {"name": "search", "arguments": {"query": p.messages[-1]["content"]}}}
            ]
            assert "<tool_call>" in r.content
    assert rep["with_reasoning"] == 40 and rep["unclosed_reasoning"] == 0
    assert rep["gates"]["min_reasoning"] == 1.0
    assert rep["tool_calls"] == {"records": 10, "calls": 10, "parse_failures": 0}
    # published, then merged: merge re-validates every record against its ids and accepts them all
    write_jsonl(tmp_path / "responses.jsonl", responses)
    stats = merge.run(
        tmp_path / "responses.jsonl",
        tmp_path / "seq",
        tok,
        derive.spec_from_params("think"),
        target.end_of_turn_id(folder, tok),
        MERGE,
    )
    assert stats["train"]["samples"] + stats["valid"]["samples"] == 40
    # what a user checks by eye: the inspection command, run as `make inspect` runs it
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"].update({"model": str(folder), "reasoning": "think", "tool_calls": "hermes"})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    write_json(tmp_path / "infer.json", rep)
    proc = subprocess.run(
        [
            sys.executable,
            "stages/inspect_run.py",
            "--responses",
            str(tmp_path / "responses.jsonl"),
            "--params",
            str(tmp_path / "params.yaml"),
            "--report",
            str(tmp_path / "infer.json"),
            "--n",
            "40",
            "--seed",
            "3",
            "--source",
            "glaive",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "with reasoning 40 (100.0%)" in out and "(source glaive): 40 records; showing 40" in out
    assert out.count("-- reasoning (closed) --") == 40 and out.count("-- content --") == 40
    assert out.count("re-derived from ids: ok") == 40 and out.count('  1. search({"query": ') == 10
    assert out.count("-- prompt (its prompt_ids decoded) --") == 40
    assert all(f"<|im_start|>user\n{p.messages[-1]['content']}<|im_end|>" in out for p in ps)  # the question asked


@pytest.mark.parametrize("template", [{}, {"prefill_think": False}], ids=["prefilled", "model-opens-tag"])
def test_2_reasoning_dropped_fails_its_gate_within_the_warmup(tok, folder, tmp_path, template):
    ps = prompts(64)
    engine = ScriptedEngine(tok, reasoning_dropped, "reasoning dropped")
    cache = tmp_path / "cache"
    with pytest.raises(GateBreach) as e:
        run(ps, engine, tok, folder, cache, derive.spec_from_params("think"), template)
    warmup = GATES.warmup
    msg = str(e.value)
    assert f"gate min_reasoning breached: observed 0.000 < {GATES.min_reasoning} after {warmup} records" in msg
    assert ", ".join(p.id for p in ps[:5]) in msg  # a few record ids to look at
    assert engine.served == warmup  # stopped at the first check: the rest was never asked for
    done, _ = Cache(cache).load()  # what was generated stays on disk for inspection
    assert list(done) == [p.id for p in ps[:warmup]]
    assert not (tmp_path / "responses.jsonl").exists()
    # the stopped run's records can be inspected where they are
    shown = inspect.render(cache / "generations.jsonl", 2, 0, tok, derive.spec_from_params("think"))
    assert f"generations.jsonl: {warmup} records; showing 2" in shown
    assert shown.count("NEVER CLOSED although the model stopped" if not template else "-- reasoning (none) --") == 2
    # resuming the broken run stops again at its first new record, before spending more compute
    engine2 = ScriptedEngine(tok, reasoning_dropped, "reasoning dropped")
    with pytest.raises(GateBreach, match=f"after {warmup + 1} records"):
        run(ps, engine2, tok, folder, cache, derive.spec_from_params("think"), template)
    assert engine2.served == 1


def test_2b_merge_refuses_a_published_record_whose_reasoning_was_blanked(tok, folder, tmp_path):
    spec = derive.spec_from_params("think")
    responses, _ = run(prompts(3, 0), ScriptedEngine(tok, reasoning_model), tok, folder, tmp_path / "c", spec)
    responses[1].reasoning = ""  # the seed's record: thinking in the ids, nothing in the field
    write_jsonl(tmp_path / "r.jsonl", responses)
    with pytest.raises(RecordError, match=r"r\.jsonl:2: field 'reasoning'.*inconsistent"):
        merge.run(tmp_path / "r.jsonl", tmp_path / "seq", tok, spec, target.end_of_turn_id(folder, tok), MERGE)


def test_3_prefilled_template_only_the_closing_tag_is_generated(tok, folder, tmp_path):
    ps = prompts(20, 0)
    spec = derive.spec_from_params("think")
    responses, _ = run(ps, ScriptedEngine(tok, reasoning_model), tok, folder, tmp_path, spec)
    open_id, close_id = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    for r in responses:
        assert r.prompt_ids[-2] == open_id and open_id not in r.output_ids and close_id in r.output_ids
        assert r.reasoning.startswith("The user asks:")


def test_3_output_without_closing_tag_is_reasoning_flagged_unclosed(tok, folder, tmp_path):
    def sometimes_cut(prompt_text):
        text, finish = reasoning_model(prompt_text)
        return (text, "length") if "Question 3:" in prompt_text else (text, finish)

    ps = prompts(20, 0)
    responses, rep = run(
        ps,
        ScriptedEngine(tok, sometimes_cut),
        tok,
        folder,
        tmp_path,
        derive.spec_from_params("think"),
        max_new_tokens=6,
    )
    cut = [r for r in responses if r.finish_reason == "length"]
    assert len(cut) == 1 and len(cut[0].output_ids) == 6
    assert cut[0].reasoning and cut[0].content == "" and not cut[0].reasoning_closed
    assert cut[0].reasoning == cut[0].text  # reasoning holds it all
    assert rep["unclosed_reasoning"] == 1 and rep["finish_reason"] == {"stop": 19, "length": 1}


def test_3_gpt_oss_harmony_channels(tok, folder, tmp_path):
    ps = prompts(24)
    spec = derive.spec_from_params("harmony", "harmony")
    responses, rep = run(ps, ScriptedEngine(tok, harmony_model), tok, folder, tmp_path, spec, {"harmony": True})
    assert tok.decode(responses[0].prompt_ids).endswith("<|start|>assistant")
    for p, r in zip(ps, responses):
        assert r.reasoning.startswith("User asks: Question") and r.reasoning_closed
        assert "<|channel|>analysis" not in r.content
        if p.tools:
            assert r.tool_calls == [
                {"type": "function", "function": {"name": "search", "arguments": {"query": p.messages[-1]["content"]}}}
            ]
            assert r.content.endswith("<|call|>") and "to=functions.search" in r.content
        else:
            assert r.content == f"Answer: {p.messages[-1]['content']}" and r.tool_calls == []
    assert rep["with_reasoning"] == 24 and rep["tool_calls"]["parse_failures"] == 0
    # the same output read with the think preset has no reasoning: the gate would stop such a misconfigured run
    with pytest.raises(GateBreach, match="min_reasoning"):
        run(
            ps,
            ScriptedEngine(tok, harmony_model),
            tok,
            folder,
            tmp_path / "other",
            derive.spec_from_params("think"),
            {"harmony": True},
        )


@pytest.mark.e2e
def test_4_stage_on_a_non_reasoning_model_under_think_fails_its_gate(tmp_path):
    """The embedded SmolLM2 never writes think tags: under ``target.reasoning: think`` the real stage stops at its
    first check, names the gate, the rate and the records, and publishes nothing."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"].update({"model": "embedded", "reasoning": "think", "chat_template_kwargs": {}})
    params["infer"].update(
        {
            "engine": "hf",
            "batch_size": 1,
            "max_new_tokens": 8,
            "temperature": 0.0,
            "samples": 1,
            "max_failure_rate": 0.0,
            "gates": {"warmup": 2, "every": 2, "min_reasoning": 0.9, "max_truncated": 1.0, "max_empty": 1.0},
        }
    )
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    ps = [
        Prompt(content_id(m, None), "chat", m)
        for m in ([{"role": "user", "content": q}] for q in ["What is 2+2?", "Name a colour.", "Say hi."])
    ]
    write_jsonl(tmp_path / "prompts.jsonl", ps)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "stages/infer.py"),
            "--params",
            str(tmp_path / "params.yaml"),
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--out",
            str(tmp_path / "responses"),
            "--report",
            str(tmp_path / "metrics/infer.json"),
            "--timings",
            str(tmp_path / "metrics/timings.json"),
            "--cache",
            str(tmp_path / "cache"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert (
        f"gate min_reasoning breached: observed 0.000 < 0.9 after 2 records (e.g. {ps[0].id}, {ps[1].id})"
        in proc.stderr
    ), proc.stderr
    assert "Nothing was published" in proc.stderr
    assert not (tmp_path / "responses").exists() and not (tmp_path / "metrics").exists()
    [cache] = list((tmp_path / "cache").iterdir())
    kept = [json.loads(line) for line in (cache / "generations.jsonl").read_text().splitlines()]
    assert [g["id"] for g in kept] == [ps[0].id, ps[1].id]  # generated, kept for inspection, not published


# ---- 1 and 2 end to end: stages/infer.py over HTTP against tests/sglang_server.py ---------------------
# Questions the embedded model answers in at most 13 ids and a stop (greedy): every answer fits the budget left by
# the think block, so `content` holds whole answers, and the dropped run's answers end by stop (a truncated output
# under a prefilled <think> would count as reasoning cut short).
E2E_QUESTIONS = [
    "What is the capital of France?",
    "What is 2 plus 2?",
    "Name a fruit.",
    "What is the capital of Italy?",
    "What is the capital of Japan?",
    "What is the capital of Germany?",
    "What is 1 plus 1?",
    "What is 5 plus 5?",
    "What is 10 minus 3?",
    "Translate 'cat' to French.",
    "What is the capital of Canada?",
    "What is the capital of England?",
]
E2E_PROMPTS = [
    Prompt(content_id(m, None), "glaive", m) for m in ([{"role": "user", "content": q}] for q in E2E_QUESTIONS)
]
E2E_MAX_NEW, E2E_WARMUP, E2E_CONCURRENCY = 24, 4, 2
TEMPLATES = pytest.mark.parametrize("template", [{}, {"prefill_think": False}], ids=["prefilled", "model-opens-tag"])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_model_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    """tests/sglang_server.py on loopback serving the served folder (the mode is set per test)."""
    port = free_port()
    proc = start_server(port, tmp_path_factory.mktemp("server") / "server.log", "--model-path", served)
    yield f"http://127.0.0.1:{port}"
    stop_server(proc)


@pytest.fixture(scope="module")
def e2e_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("e2e-prompts") / "prompts.jsonl"
    write_jsonl(path, E2E_PROMPTS)
    return path


@pytest.fixture(scope="module")
def answers(tok, model):
    """The embedded model's own greedy answer ids (stop id last) to each plain prompt, computed here, apart from the
    server: what the served records must carry after their think block."""
    engine = HFEngine(model, tok.pad_token_id, batch_size=1)
    longest_block = max(len(think_block(tok, t)) for t in ({}, {"prefill_think": False}))
    sampling = Sampling(max_new_tokens=E2E_MAX_NEW - longest_block, stop_token_ids=(2,))
    prompts = [chat.prompt_ids(tok, p.messages, None, {"prefill_think": False}) for p in E2E_PROMPTS]
    outs = [o for _, o in sorted(engine.stream(prompts, sampling, [p.id for p in E2E_PROMPTS]))]
    assert all(o.finish_reason == "stop" for o in outs), "an answer no longer fits: pick shorter questions"
    return {p.id: o.output_ids for p, o in zip(E2E_PROMPTS, outs)}


def run_stage(folder: Path, served: Path, url: str, prompts: Path, template: dict) -> subprocess.CompletedProcess:
    """The real stage with params.yaml's gates (warm-up shortened) against the test server."""
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())
    cfg["target"].update(
        {"model": str(served), "reasoning": "think", "tool_calls": "none", "chat_template_kwargs": template}
    )
    cfg["infer"].update(
        {
            "engine": "sglang",
            "batch_size": 1,
            "max_new_tokens": E2E_MAX_NEW,
            "temperature": 0.0,
            "samples": 1,
            "max_failure_rate": 0.0,
        }
    )
    cfg["infer"]["gates"].update({"warmup": E2E_WARMUP, "every": E2E_WARMUP})
    cfg["infer"]["sglang"] = {
        "urls": [url],
        "concurrency": E2E_CONCURRENCY,
        "timeout_s": 60,
        "health_timeout_s": 60,
        "retries": 2,
        "backoff_s": 0.05,
        "backoff_max_s": 0.5,
        "launch": None,
    }
    (folder / "params.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return subprocess.run(
        [
            sys.executable,
            "stages/infer.py",
            "--params",
            str(folder / "params.yaml"),
            "--prompts",
            str(prompts),
            "--out",
            str(folder / "out"),
            "--report",
            str(folder / "metrics" / "infer.json"),
            "--timings",
            str(folder / "metrics" / "timings.json"),
            "--cache",
            str(folder / "cache"),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def think_block(tok, template: dict) -> list[int]:
    """The ids a reasoning model writes before its answer: the opening tag unless the template wrote it."""
    prefilled = template.get("prefill_think", True)
    return ids(tok, ("" if prefilled else "<think>\n") + THOUGHT + "\n</think>\n\n")


@pytest.mark.engine
@TEMPLATES
def test_1_e2e_seed_run_over_http_every_record_keeps_its_reasoning(
    tok, served, server, e2e_prompts, answers, tmp_path, template
):
    configure(server, reasoning="wrap", reset_stats=True)
    out = run_stage(tmp_path, served, server, e2e_prompts, template)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert [r["id"] for r in recs] == [p.id for p in E2E_PROMPTS]
    spec = derive.spec_from_params("think", "none")
    block = think_block(tok, template)
    open_id = tok.convert_tokens_to_ids("<think>")
    for r in recs:
        answer = answers[r["id"]]
        assert r["output_ids"] == block + answer  # token-exact: thinking, then the answer
        assert (open_id in r["output_ids"]) == ("prefill_think" in template)
        assert tok.decode(r["prompt_ids"][-2:]).endswith("<think>\n") == ("prefill_think" not in template)
        assert r["finish_reason"] == "stop" and r["output_ids"][-1] == 2
        assert r["reasoning"].strip() == THOUGHT and r["reasoning_closed"]
        assert r["content"] == "\n\n" + tok.decode(answer, skip_special_tokens=False)
        assert "</think>" not in r["content"] and r["content"].endswith("<|im_end|>")
        assert derive.mismatch(response_from_json(r), tok, spec) is None  # every field re-derives from the ids
        assert r["meta"]["engine"] == "sglang"
    report = json.loads((tmp_path / "metrics" / "infer.json").read_text())
    assert report["with_reasoning"] == len(E2E_PROMPTS) and report["unclosed_reasoning"] == 0
    assert report["gates"]["min_reasoning"] == 1.0 and report["finish_reason"] == {"stop": len(E2E_PROMPTS)}
    st = stats(server)
    assert st["answers"] == st["generate_requests"] == len(E2E_PROMPTS)  # each prompt asked once, no retries


@pytest.mark.engine
@TEMPLATES
def test_2_e2e_reasoning_dropped_over_http_fails_its_gate_within_the_warmup(
    tok, served, server, e2e_prompts, answers, tmp_path, template
):
    configure(server, reasoning="drop", reset_stats=True)
    out = run_stage(tmp_path, served, server, e2e_prompts, template)
    assert out.returncode != 0, out.stderr[-3000:]
    [cache] = list((tmp_path / "cache").iterdir())
    kept = [json.loads(line) for line in (cache / "generations.jsonl").read_text().splitlines()]
    assert len(kept) == E2E_WARMUP  # stopped at the first check, right after the warm-up
    offenders = ", ".join(k["id"] for k in kept)
    assert (
        f"gate min_reasoning breached: observed 0.000 < {GATES.min_reasoning} after {E2E_WARMUP} records "
        f"(e.g. {offenders})"
    ) in out.stderr, out.stderr[-3000:]
    assert f"Nothing was published; the records are in {cache}" in out.stderr
    assert not (tmp_path / "out" / "responses.jsonl").exists() and not (tmp_path / "metrics").exists()
    by_id = {p.id: p for p in E2E_PROMPTS}
    for k in kept:  # the generated records stay in the cache: the model's answers, without any thinking
        assert k["id"] in by_id and k["output_ids"] == answers[k["id"]] and k["finish_reason"] == "stop"
        assert not set(k["output_ids"]) & set(tok.convert_tokens_to_ids(["<think>", "</think>"]))
    # the compute spent: the server answered the warm-up and at most what was in flight when the gate tripped
    deadline = time.monotonic() + 60
    while stats(server)["inflight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    st = stats(server)
    assert not st["inflight"]
    assert E2E_WARMUP <= st["answers"] <= st["generate_requests"] <= E2E_WARMUP + E2E_CONCURRENCY, st
    assert st["generate_requests"] < len(E2E_PROMPTS)


# -------------------------------------------------------------------------------- every turn of a reasoning model
def chat_of(*users):
    """A conversation of these user turns, a dataset answer between each two."""
    messages = []
    for i, user in enumerate(users):
        messages += ([{"role": "assistant", "content": f"dataset answer {i}"}] if i else []) + [
            {"role": "user", "content": user}
        ]
    return messages


def test_every_turn_of_a_reasoning_model_under_a_template_that_drops_history_reasoning(tok, folder, tmp_path):
    """infer.turns: all with a thinking model whose template (Qwen3's way) renders an earlier answer's content only:
    each later turn's prompt holds the earlier answers without their reasoning, so merge keeps every turn a sequence
    of its own, each trained in the context it was generated in. A turn that calls a tool, or is aborted, ends its
    conversation there (nothing in the dataset answers the target's own call), counted."""

    def script(text):
        question = question_of(text)
        if question.startswith("abort"):
            return "cut off", "abort"
        return reasoning_model(text)

    ps = [
        Prompt(content_id(m, t), "chat", m, t)
        for m, t in [
            (chat_of("What is 2 + 2?", "And 3 + 3?", "And 4 + 4?"), None),
            (chat_of("Look up the capital of Peru.", "And of Chile?"), TOOLS),
            (chat_of("abort this one", "never asked"), None),
        ]
    ]
    spec = derive.spec_from_params("think", "hermes")
    sampling = Sampling(max_new_tokens=256, stop_token_ids=tuple(target.stop_ids(folder, tok)))
    gates = Gates(config.Gates(warmup=100, every=100, max_truncated=1.0, max_empty=1.0), True, derive.markup(tok))
    responses, report = InferRun(
        ScriptedEngine(tok, script), tok, sampling, spec, gates, Cache(tmp_path / "cache"), Plan({}, turns="all")
    ).run(ps)
    assert [r.id for r in responses] == [
        f"{ps[0].id}@1",
        f"{ps[0].id}@2",
        f"{ps[0].id}@3",
        f"{ps[1].id}@1",
        f"{ps[2].id}@1",
    ]
    assert report["turns"] == {"mode": "all", "answered": {1: 3, 2: 1, 3: 1}, "unanswered": 2, "ended_at_tool_call": 1}
    first, second = responses[0], responses[1]
    assert first.reasoning and first.content.strip() == "Here is my answer to: What is 2 + 2?<|im_end|>"
    history = tok.decode(second.prompt_ids, skip_special_tokens=False)
    assert "Here is my answer to: What is 2 + 2?" in history and first.reasoning not in history  # dropped
    assert "dataset answer" not in history
    write_jsonl(tmp_path / "responses.jsonl", [r for r in responses if r.finish_reason != "abort"])
    stats = merge.run(
        tmp_path / "responses.jsonl", tmp_path / "seq", tok, spec, target.end_of_turn_id(folder, tok), MERGE
    )
    assert stats["turns"] == {"joined": 0, "apart": 2}
    assert stats["train"]["samples"] + stats["valid"]["samples"] == 4
