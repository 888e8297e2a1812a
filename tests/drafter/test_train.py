"""train: the loss mask and targets aligned with the shifted predictions (hand-built example), TTT step k equals a
KV-cached inference chain, the loss decreases, and a stage run killed after a checkpoint (``kill -9``) resumes and
ends bit-for-bit where an uninterrupted run ends."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from e2e import ranks_of
from safetensors.torch import save_file
from transformers import AutoConfig

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.dataset import sequences, shards
from eaglepipe.drafter import train
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.drafter.eagle3 import ttt
from eaglepipe.hidden import layout as features

ROOT = Path(__file__).resolve().parents[2]
V, H, LAYERS = 512, 64, 8
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


def tiny_target(folder):
    """A Llama-shaped target folder with just what train reads: config, tied embedding, final norm, layer L-3."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": LAYERS,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "hidden_act": "silu",
        "vocab_size": V,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=g)
    shapes = {
        "self_attn.q_proj.weight": (64, H),
        "self_attn.k_proj.weight": (32, H),
        "self_attn.v_proj.weight": (32, H),
        "self_attn.o_proj.weight": (H, 64),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (128, H),
        "mlp.up_proj.weight": (128, H),
        "mlp.down_proj.weight": (H, 128),
    }
    layer = {
        f"model.layers.{LAYERS - 3}.{k}": torch.randn(*s, generator=g) * 0.05 + (len(s) == 1)  # norms near 1
        for k, s in shapes.items()
    }
    save_file(
        {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(H), **layer},
        str(folder / "model.safetensors"),
    )
    return embed


def synthetic_hidden(folder, head, n_train=24, n_valid=4, seed=1, min_output=4):
    """Sequences that follow a fixed bigram map (learnable), in the layout of data/hidden: the target's final state
    at t points at the next token (its argmax is x[t+1]), aux is noise plus the embedding of x[t], top is the argmax
    of the unrounded final state."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    succ = torch.randperm(V - 3, generator=g)[:200] + 3  # 200 tokens in a cycle
    nxt = {int(a): int(b) for a, b in zip(succ, succ.roll(-1))}
    index = {
        "layers": [2, LAYERS // 2, LAYERS - 3],
        "layer_convention": features.LAYER_CONVENTION,
        "hidden_size": H,
        "dtype": "bfloat16",
    }
    for split, n in (("train", n_train), ("valid", n_valid)):
        ids, masks, offsets = [], [], [0]
        for _ in range(n):
            prompt = int(torch.randint(3, 10, (1,), generator=g))
            output = int(torch.randint(min_output, 16, (1,), generator=g))
            seq = [int(succ[torch.randint(0, 200, (1,), generator=g)])]
            for _ in range(prompt + output - 1):
                seq.append(nxt[seq[-1]])
            ids += seq
            masks += [0] * prompt + [1] * output
            offsets.append(len(ids))
        x = torch.tensor(ids)
        final = torch.cat((head[x[1:]], torch.randn(1, H, generator=g))) * 0.5
        aux = torch.cat([head[x] + torch.randn(len(ids), H, generator=g) for _ in range(3)], -1)
        file = f"{split}-00000.safetensors"
        shards.write(
            folder / file,
            {
                "input_ids": x.int(),
                "loss_mask": torch.tensor(masks, dtype=torch.uint8),
                "offsets": torch.tensor(offsets),
                "aux": aux.bfloat16(),
                "final": final.bfloat16(),
                "top": (final @ head.T).argmax(-1).int(),
            },
        )
        index[split] = {
            "shards": [{"file": file, "samples": n, "tokens": len(ids), "ids": [f"{split}{i}" for i in range(n)]}],
            "samples": n,
            "tokens": len(ids),
        }
    (folder / "index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    embed = tiny_target(tmp / "target")
    synthetic_hidden(tmp / "hidden", embed)
    return tmp


def test_chain_masks_hand_built():
    # prompt x0..x2, generated x3..x7: (t, k) is trained when x[t+1] .. x[t+2+k] were all generated
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    m = ttt.chain_masks(mask, 3).int().tolist()
    assert m[0] == [0, 0, 1, 1, 1, 1, 0, 0]  # t=2 (last prompt position, paired with x3) predicts x4; t=5 -> x7
    assert m[1] == [0, 0, 1, 1, 1, 0, 0, 0]  # t=4 at step 1 predicts x7; t=5 would predict x8 (past the end)
    assert m[2] == [0, 0, 1, 1, 0, 0, 0, 0]


def test_targets_aligned_with_shifted_predictions(tmp_path):
    """Hand-built batch: every (position t, step k) in the loss reads x[t+1+k], predicts x[t+2+k], and its target
    distribution and argmax come from the target's logits at t+1+k -- the position that predicted x[t+2+k]."""
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]).bool()
    head = torch.eye(32) * 10  # a target with vocab 32 = hidden size 32
    final = head[ids.roll(-1)]  # argmax at t is x[t+1] (as when it generated them)
    top = (final @ head.T).argmax(-1)
    shards.write(tmp_path / "s.safetensors", {"aux": torch.zeros(8, 96), "final": final, "top": top.int()})
    sample = features.Sample("s", ids.int(), mask, mask, tmp_path / "s.safetensors", 0)
    batch = ttt.collate([sample], features.read_states([sample]), 3, head, torch.ones(32, dtype=torch.bool))
    assert batch["kept"].tolist() == [batch["masks"][k].sum() for k in range(3)]  # every target in the vocabulary
    seen = []
    for k in range(3):
        b, a = torch.nonzero(batch["masks"][k], as_tuple=True)
        t = batch["act"][b, a] + 1 + k  # as ttt_forward indexes the targets
        for pos, tt in zip(batch["act"][b, a].tolist(), t.tolist()):
            assert batch["top"][0, tt] == ids[pos + 2 + k] and batch["probs"][0, tt].argmax() == ids[pos + 2 + k]
            assert mask[pos + 1 : pos + 3 + k].all()
            seen.append((k, pos, int(ids[pos + 1 + k]), int(ids[pos + 2 + k])))
    assert seen[0] == (0, 2, 13, 14)  # the chain starts at the last prompt position with the first generated token
    assert [s for s in seen if s[0] == 2] == [(2, 2, 15, 16), (2, 3, 16, 17)]


