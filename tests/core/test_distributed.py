"""The runtime (eaglepipe/core/runtime.py) and the hidden stage under torchrun: device and dtype choices, seeding, the
launcher; on CPU with gloo, hidden at world 2 publishes the same bytes as at world 1 (left-out sequences of both
ranks included), and a rank killed with SIGKILL loses only what it had not finished: a rerun reuses every finished
shard and publishes the same bytes again; two torchrun agents ("nodes") meeting by rendezvous publish them too."""

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from e2e import ranks_of, untrained_drafter

from eaglepipe.core import config, runtime
from eaglepipe.core.errors import UserError
from eaglepipe.dataset import sequences, shards
from eaglepipe.drafter import train
from eaglepipe.hidden import hf_source, store
from eaglepipe.target import model as target

ROOT = Path(__file__).resolve().parents[2]


def test_device_and_compute_dtype_choices():
    assert runtime.device("cpu") == torch.device("cpu")
    assert runtime.device("auto") == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    assert runtime.compute_dtype("auto", torch.device("cpu")) == "float32"
    assert runtime.compute_dtype("auto", torch.device("cuda:1")) == "bfloat16"
    assert runtime.compute_dtype("float16", torch.device("cpu")) == "float16"
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="runtime.device = 'cuda:1', but torch sees no CUDA device"):
            runtime.device("cuda:1")


def test_native_bf16_is_what_the_cpu_says_and_the_hidden_and_train_autos_follow_it():
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else None
    if flags is not None:
        assert runtime.native_bf16(torch.device("cpu")) == bool({"avx512_bf16", "amx_bf16"} & flags)
    cpu = torch.device("cpu")
    assert runtime.states_dtype("auto", cpu) == ("bfloat16" if runtime.native_bf16(cpu) else "float32")
    assert runtime.states_dtype("float32", cpu) == "float32"
    expected = "bfloat16" if runtime.native_bf16(cpu) else "none"
    assert train.resolved(config.Train(autocast="auto"), cpu).autocast == expected
    for chosen in ("bfloat16", "none"):
        assert train.resolved(config.Train(autocast=chosen), cpu).autocast == chosen
    with pytest.raises(ValueError, match="resolved"):
        train.uses_bf16(config.Train(autocast="auto"))


def test_device_is_a_speed_knob_and_compute_dtype_a_result_knob():
    assert "device" not in config.Runtime.tracked_keys() and "compute_dtype" in config.Hidden.tracked_keys()
    assert "dtype" in config.Infer.tracked_keys()  # the hf engine's: it decides the answers
    with pytest.raises(config.ConfigError, match=r"runtime.device: should be auto, cpu, cuda or cuda:N, got 'gpu'"):
        config.parse(
            {
                "prepare": {"sources": [{"name": "a", "path": "a.jsonl", "format": "openai", "n": 1}]},
                "runtime": {"device": "gpu"},
            }
        )


def test_one_process_is_rank_0_of_1_without_a_process_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with runtime.start("cpu") as rt:
        assert (rt.rank, rt.world, rt.is_main, rt.device) == (0, 1, True, torch.device("cpu"))
        assert rt.gather({"a": 1}) == [{"a": 1}] and not torch.distributed.is_initialized()
        rt.barrier()


def test_one_run_at_a_time_holds_a_work_folder(tmp_path):
    """infer's cache, hidden's store and train's checkpoints are each held by one run: a second run on the same
    folder waits for the first to end, then goes on."""
    import threading

    events = []

    def second():
        with runtime.Runtime().locked(tmp_path / "work"):
            events.append("second holds it")

    with runtime.Runtime().locked(tmp_path / "work"):
        waiting = threading.Thread(target=second)
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and not events  # still waiting
        events.append("first ends")
    waiting.join(timeout=10)
    assert events == ["first ends", "second holds it"]


