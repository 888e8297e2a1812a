"""The answers' engine against the states' model (issue 51), end to end through the stages. The in-process engine
computes the target itself: hidden passes and reports the agreement. An engine that computes another model: the SGLang
test double serves a copy of the embedded target with its final norm scaled by 1.5 (tests/doctored.py: greedy answers
keep their ids, only the log-probabilities differ) while the params name the embedded target. infer's pre-flight
refuses it before generating; with the pre-flight off, infer publishes the answers, merge builds the sequences, and
hidden stops in its first sequences naming the records and the engine, publishing nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from doctored import doctored_copy
from e2e import ENV, PROMPTS, ROOT, run_infer
from sglang_server import free_port, start_server, stop_server

from eaglepipe.core.records import write_jsonl

TIMEOUT = 300


def write_params(folder: Path, url: str | None, preflight: str) -> Path:
    """infer through the SGLang server at ``url`` (the hf engine without one), greedy; hidden in float32."""
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())
    infer = cfg["infer"]
    engine = "sglang" if url else "hf"
    infer.update(engine=engine, max_new_tokens=16, temperature=0.0, samples=1, max_failure_rate=0.0)
    infer["gates"].update(warmup=4, every=4, max_truncated=1.0, max_empty=1.0)
    if url:
        infer["sglang"] = {"urls": [url], "concurrency": 2}
    infer["preflight"] = {"mode": preflight}
    cfg["hidden"].update(compute_dtype="float32")
    path = folder / f"params-{preflight}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def merged(tmp_path: Path, params: Path, answered: Path) -> Path:
    """merge over what infer published in ``answered``: the sequences' folder."""
    folder = tmp_path / "sequences"
    responses = answered / "out" / "responses.jsonl"
    out = stage("merge", params, "--responses", responses, "--out", folder, "--report", tmp_path / "merge.json")
    assert out.returncode == 0, out.stderr[-3000:]
    return folder


def hidden_stage(tmp_path: Path, params: Path, sequences: Path) -> subprocess.CompletedProcess:
    """hidden over ``sequences``, into tmp_path's hidden/ and hidden.json."""
    args = ("--sequences", sequences, "--out", tmp_path / "hidden", "--report", tmp_path / "hidden.json")
    return stage("hidden", params, *args, "--cache", tmp_path / "hidden-cache")


def stage(name: str, params: Path, *args) -> subprocess.CompletedProcess:
    timings = params.parent / f"{name}-timings.json"
    command = [sys.executable, f"stages/{name}.py", "--params", params, "--timings", timings, *args]
    return subprocess.run(list(map(str, command)), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def doctored_server(tmp_path_factory, target_folder):
    folder = tmp_path_factory.mktemp("doctored")
    port = free_port()
    proc = start_server(port, folder / "server.log", "--model-path", doctored_copy(target_folder, folder, "norm"))
    yield f"http://127.0.0.1:{port}"
    stop_server(proc)


@pytest.mark.engine  # the real stages against a real server process
def test_a_doctored_engine_is_stopped_by_the_preflight_and_without_it_by_hidden(doctored_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, PROMPTS)

    refused = tmp_path / "refused"
    out = run_infer(refused, write_params(tmp_path, doctored_server, "auto"), prompts, TIMEOUT)
    assert out.returncode != 0
    assert "infer.preflight: the sglang engine does not compute the target" in out.stderr, out.stderr[-3000:]
    assert not (refused / "out" / "responses.jsonl").exists()

    params = write_params(tmp_path, doctored_server, "off")
    answered = tmp_path / "answered"
    out = run_infer(answered, params, prompts, TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((answered / "report.json").read_text())["logprobs"]["records_without"] == 0

    out = hidden_stage(tmp_path, params, merged(tmp_path, params, answered))
    assert out.returncode != 0
    message = out.stderr
    assert "sglang" in message and any(p.id in message for p in PROMPTS), message[-3000:]
    assert not (tmp_path / "hidden").exists() and not (tmp_path / "hidden.json").exists()  # nothing published


@pytest.mark.e2e
def test_the_in_process_engines_answers_pass_with_their_agreement_reported(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, PROMPTS)
    params = write_params(tmp_path, None, "auto")
    answered = tmp_path / "answered"
    out = run_infer(answered, params, prompts, TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((answered / "timings.json").read_text())["preflight"]["verdict"] == "passed"
    out = hidden_stage(tmp_path, params, merged(tmp_path, params, answered))
    assert out.returncode == 0, out.stderr[-3000:]
    agreement = json.loads((tmp_path / "hidden.json").read_text())["agreement"]
    assert agreement["verdict"] == "pass" and agreement["engines"] == ["hf"], agreement
    assert agreement["engine_dtype"] == agreement["target_dtype"] == "float32"
    assert agreement["sequences_with_engine_figures"] == len(PROMPTS)
    assert agreement["logprobs"]["max_sequence_mean_abs_diff"] < 1e-4 and agreement["greedy"]["agreement"] == 1.0