def test_a_sample_with_no_position_to_train_is_left_out_and_counted(tmp_path, caplog):
    """An answer of one token gives no (state, next token, token after) triple: load_samples leaves it out and says
    how many."""
    head = tiny_target(tmp_path / "target")
    synthetic_hidden(tmp_path / "hidden", head, n_train=64, min_output=1)
    one_token = [s["id"] for s in features.read(tmp_path / "hidden", "train") if s["loss_mask"].sum() == 1]
    with caplog.at_level(logging.INFO, logger="eaglepipe.drafter.train"):
        loaded = train.load_samples(tmp_path / "hidden", "train")
    assert one_token and len(loaded) == 64 - len(one_token) and not {s.id for s in loaded} & set(one_token)
    assert f"train: {len(one_token)} samples left out, no position to train" in caplog.text


def test_all_positions_train_over_the_prompt_with_the_same_vocabulary(data):
    embed = train.target_tensors(data / "target", LAYERS - 3)["embed"]
    generated = train.load_samples(data / "hidden", "train")
    every = train.load_samples(data / "hidden", "train", "all")
    assert [s.id for s in every] == [s.id for s in generated]
    stored = {s["id"]: s for s in features.read(data / "hidden", "train")}
    for g, e, st in zip(generated, every, features.read_states(every)):
        assert torch.equal(g.chain, g.mask) and torch.equal(e.mask, g.mask) and e.chain.all()
        assert torch.equal(e.ids, stored[e.id]["input_ids"]) and torch.equal(e.mask, stored[e.id]["loss_mask"].bool())
        assert all(torch.equal(st[name], stored[e.id][name]) for name in features.STATES)  # read lazily, as stored
    steps, t2d = 3, torch.ones(V, dtype=torch.bool)
    assert (
        ttt.collate(every, features.read_states(every), steps, embed, t2d)["masks"].sum()
        > ttt.collate(generated, features.read_states(generated), steps, embed, t2d)["masks"].sum()
    )
    assert train.token_counts(every) == train.token_counts(generated)  # the draft vocabulary: generated tokens only