def test_rng_state_restores_cpu_draws():
    runtime.seed(3)
    state = runtime.rng_state()
    first = torch.rand(4)
    runtime.set_rng_state(state)
    assert torch.equal(torch.rand(4), first)
    if not torch.cuda.is_available():  # a checkpoint from 8 GPUs resumed where fewer (here none) are seen
        runtime.set_rng_state({**state, "cuda": [torch.zeros(16, dtype=torch.uint8)] * 8})
        assert torch.equal(torch.rand(4), first)
    runtime.seed(4)
    assert not torch.equal(torch.rand(4), first)


def test_the_launcher_refuses_a_bad_process_count(monkeypatch):
    monkeypatch.setenv("EAGLEPIPE_NPROC", "two")
    with pytest.raises(SystemExit, match="EAGLEPIPE_NPROC = 'two': should be a number of processes per node"):
        runtime.launch(["stages/hidden.py"])


def test_the_target_loads_onto_its_device_or_spread_by_a_device_map(target_folder, model):
    """target.load_target puts the target straight on the device, frozen; accelerate's device_map (auto, or module
    by module) loads the same model, whose states are the plain load's. Only one CPU here: the map cannot spread the
    layers over devices, so this proves the loading path and the states, not a split across GPUs."""
    ids, layers = torch.tensor([[1, 504, 3821, 30, 12, 7]]), [2, 15, 27]
    want = hf_source.forward_states(model, ids, layers)
    by_module = {
        "model.embed_tokens": "cpu",
        "model.layers": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    for device_map in (None, "auto", by_module):
        loaded = target.load_target(target_folder, "float32", runtime.Runtime(), device_map)
        assert loaded.device == torch.device("cpu") and not any(p.requires_grad for p in loaded.parameters())
        for got, expected in zip(hf_source.forward_states(loaded, ids, layers), want):
            assert torch.equal(got, expected), device_map
        del loaded
    with pytest.raises(UserError, match="this job runs 2 processes"):
        target.load_target(target_folder, "float32", runtime.Runtime(world=2), "auto")


# ------------------------------------------------------------------------------- the hidden stage, 1 and 2 processes
SHARD_TOKENS = 150  # about 25 shards of 150 tokens: several per rank, each long enough to be killed in the middle


def make_project(folder: Path) -> Path:
    """Random sequences (ids of the embedded target's vocabulary) with two poison ones (an id past the vocabulary)
    in shards 0 and 3, which two ranks compute, and a params file for them."""
    rng = np.random.default_rng(0)
    items = []
    for i in range(40):
        length = int(rng.integers(40, 150))
        prompt = int(rng.integers(5, length - 5))
        items.append(
            (f"s{i}", "s", [1] + rng.integers(3, 40000, length - 1).tolist(), [0] * prompt + [1] * (length - prompt))
        )
    train = items[:-4]
    for at in (1, 5):
        train.insert(at, (f"poison{at}", "s", [1, 2, 10**6 + at, 4, 5], [0, 0, 1, 1, 1]))  # two contents
    sequences.write(folder / "seq", {"train": train, "valid": items[-4:]}, shard_tokens=10_000, policy={})
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["hidden"] = {
        "layers": "auto",
        "dtype": "bfloat16",
        "batch_tokens": 256,
        "shard_tokens": SHARD_TOKENS,
        "max_failure_rate": 0.1,
    }
    params["runtime"] = {"device": "cpu"}
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    return folder


def hidden_cmd(project: Path, name: str, world: int) -> list[str]:
    """The stage as dvc.yaml runs it: through eaglepipe.core.runtime (torchrun for a world above 1), or plain python."""
    launcher = [sys.executable, "-m", "eaglepipe.core.runtime"] if world > 1 else [sys.executable]
    return [
        *launcher,
        "stages/hidden.py",
        "--params",
        str(project / "params.yaml"),
        "--sequences",
        str(project / "seq"),
        "--out",
        str(project / name),
        "--report",
        str(project / f"{name}.json"),
        "--timings",
        str(project / f"{name}-timings.json"),
        "--cache",
        str(project / f"{name}-cache"),
    ]


def env(world: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", EAGLEPIPE_NPROC=str(world))


def run_hidden(project: Path, name: str, world: int) -> subprocess.CompletedProcess:
    out = subprocess.run(
        hidden_cmd(project, name, world), cwd=ROOT, env=env(world), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def published(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The stage in one process (plain python): the bytes every other run must publish."""
    project = make_project(tmp_path_factory.mktemp("distributed"))
    run_hidden(project, "world1", 1)
    files = published(project / "world1")
    assert len([f for f in files if f.endswith(".safetensors")]) >= 10
    failed = [json.loads(line) for line in files["failures.jsonl"].splitlines()]
    order = shards.files(project / "world1")  # the shards in the plan's order, which the ranks share round-robin
    assert [(f["id"], order.index(f["shard"])) for f in failed] == [("poison1", 0), ("poison5", 3)]
    return project, files


@pytest.mark.e2e
def test_e2e_hidden_at_world_2_equals_world_1_byte_for_byte(reference):
    project, files = reference
    out = run_hidden(project, "world2", 2)
    assert "rank 0 of 2" in out.stderr and "rank 1 of 2" in out.stderr  # both ranks computed shards
    # shards 0 and 3 went to ranks 0 and 1: failures.jsonl (compared below) holds both ranks' left-out sequences
    assert published(project / "world2") == files
    assert (project / "world2.json").read_bytes() == (project / "world1.json").read_bytes()
    timings = [json.loads((project / f"world{w}-timings.json").read_text()) for w in (1, 2)]
    assert [t["world"] for t in timings] == [1, 2] and timings[0]["computed_shards"] == timings[1]["computed_shards"]
    # a store another run holds: a job of 2 processes stops, saying so, instead of timing out while rank 0 waits
    (store,) = (project / "world2-cache").iterdir()
    with open(store / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = subprocess.run(
            hidden_cmd(project, "world2", 2), cwd=ROOT, env=env(2), capture_output=True, text=True, timeout=600
        )
    assert held.returncode != 0 and "another run holds" in held.stderr, held.stderr[-3000:]
    assert published(project / "world2") == files


@pytest.mark.e2e
def test_e2e_two_nodes_by_rendezvous_equal_world_1(reference):
    """The README's command for several nodes, on one machine: two torchrun agents of one process each (two "nodes")
    meet through c10d rendezvous, run as ``PET_*`` variables tell them, and publish the same bytes."""
    project, files = reference
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node_env = dict(
        env(1), PET_NNODES="2", PET_RDZV_BACKEND="c10d", PET_RDZV_ENDPOINT=f"127.0.0.1:{port}", PET_RDZV_ID="test"
    )
    nodes = [
        subprocess.Popen(
            hidden_cmd(project, "nodes", 2),
            cwd=ROOT,
            env=node_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for node in nodes:
        _, stderr = node.communicate(timeout=600)
        assert node.returncode == 0, stderr[-3000:]
    assert published(project / "nodes") == files
    assert json.loads((project / "nodes-timings.json").read_text())["world"] == 2


@pytest.mark.e2e
def test_e2e_a_rank_killed_mid_run_loses_only_its_unfinished_shard(reference):
    project, files = reference
    cache = project / "killed-cache"
    agent = subprocess.Popen(
        hidden_cmd(project, "killed", 2),
        cwd=ROOT,
        env=env(2),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    plan = json.loads(next((project / "world1-cache").glob("*/plans/*.json")).read_text())  # the same plan
    first_of_rank_1 = store.shard_name(plan[1])  # shards go round-robin
    while not list(cache.glob(f"*/{first_of_rank_1}")):
        assert agent.poll() is None and time.monotonic() < deadline, agent.stderr.read()[-3000:]
        time.sleep(0.02)
    os.kill(ranks_of(agent.pid)[1], signal.SIGKILL)
    _, stderr = agent.communicate(timeout=120)
    assert agent.returncode != 0 and not (project / "killed").exists(), stderr[-3000:]  # torchrun ended the job
    (work,) = cache.iterdir()
    kept = {p.name: p.stat().st_mtime_ns for p in work.glob("*.safetensors")}
    total = len([f for f in files if f.endswith(".safetensors")])
    assert 1 <= len(kept) < total, "killed in the middle of the run"

    run_hidden(project, "killed", 2)
    assert published(project / "killed") == files

    # online training: at world 2, rank 0 alone publishes the index that says hidden extracted nothing
    online = yaml.safe_load((project / "params.yaml").read_text())
    online["train"] = {**online["train"], "features": "online"}
    (project / "online.yaml").write_text(yaml.safe_dump(online))
    args = hidden_cmd(project, "online", 2)
    args[args.index("--params") + 1] = str(project / "online.yaml")
    out = subprocess.run(args, cwd=ROOT, env=env(2), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [p.name for p in (project / "online").iterdir()] == ["index.json"]
    assert "skipped" in json.loads((project / "online.json").read_text())
    timings = json.loads((project / "killed-timings.json").read_text())
    retried = any(store.content(work / name)["failed"] for name in kept)  # the poison ones, in a shard of their own
    assert timings["reused_shards"] == len(kept) and timings["computed_shards"] == total - len(kept) + retried
    for name, mtime in kept.items():  # reused as they were, not rewritten
        assert (project / "killed" / name).stat().st_mtime_ns == mtime


# ---------------------------------------------------------------------------------------- evaluate, 1 and 2 processes
def evaluate_outputs(tmp_path, world: int) -> dict:
    """stages/evaluate.py at ``world`` processes on tmp_path's params and drafter: its report, plot rows and decoded
    files, as bytes by name."""
    out = {name: tmp_path / f"{name}{world}" for name in ("report", "positions", "decoded", "timings")}
    launcher = [sys.executable, "-m", "eaglepipe.core.runtime"] if world > 1 else [sys.executable]
    ran = subprocess.run(
        [
            *launcher,
            "stages/evaluate.py",
            "--params",
            str(tmp_path / "params.yaml"),
            "--prompts",
            "data/eval/heldout.jsonl",
            "--draft",
            str(tmp_path / "draft"),
            *[a for name, path in out.items() for a in (f"--{name}", str(path))],
        ],
        cwd=ROOT,
        env=env(world),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(out["timings"].read_text())["processes"] == world
    return {
        "report": out["report"].read_bytes(),
        "positions": out["positions"].read_bytes(),
        **{path.name: path.read_bytes() for path in out["decoded"].iterdir()},
    }


@pytest.mark.e2e
def test_e2e_evaluate_at_world_2_reports_what_world_1_does(tmp_path, target_folder):
    """Ranks share the conversations (MT-bench's two turns decoded on one rank); the metrics, plot rows and decoded
    files (everything but the speeds) are the same bytes at world 2 as at world 1, with an untrained drafter started
    from the target (a few drafts accepted)."""
    from eaglepipe.drafter.eagle3 import model as draft

    draft.save(untrained_drafter(target_folder, [2, 15, 27]), tmp_path / "draft")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["evaluate"] = {
        "max_new_tokens": 12,
        "threads": 1,
        "benchmarks": {"heldout": {"n": 3}, "mtbench": {"n": 2}, "humaneval": {"n": 1}},
    }
    params["runtime"] = {"device": "cpu"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    outputs = {world: evaluate_outputs(tmp_path, world) for world in (1, 2)}
    assert outputs[2] == outputs[1]
    report = json.loads(outputs[1]["report"])
    assert {name: (b["prompts"], b["turns"]) for name, b in report["benchmarks"].items()} == {
        "heldout": (3, 3),
        "mtbench": (2, 4),
        "humaneval": (1, 1),
    }
    assert report["lossless"] and report["benchmarks"]["heldout"]["acceptance_length"] > 1
    assert sorted(outputs[1]) == ["heldout.jsonl", "humaneval.jsonl", "mtbench.jsonl", "positions", "report"]
