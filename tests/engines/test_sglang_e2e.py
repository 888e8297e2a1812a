"""End to end: stages/infer.py with infer.engine: sglang against tests/sglang_server.py over loopback.

The compute server generates with the embedded model through HFEngine (batch size 1, one request at a time), so a
clean greedy run must give the records of the embedded engine run with batch_size 1, field for field (meta aside).
Faults, kill -9 of the stage and a restart of the server must all end with every record present exactly once."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from e2e import (
    ENV,
    PROMPTS,
    ROOT,
    assert_same_records,
    cache_lines,
    infer_cmd,
    kill_9_then_resume,
    port_closed,
    records,
    run_infer,
    server_restart_mid_run,
)
from sglang_server import CLEAN, VERSION, configure, distribution, free_port, start_server, stats, stop_server

from eaglepipe.core.records import Prompt, content_id, write_jsonl
from eaglepipe.text.derive import PER_RUN

pytestmark = pytest.mark.engine  # the real stage against a real server process

STAGE_TIMEOUT = 300


def write_params(folder: Path, engine: str = "sglang", **sglang) -> Path:
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())
    infer = cfg["infer"]
    infer.update(engine=engine, batch_size=1, max_new_tokens=16, temperature=0.0, samples=1, max_failure_rate=0.0)
    infer["gates"].update(warmup=4, every=4, max_truncated=1.0, max_empty=1.0)
    infer["sglang"] = {
        "urls": [],
        "concurrency": 2,
        "timeout_s": 30,
        "health_timeout_s": 60,
        "retries": 5,
        "backoff_s": 0.05,
        "backoff_max_s": 0.5,
        "launch": None,
        **sglang,
    }
    path = folder / f"params-{engine}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_stage(folder: Path, params: Path, prompts: Path):
    return run_infer(folder, params, prompts, STAGE_TIMEOUT)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("e2e")
    write_jsonl(folder / "prompts.jsonl", PROMPTS)
    return folder


@pytest.fixture(scope="module")
def compute_server(work):
    port = free_port()
    proc = start_server(port, work / "compute-server.log")
    yield f"http://127.0.0.1:{port}"
    stop_server(proc)


@pytest.fixture(scope="module")
def fast_server(work):
    port = free_port()
    proc = start_server(port, work / "fast-server.log", "--no-compute")
    yield f"http://127.0.0.1:{port}"
    stop_server(proc)


@pytest.fixture(scope="module")
def reference(work):
    """The embedded engine's records (batch_size 1) for PROMPTS."""
    folder = work / "reference"
    folder.mkdir()
    out = run_stage(folder, write_params(folder, "hf"), work / "prompts.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    return records(folder)


@pytest.fixture(scope="module")
def clean_run(work, compute_server):
    """The folder of a run of the stage against the compute server without faults."""
    folder = work / "clean"
    folder.mkdir()
    configure(compute_server, **CLEAN)
    out = run_stage(folder, write_params(folder, urls=[compute_server]), work / "prompts.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    return folder


def test_a_clean_run_gives_the_embedded_engines_records(clean_run, compute_server, reference):
    got = records(clean_run)
    assert_same_records(got, reference, "sglang")
    assert {r["finish_reason"] for r in got} == {"stop", "length"}  # both kinds of ending are covered
    assert all(r["output_ids"][-1] == 2 for r in got if r["finish_reason"] == "stop")  # <|im_end|> kept
    engine = json.loads((clean_run / "out" / "engine.json").read_text())
    assert "servers" not in engine  # what a run met is in its timings, so a rerun publishes the same bytes
    server = json.loads((clean_run / "timings.json").read_text())["servers"][0]
    assert engine["engine"] == "sglang" and server["url"] == compute_server
    assert server["model_info"]["model_path"] == engine["identity"]["model_path"]
    assert server["server_info"]["tp_size"] == 1 and "internal_states" not in server["server_info"]
    report = json.loads((clean_run / "report.json").read_text())
    assert report["completions"] == len(PROMPTS) and report["failures"] == 0


def test_faulty_answers_never_reach_the_records(work, compute_server, reference, clean_run, tmp_path):
    """Retried answers publish the bytes of a run without faults: the attempts stay in infer's cache."""
    configure(
        compute_server,
        **{
            **CLEAN,
            "fault_rate": 0.3,
            "fault_mode": "cycle",
            "faults": "prefix,count,abort,finish,malformed,reset,truncated,http500,http503",
        },
    )
    out = run_stage(tmp_path, write_params(tmp_path, urls=[compute_server]), work / "prompts.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_records(records(tmp_path), reference, "sglang")
    assert sum(stats(compute_server)["faults"].values()) >= 2
    assert max(c["meta"]["attempts"] for c in cache_lines(tmp_path)) >= 2
    assert (tmp_path / "out" / "responses.jsonl").read_bytes() == (clean_run / "out" / "responses.jsonl").read_bytes()


def test_ten_percent_faults_still_complete_every_prompt(fast_server, tmp_path):
    questions = [[{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}] for i in range(200)]
    prompts = [Prompt(content_id(messages, None), "t", messages) for messages in questions]
    write_jsonl(tmp_path / "prompts.jsonl", prompts)
    configure(fast_server, **{**CLEAN, "fault_rate": 0.1, "fault_mode": "cycle", "faults": "all", "hang_s": 4})
    params = write_params(tmp_path, urls=[fast_server], concurrency=16, timeout_s=2, retries=6)
    out = run_stage(tmp_path, params, tmp_path / "prompts.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    got = records(tmp_path)
    assert [r["id"] for r in got] == [p.id for p in prompts]
    assert len(cache_lines(tmp_path)) == 200 and not list((tmp_path / "cache").glob("*/failures.jsonl"))
    faults = stats(fast_server)["faults"]
    assert sum(faults.values()) >= 20 and len(faults) == 11, faults  # every kind of fault, twice or more
    assert max(c["meta"]["attempts"] for c in cache_lines(tmp_path)) >= 2
    assert not any(set(r["meta"]) & set(PER_RUN) for r in got)


def test_kill_9_mid_run_then_resume_keeps_every_record_once(work, compute_server, reference, tmp_path):
    configure(compute_server, **{**CLEAN, "latency": 0.3})
    params = write_params(tmp_path, urls=[compute_server])
    kill_9_then_resume(tmp_path, params, work / "prompts.jsonl", reference, "sglang", 180)


def test_a_server_restart_mid_run_loses_nothing(work, reference, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers = [start_server(port, tmp_path / "server-1.log")]
    configure(url, **{**CLEAN, "latency": 0.3})
    params = write_params(tmp_path, urls=[url], health_timeout_s=180, retries=6, backoff_s=0.2, backoff_max_s=2)

    def restart():
        servers[0].kill()  # the server dies with requests in flight ...
        servers[0].wait(timeout=30)
        time.sleep(1.0)  # ... connections are refused for a while ...
        servers.append(start_server(port, tmp_path / "server-2.log", "--startup-delay", 2))  # ... 503 while starting

    try:
        server_restart_mid_run(tmp_path, params, work / "prompts.jsonl", reference, "sglang", restart, 180)
    finally:
        for s in servers:
            stop_server(s)


def test_failures_over_the_limit_fail_the_stage_and_keep_the_rest(fast_server, work, tmp_path):
    configure(fast_server, **{**CLEAN, "fail_rids": [PROMPTS[2].id]})
    params = write_params(tmp_path, urls=[fast_server], retries=2)
    out = run_stage(tmp_path, params, work / "prompts.jsonl")
    assert out.returncode != 0 and "max_failure_rate" in out.stderr
    failures = [
        json.loads(line)
        for path in (tmp_path / "cache").glob("*/failures.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert [f["id"] for f in failures] == [PROMPTS[2].id] and "http500" in failures[0]["reason"]
    assert sorted(c["id"] for c in cache_lines(tmp_path)) == sorted(p.id for i, p in enumerate(PROMPTS) if i != 2)
    configure(fast_server, **CLEAN)  # the fault is gone: a rerun generates only the failed prompt
    out = run_stage(tmp_path, params, work / "prompts.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "timings.json").read_text())["generated"] == 1
    assert len(records(tmp_path)) == len(PROMPTS)


@pytest.mark.parametrize("ok", [True, False])
def test_a_launched_server_is_stopped_at_the_end_and_on_failure(work, tmp_path, ok):
    port = free_port()
    launch = {
        "model_path": "embedded",
        "tp": 1,
        "dp": 1,
        "port": port,
        "log": str(tmp_path / "launched.log"),
        "command": [sys.executable, "tests/sglang_server.py", "--no-compute"],
        "stop_timeout_s": 10,
        "extra_args": [] if ok else ["--tokenize-skew"],
    }
    out = run_stage(tmp_path, write_params(tmp_path, launch=launch), work / "prompts.jsonl")
    assert port_closed(port), "the launched server outlived the stage"
    assert "serving" in (tmp_path / "launched.log").read_text()
    if ok:
        assert out.returncode == 0, out.stderr[-3000:]
        engine = json.loads((tmp_path / "out" / "engine.json").read_text())
        assert engine["launched"]["argv"][:2] == ["--model-path", "embedded"]
        servers = json.loads((tmp_path / "timings.json").read_text())["servers"]
        assert servers[0]["url"] == f"http://127.0.0.1:{port}"
    else:
        assert out.returncode != 0 and "tokenizer disagrees" in out.stderr


def test_a_run_whose_answers_are_all_cached_starts_no_server(work, tmp_path):
    """A launched server's identity, so the cache's key, is its launch and the SGLang installed where the launcher runs
    (here package metadata on PYTHONPATH naming the double's version): a rerun whose answers are all cached reuses them
    without starting the server, whose launch command would now fail."""
    env = {**ENV, "PYTHONPATH": str(distribution(tmp_path / "site", "sglang", VERSION))}
    launch = {
        "model_path": "embedded",
        "port": free_port(),
        "log": str(tmp_path / "launched.log"),
        "command": [sys.executable, "tests/sglang_server.py", "--no-compute"],
        "stop_timeout_s": 10,
    }
    engines, servers = [], []
    for command in (launch["command"], [sys.executable, "-c", "import sys; print('started'); sys.exit(3)"]):
        params = write_params(tmp_path, launch={**launch, "command": command})
        cmd = infer_cmd(tmp_path, params, work / "prompts.jsonl")
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=STAGE_TIMEOUT)
        assert out.returncode == 0, out.stderr[-3000:]
        engines.append(json.loads((tmp_path / "out" / "engine.json").read_text()))
        servers.append(json.loads((tmp_path / "timings.json").read_text())["servers"])
    assert json.loads((tmp_path / "timings.json").read_text())["generated"] == 0
    assert len(records(tmp_path)) == len(PROMPTS) and "started" not in (tmp_path / "launched.log").read_text()
    assert engines[0]["identity"] == engines[1]["identity"] and engines[0]["identity"]["sglang_version"] == VERSION
    assert servers[0] and servers[1] == [] and engines[0] == engines[1]
