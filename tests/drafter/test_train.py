"""train: the samples it loads, the loss decreases, a stage run killed after a checkpoint (``kill -9``) resumes and
ends bit-for-bit where an uninterrupted run ends, at one process or under torchrun, and the head's init and freeze."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import get_args

import pytest
import torch
import yaml
from e2e import ranks_of
from synthetic import LAYERS, V, synthetic_hidden, tiny_target

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.dataset import sequences
from eaglepipe.drafter import methods, sources, train
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.drafter.eagle3 import ttt
from eaglepipe.hidden import layout

ROOT = Path(__file__).resolve().parents[2]
PARAMS = {
    "seed": 0,
    "draft_vocab_size": 128,
    "ttt_steps": 3,
    "epochs": 2,
    "batch_tokens": 96,
    "lr": 3e-3,
    "warmup_steps": 2,
    "grad_clip": 0.5,
    "checkpoint_every": 2,
    "threads": 0,
    "positions": "generated",
    "autocast": "none",
}


def test_a_sample_with_no_position_to_train_is_left_out_and_counted(tmp_path, caplog):
    """An answer of one token gives no (state, next token, token after) triple: load_samples leaves it out and says
    how many."""
    head = tiny_target(tmp_path / "target")
    synthetic_hidden(tmp_path / "hidden", head, n_train=64, min_output=1)
    one_token = [s["id"] for s in layout.read(tmp_path / "hidden", "train") if s["loss_mask"].sum() == 1]
    with caplog.at_level(logging.INFO, logger="eaglepipe.drafter.sources"):
        loaded = sources.load_samples(tmp_path / "hidden", "train")
    assert one_token and len(loaded) == 64 - len(one_token) and not {s.id for s in loaded} & set(one_token)
    assert f"train: {len(one_token)} samples left out, no position to train" in caplog.text


def test_all_positions_train_over_the_prompt_with_the_same_vocabulary(data):
    embed = train.target_tensors(data / "target", LAYERS - 3)["embed"]
    generated = sources.load_samples(data / "hidden", "train")
    every = sources.load_samples(data / "hidden", "train", "all")
    assert [s.id for s in every] == [s.id for s in generated]
    stored = {s["id"]: s for s in layout.read(data / "hidden", "train")}
    for g, e, st in zip(generated, every, layout.read_states(every)):
        assert torch.equal(g.chain, g.mask) and torch.equal(e.mask, g.mask) and e.chain.all()
        assert torch.equal(e.ids, stored[e.id]["input_ids"]) and torch.equal(e.mask, stored[e.id]["loss_mask"].bool())
        assert all(torch.equal(st[name], stored[e.id][name]) for name in layout.STATES)  # read lazily, as stored
    steps, t2d = 3, torch.ones(V, dtype=torch.bool)
    assert (
        ttt.collate(every, layout.read_states(every), steps, embed, t2d).masks.sum()
        > ttt.collate(generated, layout.read_states(generated), steps, embed, t2d).masks.sum()
    )
    assert sources.token_counts(every) == sources.token_counts(generated)  # the draft vocabulary: generated tokens only


def stage(data, params, folder, world: int = 1, name: str = "draft") -> subprocess.Popen:
    """Start the train stage as dvc.yaml runs it (``python -m eaglepipe.core.runtime stages/train.py``: torchrun for a
    world above 1, 1 thread per process) on ``data``'s hidden states, its checkpoints in ``folder/checkpoints``."""
    raw = {
        "prepare": {"sources": [{"name": "unused", "path": "unused.jsonl", "format": "sharegpt", "n": 1}]},
        "target": {"model": str(data / "target")},
        "train": {**params.model_dump(), "betas": list(params.betas)},
        "runtime": {"device": "cpu"},
    }
    (folder / "params.yaml").write_text(yaml.safe_dump(raw))
    args = [
        sys.executable,
        "-m",
        "eaglepipe.core.runtime",
        "stages/train.py",
        "--params",
        str(folder / "params.yaml"),
        "--hidden",
        str(data / "hidden"),
        "--sequences",
        str(data / "unused"),
        "--out",
        str(folder / name),
        "--metrics",
        str(folder / f"{name}.json"),
        "--plots",
        str(folder / f"{name}-plots.json"),
        "--timings",
        str(folder / f"{name}-timings.json"),
        "--checkpoints",
        str(folder / "checkpoints"),
    ]
    env = dict(os.environ, EAGLEPIPE_NPROC=str(world))
    if world > 1:  # one thread per process; one process keeps this one's thread count (a resume must match it)
        env["OMP_NUM_THREADS"] = "1"
    with open(folder / f"{name}.log", "wb") as log:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=log)


