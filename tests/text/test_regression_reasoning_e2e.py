"""Regression: a reasoning model's thinking silently lost from the training data (../shared/seed), end to end.

4. the real stage, as a subprocess, on the embedded model (not a reasoning model) under ``target.reasoning: think``.
1 and 2 of test_regression_reasoning.py also run end to end over HTTP (``test_1_e2e_*``, ``test_2_e2e_*``):
stages/infer.py as a subprocess with ``infer.engine: sglang`` against tests/sglang_server.py on loopback, both loading
one model folder (the test tokenizer and the embedded weights), the server serving a reasoning model's output ids
(``--reasoning wrap``) or the same with the thinking dropped (``--reasoning drop``); with the prefilling template and
with the one that leaves ``<think>`` to the model.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import ROOT
from reasoning_fixtures import ids, served_model_folder
from sglang_server import THOUGHT, configure, free_port, start_server, stats, stop_server
from text_helpers import GATES

from eaglepipe.core.records import Prompt, content_id, response_from_json, write_jsonl
from eaglepipe.engines import Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.target import chat
from eaglepipe.text import derive


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
            # the double injects reasoning ids the target never generates (some past its embeddings): by design not
            # the target's answers, so the pre-flight would refuse them, and its requests would enter the counts
            "preflight": {"mode": "off"},
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
