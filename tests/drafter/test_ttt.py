"""ttt: the chain masks and targets aligned with the shifted predictions (hand-built examples), TTT step k equals a
KV-cached inference chain, attention in blocks gives the whole matrix's loss and gradients, and the feature noise is a
function of the sample."""

from collections import Counter

import pytest
import torch
from synthetic import LAYERS, V
from transformers import AutoConfig

from eaglepipe.dataset import shards
from eaglepipe.drafter import sources, train
from eaglepipe.drafter.eagle3 import config as draft_config
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.drafter.eagle3 import ttt
from eaglepipe.hidden import layout


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
    sample = layout.Sample("s", ids.int(), mask, mask, tmp_path / "s.safetensors", 0)
    batch = ttt.collate([sample], layout.read_states([sample]), 3, head, torch.ones(32, dtype=torch.bool))
    assert batch.kept.tolist() == [batch.masks[k].sum() for k in range(3)]  # every target in the vocabulary
    seen = []
    for k in range(3):
        b, a = torch.nonzero(batch.masks[k], as_tuple=True)
        t = batch.act[b, a] + 1 + k  # as ttt_forward indexes the targets
        for pos, tt in zip(batch.act[b, a].tolist(), t.tolist()):
            assert batch.top[0, tt] == ids[pos + 2 + k] and batch.probs[0, tt].argmax() == ids[pos + 2 + k]
            assert mask[pos + 1 : pos + 3 + k].all()
            seen.append((k, pos, int(ids[pos + 1 + k]), int(ids[pos + 2 + k])))
    assert seen[0] == (0, 2, 13, 14)  # the chain starts at the last prompt position with the first generated token
    assert [s for s in seen if s[0] == 2] == [(2, 2, 15, 16), (2, 3, 16, 17)]


def ttt_outputs(data, steps: int, **options) -> tuple:
    """(drafter, sample, its aux states, batch, {step: the drafter's outputs at the step's loss positions}) of one
    TTT forward over the first sample, the drafter's norm weights not ones; ``options``: DraftConfig.from_target's."""
    embed = train.target_tensors(data / "target", LAYERS - 3)["embed"]
    cfg = draft_config.DraftConfig.from_target(AutoConfig.from_pretrained(data / "target"), 64, [2, 4, 5], **options)
    torch.manual_seed(0)
    model = draft.Eagle3Draft(cfg, embed).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm."):
                weight.uniform_(0.5, 1.5)
    model.set_vocab(*draft.build_vocab(Counter(range(64)), 64, V))
    s = sources.load_samples(data / "hidden", "train")[0]
    states = layout.read_states([s])
    batch = ttt.collate([s], states, steps, embed[model.to_target(torch.arange(64))], model.t2d)
    return model, s, states[0]["aux"], batch, step_outputs(model, ttt.ttt_forward, batch, steps)


def step_outputs(model, objective, batch, steps: int) -> dict:
    """{step: the drafter's last-layer outputs at the step's loss positions} of one ``objective`` forward (no grad)."""
    captured = {}
    original = model.logits

    def spy(h):  # each step asks the head once, in step order
        captured.setdefault(len(captured), h)
        return original(h)

    model.logits = spy
    with torch.no_grad():
        objective(model, batch, steps)
    model.logits = original
    return captured


@pytest.mark.parametrize("toggles", [{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"])
def test_ttt_step_equals_cached_inference_chain(data, toggles):
    """Step k of training at position t gives the logits of a KV-cached chain: extend over 0..t, then k steps (with
    EAGLE-3.1's toggles too)."""
    steps = 3
    model, s, aux, batch, captured = ttt_outputs(data, steps, **toggles)
    for k in range(steps):
        b, a = torch.nonzero(batch.masks[k], as_tuple=True)
        for row, t in enumerate(batch.act[b, a].tolist()):
            with torch.no_grad():
                logits, h, cache = model(s.ids[None, 1 : t + 2], model.project(aux[None, : t + 1]))
                for j in range(1, k + 1):
                    logits, h, cache = model(s.ids[None, t + 1 + j : t + 2 + j], h[:, -1:], cache)
            assert len(cache) == t + 1 + k
            torch.testing.assert_close(model.logits(captured[k][row]), logits[0, -1], rtol=1e-4, atol=1e-4)


def test_parallel_ttt_step_equals_the_mask_slot_of_one_forward(data):
    """Parallel drafting: step k of training at position t gives the logits of the k-th mask slot after an extend
    over 0..t (the forward vLLM's parallel_drafting and evaluate run), and not those of a fed-back chain."""
    steps = 3
    model, s, aux, batch, captured = ttt_outputs(data, steps, parallel_drafting=True)
    assert model.cfg.mask_token_id == 2  # the synthetic target's pad token
    for k in range(1, steps):
        b, a = torch.nonzero(batch.masks[k], as_tuple=True)
        for row, t in enumerate(batch.act[b, a].tolist()):
            with torch.no_grad():
                _, h, cache = model(s.ids[None, 1 : t + 2], model.project(aux[None, : t + 1]))
                chained = model(s.ids[None, t + 2 : t + 3], h[:, -1:], cache)[0][0, -1]
                cache.crop(t + 1)
                logits = model.parallel_drafts(k, cache)
            assert len(cache) == t + 1 + k
            torch.testing.assert_close(model.logits(captured[k][row]), logits[0, -1], rtol=1e-4, atol=1e-4)
            assert k > 1 or not torch.allclose(chained, logits[0, -1], atol=1e-3)


def test_attention_in_blocks_gives_the_loss_and_gradients_of_one_block(data, monkeypatch):
    """ttt.attention past CHUNK queries (blocks recomputed in backward, the bounded-memory form of long sequences)
    gives the loss, statistics and every gradient of the whole score matrix at once, within float rounding."""
    embed = train.target_tensors(data / "target", LAYERS - 3)["embed"]
    cfg = draft_config.DraftConfig.from_target(AutoConfig.from_pretrained(data / "target"), 64, [2, 4, 5])
    samples, steps = sources.load_samples(data / "hidden", "train", "all")[:3], 3
    results = []
    for chunk in (10**6, 7):
        monkeypatch.setattr(ttt, "CHUNK", chunk)
        torch.manual_seed(0)
        model = draft.Eagle3Draft(cfg, embed)
        model.set_vocab(*draft.build_vocab(Counter(range(64)), 64, V))
        batch = ttt.collate(
            samples, layout.read_states(samples), steps, embed[model.to_target(torch.arange(64))], model.t2d
        )
        assert batch.act.shape[1] > 2 * chunk or chunk > 1000  # several blocks, one of them partial
        loss, stats = ttt.ttt_forward(model, batch, steps)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(stats_b.table(), stats_a.table())
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 3
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


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
