"""What the end-to-end tests share: for the infer stage against servers (tests/engines/test_sglang_e2e.py,
tests/engines/test_vllm_engine.py, tests/evaluate/test_serve.py) running it, reading the generation cache, comparing
records, the kill -9 and server-restart checks every engine passes, waiting; for stages under torchrun
(tests/core/test_distributed.py, tests/drafter/test_train.py) finding the ranks' processes; for decoding tests
(tests/evaluate/test_evaluate.py, tests/evaluate/test_serve.py, tests/core/test_distributed.py) an untrained drafter;
for the states tests (tests/hidden/test_vllm_states.py, tests/drafter/test_streamed.py) sequences."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from eaglepipe.core.records import Prompt, content_id

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 plus 2?",
    "Say hello in Spanish.",
    "Name a planet.",
    "What do bees make?",
]
PROMPTS = [
    Prompt(content_id([{"role": "user", "content": q}], None), "t", [{"role": "user", "content": q}]) for q in QUESTIONS
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def infer_cmd(folder: Path, params: Path, prompts: Path) -> list[str]:
    """stages/infer.py writing into ``folder``: out/, report.json, timings.json and its cache in cache/."""
    return [
        sys.executable,
        "stages/infer.py",
        "--params",
        str(params),
        "--prompts",
        str(prompts),
        "--out",
        str(folder / "out"),
        "--report",
        str(folder / "report.json"),
        "--timings",
        str(folder / "timings.json"),
        "--cache",
        str(folder / "cache"),
    ]


def run_infer(folder: Path, params: Path, prompts: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        infer_cmd(folder, params, prompts), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "out" / "responses.jsonl").read_text().splitlines()]


def cache_lines(folder: Path) -> list[dict]:
    """Complete lines of the generation cache under ``folder/cache`` (a line torn by kill -9 is left out)."""
    out = []
    for path in (folder / "cache").glob("*/generations.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


FIGURES_TOLERANCE = 1e-3  # nats: one id's log-probability from other kernels, batches or runs of the same model


def assert_same_records(got: list[dict], reference: list[dict], engine: str) -> None:
    """Byte for byte in format: the same fields in the same order with the same values; only meta may differ (it
    names ``engine`` in ``got``, the embedded engine in ``reference``), and the engine's log-probabilities, within
    FIGURES_TOLERANCE of the reference's (other kernels and batches give other low bits)."""
    assert [r["id"] for r in got] == [r["id"] for r in reference]
    for g, ref in zip(got, reference):
        assert list(g) == list(ref), (list(g), list(ref))
        mine, theirs = ({k: v for k, v in r.items() if k not in ("meta", "logprobs")} for r in (g, ref))
        assert mine == theirs, g["id"]
        assert close_figures(g["logprobs"], ref["logprobs"]), (g["id"], g["logprobs"], ref["logprobs"])
        assert g["meta"]["engine"] == engine and ref["meta"]["engine"] == "hf"


def close_figures(a: list | None, b: list | None, tolerance: float = FIGURES_TOLERANCE) -> bool:
    """Whether two records' log-probabilities are both absent, or id for id both None or within ``tolerance``."""
    if a is None or b is None:
        return a is b
    if len(a) != len(b):
        return False
    return all(x is y if x is None or y is None else abs(x - y) <= tolerance for x, y in zip(a, b))