def test_ttt_step_equals_cached_inference_chain(data):
    """Step k of training at position t gives the logits of a KV-cached chain: extend over 0..t, then k steps."""
    embed = train.target_tensors(data / "target", LAYERS - 3)["embed"]
    cfg = draft.DraftConfig.from_target(AutoConfig.from_pretrained(data / "target"), 64, [2, 4, 5])
    torch.manual_seed(0)
    model = draft.Eagle3Draft(cfg, embed).eval()
    model.set_vocab(*draft.build_vocab(Counter(range(64)), 64, V))
    samples = train.load_samples(data / "hidden", "train")
    s = samples[0]
    steps = 3
    states = features.read_states([s])
    batch = ttt.collate([s], states, steps, embed[model.to_target(torch.arange(64))], model.t2d)
    aux = states[0]["aux"]
    captured = {}
    original = model.logits

    def spy(h):  # record the drafter's output at every (position, step) of the loss
        captured.setdefault(len(captured), h)
        return original(h)

    model.logits = spy
    with torch.no_grad():
        ttt.ttt_forward(model, batch, steps)
    model.logits = original
    for k in range(steps):
        b, a = torch.nonzero(batch["masks"][k], as_tuple=True)
        for row, t in enumerate(batch["act"][b, a].tolist()):
            with torch.no_grad():
                logits, h, cache = model(s.ids[None, 1 : t + 2], model.project(aux[None, : t + 1]))
                for j in range(1, k + 1):
                    logits, h, cache = model(s.ids[None, t + 1 + j : t + 2 + j], h[:, -1:], cache)
            assert len(cache) == t + 1 + k
            torch.testing.assert_close(original(captured[k][row]), logits[0, -1], rtol=1e-4, atol=1e-4)


def test_attention_in_blocks_gives_the_loss_and_gradients_of_one_block(data, monkeypatch):
    """ttt.attention past CHUNK queries (blocks recomputed in backward, the bounded-memory form of long sequences)
    gives the loss, statistics and every gradient of the whole score matrix at once, within float rounding."""
    embed = train.target_tensors(data / "target", LAYERS - 3)["embed"]
    cfg = draft.DraftConfig.from_target(AutoConfig.from_pretrained(data / "target"), 64, [2, 4, 5])
    samples, steps = train.load_samples(data / "hidden", "train", "all")[:3], 3
    results = []
    for chunk in (10**6, 7):
        monkeypatch.setattr(ttt, "CHUNK", chunk)
        torch.manual_seed(0)
        model = draft.Eagle3Draft(cfg, embed)
        model.set_vocab(*draft.build_vocab(Counter(range(64)), 64, V))
        batch = ttt.collate(
            samples, features.read_states(samples), steps, embed[model.to_target(torch.arange(64))], model.t2d
        )
        assert batch["act"].shape[1] > 2 * chunk or chunk > 1000  # several blocks, one of them partial
        loss, stats = ttt.ttt_forward(model, batch, steps)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(stats_b, stats_a)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 3
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


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
    return draft.load(folder / name, embed), json.loads((folder / f"{name}-plots.json").read_text())


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

    checkpoints = killed_after_first_checkpoint(data, params, tmp_path)
    state = torch.load(checkpoints / "state.pt", weights_only=True)  # tensors and plain data only
    assert state["epoch"] < params.epochs, "killed before the end"
    resumed, _, history_b = train.run(data / "hidden", data / "target", params, checkpoints)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert history_b == history


def test_feature_noise_is_uniform_relative_to_each_layers_state_and_a_function_of_the_sample():
    """A sample's noise depends on (seed, epoch, sample) alone: not on its batch mates, its row, the padding or what
    ran before; padding stays zero."""
    torch.manual_seed(0)
    aux = torch.randn(2, 50, 3 * 16) * torch.tensor([100.0, 1.0, 0.01]).repeat_interleave(16)  # layers of 3 scales
    aux[1, 30:] = 0  # padding
    noisy = ttt.noisy(aux, 0.2, [(0, 1, 7), (0, 1, 8)], [50, 30])
    noise = (noisy - aux).unflatten(-1, (3, -1))
    rms = aux.unflatten(-1, (3, -1)).pow(2).mean(-1, keepdim=True).sqrt()
    relative = (noise / rms.clamp_min(1e-30))[rms.squeeze(-1) > 0]
    assert relative.abs().max() <= 0.1 and relative.abs().mean() == pytest.approx(0.05, abs=0.005)  # U(-0.1, 0.1)
    assert noise[1, 30:].abs().max() == 0
    torch.rand(3)  # the global generator moves on: the noise does not
    alone = ttt.noisy(aux[1:, :30], 0.2, [(0, 1, 8)], [30])  # the second sample in a batch of its own, unpadded
    assert torch.equal(alone[0], noisy[1, :30])
    assert not torch.equal(ttt.noisy(aux[1:, :30], 0.2, [(0, 2, 8)], [30]), alone)  # each epoch its own


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
    lengths = [s.ids.shape[0] for s in train.load_samples(data / "hidden", "train")]
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