def finished(data, params, folder, world: int = 1, name: str = "draft"):
    """Run the stage to its end: (the drafter it wrote, its plot rows)."""
    proc = stage(data, params, folder, world, name)
    assert proc.wait(timeout=600) == 0, (folder / f"{name}.log").read_text()[-3000:]
    embed = train.target_tensors(data / "target", LAYERS - 3)["embed"]
    return methods.load(folder / name, embed), json.loads((folder / f"{name}-plots.json").read_text())


def killed_after_first_checkpoint(data, params, folder, world: int = 1) -> Path:
    """Run the stage and ``kill -9`` it (at world 1) or its rank 1 (under torchrun, which then ends the job) as soon
    as its first checkpoint exists; return the checkpoint folder."""
    checkpoints, proc = folder / "checkpoints", stage(data, params, folder, world)
    deadline = time.monotonic() + 300
    while not (checkpoints / "state.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (folder / "draft.log").read_text()
        time.sleep(0.002)
    os.kill(proc.pid if world == 1 else ranks_of(proc.pid)[1], signal.SIGKILL)
    code = proc.wait(timeout=120)
    assert code == -signal.SIGKILL if world == 1 else code != 0, (
        "the run ended before the kill:\n" + (folder / "draft.log").read_text()
    )
    assert not (folder / "draft").exists()
    return checkpoints


@pytest.mark.e2e
@pytest.mark.parametrize("autocast,noise", [("none", 0.0), ("bfloat16", 0.0), ("none", 0.2)])
def test_loss_decreases_and_a_killed_run_resumes_exactly(data, tmp_path, autocast, noise):
    """With feature noise too: its draws are a function of the seed, the epoch and the sample."""
    params = config.Train(**{**PARAMS, "autocast": autocast, "feature_noise": noise})
    full = train.run(data / "hidden", data / "target", params, tmp_path / "a")
    model, report, history = full
    assert set(report["train"]) == {f"{m}_{k}" for m in ("loss", "acc") for k in range(3)}
    assert set(report["valid"]) == {f"{m}_{k}" for m in ("loss", "acc", "acc_se") for k in range(3)}
    for k in range(3):  # over the 4 valid sequences: none only where every one scored the same
        se, acc = report["valid"][f"acc_se_{k}"], report["valid"][f"acc_{k}"]
        assert 0 <= se < 0.5 and (se > 0 or acc in (0.0, 1.0)), (k, se, acc)
    # the plot rows: one per epoch, split and TTT step, exactly the steps trained
    assert [(r["epoch"], r["split"], r["step"]) for r in history] == [
        (e, s, k) for e in (1, 2) for s in ("train", "valid") for k in range(3)
    ]
    assert all(
        set(r) == {"epoch", "split", "step", "loss", "acc"} | ({"acc_se"} if r["split"] == "valid" else set())
        for r in history
    )
    row = {(r["epoch"], r["split"], r["step"]): r for r in history}
    assert row[2, "train", 0]["loss"] < row[1, "train", 0]["loss"] * 0.9
    assert row[2, "train", 0]["acc"] > row[1, "train", 0]["acc"] and row[2, "valid", 0]["loss"] is not None
    assert report["valid"] == {f"{m}_{k}": row[2, "valid", k][m] for m in ("loss", "acc", "acc_se") for k in range(3)}

    # bit for bit between stage processes, as a user reruns one: the in-process run above shares this pytest
    # process's state with the tests before it, which may leave its last bits elsewhere (seen in CI, fp32 only)
    (tmp_path / "full").mkdir()
    uninterrupted, uninterrupted_history = finished(data, params, tmp_path / "full")
    assert_close_runs(uninterrupted, model, uninterrupted_history, history)
    (tmp_path / "resumed").mkdir()
    checkpoints = killed_after_first_checkpoint(data, params, tmp_path / "resumed")
    state = torch.load(checkpoints / "state.pt", weights_only=True)  # tensors and plain data only
    assert state["epoch"] < params.epochs, "killed before the end"
    resumed, resumed_history = finished(data, params, tmp_path / "resumed")
    for (name, a), b in zip(uninterrupted.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed_history == uninterrupted_history


def test_every_method_is_registered_and_eagle3_1_trains_with_its_toggles(data, tmp_path):
    assert set(methods.METHODS) == set(get_args(config.Train.model_fields["method"].annotation))
    toggles = {"fc_norm": True, "norm_output": False}
    params = config.Train(**{**PARAMS, "epochs": 1, "method": "eagle3.1", "eagle3_1": toggles})
    model, report, _ = train.run(data / "hidden", data / "target", params, tmp_path / "checkpoints")
    assert (model.cfg.fc_norm, model.cfg.norm_output) == (True, False)
    assert all(not torch.equal(norm.weight, torch.ones_like(norm.weight)) for norm in model.fc_norm)  # trained
    draft.save(model, tmp_path / "draft")
    exported = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert exported["fc_norm"] is True and "norm_output" not in exported


def test_a_parallel_drafter_trains_its_mask_hidden_and_exports_its_mask_token(data, tmp_path):
    """train.method peagle: mask_hidden moves, config.json names the mask token (ptd_token_id) and the saved drafter
    loads with it; with the deepseek_mla layer, which vLLM cannot serve in parallel, it is refused before training."""
    params = config.Train(**{**PARAMS, "epochs": 1, "method": "peagle"})
    model = train.run(data / "hidden", data / "target", params, tmp_path / "checkpoints")[0]
    start = train.setup(data / "hidden", data / "target", params)[0]
    assert not torch.equal(model.mask_hidden, start.mask_hidden)
    draft.save(model, tmp_path / "draft")
    exported = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert exported["ptd_token_id"] == model.cfg.mask_token_id
    loaded = methods.load(tmp_path / "draft", model.embed_tokens)
    assert loaded.cfg.parallel and torch.equal(loaded.mask_hidden, model.mask_hidden)
    refused = config.Train(**{**PARAMS, "epochs": 1, "method": "peagle", "drafter": "deepseek_mla"})
    with pytest.raises(UserError, match="train.method peagle cannot be served with the deepseek_mla drafter layer"):
        train.run(data / "hidden", data / "target", refused, tmp_path / "refused")


class _Payload:
    """What a doctored state file could carry: unpickling it would run a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_doctored_resume_state_cannot_run_code(data, tmp_path):
    checkpoints, marker = tmp_path / "checkpoints", tmp_path / "ran"
    checkpoints.mkdir()
    torch.save({"model": _Payload(marker)}, checkpoints / "state.pt")
    with pytest.raises(UserError, match="state.pt: not a checkpoint this code wrote"):
        train.run(data / "hidden", data / "target", config.Train(**PARAMS), checkpoints)
    assert not marker.exists()


def test_plan_batches_respects_budget_and_is_seeded():
    lengths = [5, 30, 12, 7, 40, 3, 22, 9]
    plan = sequences.plan_batches(lengths, 60, seed=0, epoch=1)
    assert sorted(i for b in plan for i in b) == list(range(8))
    assert all(len(b) * max(lengths[i] for i in b) <= 60 or len(b) == 1 for b in plan)
    assert plan == sequences.plan_batches(lengths, 60, seed=0, epoch=1) != sequences.plan_batches(lengths, 60, 0, 2)


# ------------------------------------------------------------------------------------------ under torchrun (DDP)
# batches of 40 tokens: of one row for the longer samples (rank 1 then runs the row at weight 0), of 2-3 rows else;
# no clipping: it would hide the scale of the gradients
DDP_PARAMS = {**PARAMS, "batch_tokens": 40, "checkpoint_every": 4, "grad_clip": 1e6}
TOLERANCE = 1e-5  # on the weights and the loss history (rounded to 1e-5): DDP adds the ranks' gradients in another
# order than one process adds its rows' (measured: weights within 6e-7 after 3 epochs, losses within one rounding step)


def assert_close_runs(got, want, history, want_history, tol=TOLERANCE):
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=name)
    assert [(r["epoch"], r["split"], r["step"]) for r in history] == [
        (r["epoch"], r["split"], r["step"]) for r in want_history
    ]
    for r, w in zip(history, want_history):
        assert abs(r["loss"] - w["loss"]) <= 2 * tol, (r, w)
        assert abs(r["acc"] - w["acc"]) <= 0.02, (r, w)  # one position of about 50 may flip its argmax


@pytest.mark.e2e
def test_e2e_train_at_world_2_matches_world_1(data, tmp_path):
    params = config.Train(**DDP_PARAMS)
    lengths = [s.ids.shape[0] for s in sources.load_samples(data / "hidden", "train")]
    plans = [sequences.plan_batches(lengths, params.batch_tokens, params.seed, e) for e in range(params.epochs)]
    assert {1, 2} <= {min(len(b), 2) for plan in plans for b in plan}  # both kinds of batch are trained
    one, report, history = train.run(data / "hidden", data / "target", params, tmp_path / "one")
    (tmp_path / "draft").mkdir()  # an earlier output whose file is a hard link into DVC's cache
    (tmp_path / "cached").write_bytes(b"a cached object")
    os.link(tmp_path / "cached", tmp_path / "draft" / "model.safetensors")
    two, two_history = finished(data, params, tmp_path, world=2)
    assert (tmp_path / "cached").read_bytes() == b"a cached object"  # the stage wrote new files, not into it
    assert_close_runs(two, one, two_history, history)
    assert two_history[-1]["loss"] < two_history[0]["loss"]
    # Adam's moments hold the gradients' scale, which its steps hide: the ranks' mean is the whole batch's gradient
    moments = [
        torch.load(f / "state.pt", weights_only=True)["optimizer"]["state"]
        for f in (tmp_path / "checkpoints", tmp_path / "one")
    ]
    for key in moments[1]:
        for name in ("exp_avg", "exp_avg_sq"):
            want = moments[1][key][name]
            torch.testing.assert_close(moments[0][key][name], want, rtol=1e-3, atol=1e-4 * want.abs().max())
    timings = json.loads((tmp_path / "draft-timings.json").read_text())
    assert timings["processes"] == 2 and json.loads((tmp_path / "draft.json").read_text())["steps"] == report["steps"]


@pytest.mark.e2e
def test_e2e_a_killed_rank_loses_nothing_and_a_world_2_checkpoint_resumes_at_world_1(data, tmp_path):
    """With feature noise: each sample's draws are its own, whichever rank trains it and whenever."""
    params = config.Train(**DDP_PARAMS, feature_noise=0.2)
    (tmp_path / "full").mkdir()
    full, full_history = finished(data, params, tmp_path / "full", world=2)
    for world in (2, 1):
        folder = tmp_path / f"resumed-at-{world}"
        folder.mkdir()
        state = torch.load(killed_after_first_checkpoint(data, params, folder, world=2) / "state.pt", weights_only=True)
        assert state["epoch"] < params.epochs, "killed before the end"
        resumed, history = finished(data, params, folder, world=world)
        if world == 2:  # the same steps on the same ranks: the same weights, bit for bit
            assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), full.state_dict().values()))
        assert_close_runs(resumed, full, history, full_history)


def test_init_head_starts_lm_head_and_norm_from_the_target_and_freeze_head_keeps_them_out_of_training(data):
    p = config.Train(**PARAMS, init="head", freeze_head=True)
    model = train.setup(data / "hidden", data / "target", p)[0]
    fresh = train.setup(data / "hidden", data / "target", config.Train(**PARAMS))[0]
    tgt = train.target_tensors(data / "target", LAYERS - 3)
    assert torch.equal(model.lm_head.weight, tgt["head"][model.to_target(torch.arange(p.draft_vocab_size))])
    assert torch.equal(model.norm.weight, tgt["norm"]) and not torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    head = ("lm_head.", "norm.")
    for name, w in fresh.named_parameters():  # the rest as the fresh init draws it
        assert name.startswith(head) or torch.equal(w, model.get_parameter(name)), name
    trained = {id(w) for group in train.optimizer(model, p).param_groups for w in group["params"]}
    for name, w in model.named_parameters():
        assert (id(w) in trained) == w.requires_grad == (not name.startswith(head)), name