def kill_9_then_resume(
    folder: Path, params: Path, prompts: Path, reference: list[dict], engine: str, wait_s: float
) -> None:
    """kill -9 of the infer stage once two records are cached, then a rerun: it generates only the rest, every
    prompt is cached once and the records are ``reference``'s (the same prompts through the embedded engine)."""
    proc = subprocess.Popen(
        infer_cmd(folder, params, prompts), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: len(cache_lines(folder)) >= 2 or proc.poll() is not None, wait_s, "two cached records")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    done = len(cache_lines(folder))
    assert 2 <= done < len(reference), f"the run was not interrupted mid-way ({done} records cached)"
    out = run_infer(folder, params, prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((folder / "timings.json").read_text())["generated"] == len(reference) - done
    assert sorted(c["id"] for c in cache_lines(folder)) == sorted(r["id"] for r in reference)  # each once
    assert_same_records(records(folder), reference, engine)


def server_restart_mid_run(
    folder: Path, params: Path, prompts: Path, reference: list[dict], engine: str, restart, wait_s: float
) -> None:
    """The infer stage runs; once two records are cached ``restart()`` kills its server with requests in flight and
    starts another on the same port: the stage takes the server out of rotation, back when it is healthy, and ends
    with every prompt cached once and ``reference``'s records."""
    with open(folder / "stage.log", "w") as log:
        proc = subprocess.Popen(
            infer_cmd(folder, params, prompts), cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            wait_for(lambda: len(cache_lines(folder)) >= 2 or proc.poll() is not None, wait_s, "two cached records")
            assert proc.poll() is None, "the stage finished before the server was killed"
            restart()
            assert proc.wait(timeout=600) == 0, (folder / "stage.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    text = (folder / "stage.log").read_text()
    assert "out of rotation" in text and "is back" in text
    assert sorted(c["id"] for c in cache_lines(folder)) == sorted(r["id"] for r in reference)
    assert_same_records(records(folder), reference, engine)


def start_vllm(folder, port: int, log: Path, extra_args=(), env=None):
    """A launched vLLM server of ``folder`` as the engine tests run it (float32, eager), started."""
    from eaglepipe.core import config
    from eaglepipe.engines import vllm

    cfg = config.Launch(
        model_path=str(folder),
        port=port,
        log=str(log),
        stop_timeout_s=30,
        extra_args=["--dtype", "float32", "--enforce-eager", *extra_args],
    )
    server = vllm.launched(cfg, str(ROOT / vllm.python()))
    server.env.update(env or {})
    server.start()
    return server


def served(server):
    """A module fixture's body: ``server`` while the tests use it, then stopped, its port closed."""
    yield server
    server.stop()
    assert port_closed(server.port)


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def ranks_of(agent: int) -> dict[int, int]:
    """{rank: pid} of the torchrun workers that are children of the agent process ``agent``."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent:
                environ = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
                if "RANK" in environ:
                    ranks[int(environ["RANK"])] = int(proc.name)
        except (FileNotFoundError, ProcessLookupError):
            continue  # a process that ended meanwhile
    return ranks


def untrained_drafter(
    target_folder, layers: list[int], draft_vocab: int = 2048, drafter: str = "llama", **toggles: bool
):
    """A ``drafter`` (draft_config.DRAFTERS; ``toggles``: EAGLE-3.1's, or ``parallel_drafting``) started from the
    target (its midlayer the target's last layer read, ``draft_init.init_from_target``), its draft vocabulary the first
    ``draft_vocab`` ids: untrained, yet some of its drafts are accepted."""
    from collections import Counter

    import torch
    from transformers import AutoConfig

    from eaglepipe.drafter import train
    from eaglepipe.drafter.eagle3 import config as draft_config
    from eaglepipe.drafter.eagle3 import init as draft_init
    from eaglepipe.drafter.eagle3 import model as draft

    tgt = train.target_tensors(target_folder, layers[-1])
    target_config = AutoConfig.from_pretrained(target_folder)
    cfg = draft_config.DraftConfig.from_target(target_config, draft_vocab, layers, drafter, **toggles)
    torch.manual_seed(0)
    drafter = draft.Eagle3Draft(cfg, tgt["embed"])
    drafter.set_vocab(*draft.build_vocab(Counter(range(draft_vocab)), draft_vocab, cfg.vocab_size))
    draft_init.init_from_target(drafter, tgt)
    return drafter


def make_sequences(folder: Path, n: int = 12) -> list:
    """``n`` sequences of real-looking ids; every third one shares the previous one's first 40 ids (a prompt
    answered twice), so vLLM's prefix cache serves part of it; written as merge writes them into ``folder``, the
    last two the valid split."""
    import torch

    from eaglepipe.dataset import sequences

    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(n):
        length = 40 + int(torch.randint(8, 90, (1,), generator=g))
        ids = [1] + torch.randint(3, 20000, (length - 1,), generator=g).tolist()
        if i % 3 == 2:
            ids[:40] = items[-1][2][:40]
        items.append((f"s{i}", "t", ids, [0] * 30 + [1] * (length - 30)))
    sequences.write(folder, {"train": items[:-2], "valid": items[-2:]}, shard_tokens=100_000, policy="test")
    return items
