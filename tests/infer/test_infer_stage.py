"""The infer stage as a subprocess: resumable after Ctrl-C or kill -9 with every record once, and the limits checked
before generating."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from helpers import ROOT
from infer_helpers import GATES, QUESTIONS, prompts, same_but_figures

from eaglepipe.core.records import Prompt, content_id, read_jsonl, response_from_json, write_jsonl


def write_params(tmp_path, **infer_overrides):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["infer"].update(
        {"engine": "hf", "batch_size": 1, "max_new_tokens": 24, "samples": 1, "temperature": 0.0, **infer_overrides}
    )
    params["infer"]["gates"].update(GATES)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def stage(tmp_path, params, name="out"):
    return [
        sys.executable,
        str(ROOT / "stages/infer.py"),
        "--params",
        str(params),
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--out",
        str(tmp_path / name),
        "--report",
        str(tmp_path / "report.json"),
        "--timings",
        str(tmp_path / "timings.json"),
        "--cache",
        str(tmp_path / f"cache-{name}"),
    ]


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_run_resumes_with_every_record_once(tmp_path, sig):
    """Under sampling, a run interrupted and resumed publishes the very bytes an uninterrupted run publishes, but for
    the last decimals of the engine's log-probabilities (the resumed answers run in other batches)."""
    ps = prompts(QUESTIONS)
    write_jsonl(tmp_path / "prompts.jsonl", ps)
    params = write_params(tmp_path, batch_size=4, samples=2, temperature=0.8)
    cmd = stage(tmp_path, params)
    # A shell running the tests in the background leaves SIGINT ignored in its children; a user's Ctrl-C is not.
    restore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=restore_sigint)
    deadline = time.time() + 120
    cache_file = None
    while time.time() < deadline and proc.poll() is None:  # wait until some, not all, records are in the cache
        files = list((tmp_path / "cache-out").glob("*/generations.jsonl"))
        if files and 2 <= len(files[0].read_text().splitlines()) <= len(ps):  # at most half of the 2 x 8 answers
            cache_file = files[0]
            break
        time.sleep(0.05)
    assert cache_file is not None, "the stage never reached the middle of its run"
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not (tmp_path / "out" / "responses.jsonl").exists()
    done_before = len({json.loads(line)["id"] for line in cache_file.read_text().splitlines() if line.endswith("}")})

    subprocess.run(cmd, check=True, capture_output=True)
    records = [response_from_json(obj) for _, obj in read_jsonl(tmp_path / "out" / "responses.jsonl")]
    assert sorted(r.id for r in records) == sorted(i for p in ps for i in (p.id, f"{p.id}.1"))
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert timings["generated"] == 2 * len(ps) - done_before
    subprocess.run(stage(tmp_path, params, "uninterrupted"), check=True, capture_output=True)
    published, uninterrupted = (
        [obj for _, obj in read_jsonl(tmp_path / run / "responses.jsonl")] for run in ("out", "uninterrupted")
    )
    same_but_figures(published, uninterrupted)  # the engine's log-probabilities in other batches: to within 1e-4


@pytest.mark.e2e
def test_the_stage_checks_the_limits_before_generating(tmp_path):
    """The real stage on a prompt too long for merge.max_length: one line naming it under fail; left out and counted
    under skip, the other prompts generated."""
    long_prompt = [{"role": "user", "content": "Summarise: " + "the cat sat on the mat. " * 40}]
    ps = [*prompts(QUESTIONS[:2]), Prompt(content_id(long_prompt, None), "wordy", long_prompt)]
    write_jsonl(tmp_path / "prompts.jsonl", ps)
    for on_error in ("fail", "skip"):
        params = yaml.safe_load(write_params(tmp_path, max_new_tokens=4, on_error=on_error).read_text())
        params["merge"]["max_length"] = 64
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        out = subprocess.run(stage(tmp_path, tmp_path / "params.yaml", on_error), capture_output=True, text=True)
        if on_error == "fail":
            assert out.returncode == 1, out.stderr
            assert (
                out.stderr.strip()
                .splitlines()[-1]
                .startswith(f"Error: {tmp_path / 'prompts.jsonl'}:3: prompt {ps[2].id} of source wordy: ")
            ), out.stderr
            assert "leave no room for an answer within merge.max_length 64" in out.stderr
            assert not list((tmp_path / "cache-fail").glob("*/generations.jsonl"))  # nothing generated
        else:
            assert out.returncode == 0, out.stderr
            report = json.loads((tmp_path / "report.json").read_text())
            assert report["left_out"] == {"no_room_in_max_length": 1} and report["completions"] == 2
            assert report["left_out_ids"] == {"no_room_in_max_length": [ps[2].id]}
