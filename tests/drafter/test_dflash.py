"""DFlash: its objective at anchor t and draft k equals evaluate's block decoder after committing positions 0..t (the
forward vLLM runs), a block attends to all of itself (not causally); the checkpoint carries the names and keys vLLM's
qwen3_dflash.py loads and loads back; a DFlash drafter trains from the TTT batches."""

import json
from collections import Counter

import pytest
import torch
from synthetic import LAYERS, V
from test_train import PARAMS
from test_ttt import step_outputs
from transformers import AutoConfig

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.drafter import methods, sources, train
from eaglepipe.drafter.dflash import objective
from eaglepipe.drafter.dflash.config import DFlashConfig
from eaglepipe.drafter.dflash.model import DFlashDraft, block_attention
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.drafter.eagle3 import ttt
from eaglepipe.evaluate.block import BlockDrafter
from eaglepipe.hidden import layout

STEPS = 3


def tiny_dflash(data, num_layers: int = 2) -> DFlashDraft:
    """A DFlash drafter of the synthetic target, its norms' weights not ones."""
    embed = train.target_tensors(data / "target", LAYERS - 3)["embed"]
    target_config = AutoConfig.from_pretrained(data / "target")
    options = {"parallel_drafting": True, "block_size": STEPS + 1, "num_layers": num_layers}
    cfg = DFlashConfig.from_target(target_config, 64, [2, 4, 5], "qwen3", **options)
    torch.manual_seed(0)
    model = DFlashDraft(cfg, embed).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5)
    model.set_vocab(*draft.build_vocab(Counter(range(64)), 64, V))
    return model


def test_the_objective_at_each_anchor_equals_the_block_decoder(data):
    model = tiny_dflash(data)
    s = sources.load_samples(data / "hidden", "train")[0]
    states = layout.read_states([s])
    embed = model.embed_tokens
    batch = ttt.collate([s], states, STEPS, embed[model.to_target(torch.arange(64))], model.t2d)
    captured = step_outputs(model, objective.dflash_forward, batch, STEPS)
    original = model.logits
    aux = states[0]["aux"]
    checked = 0
    for k in range(STEPS):
        b, a = torch.nonzero(batch.masks[k], as_tuple=True)
        for row, t in enumerate(batch.act[b, a].tolist()):
            decoder = BlockDrafter(model, STEPS)
            with torch.no_grad():
                decoder.reset(s.ids[: t + 1].tolist(), aux[: t + 1], int(s.ids[t + 1]))
                drafts = decoder.propose(STEPS)
                block = model.block(
                    model.block_ids(torch.tensor([[int(s.ids[t + 1])]]), STEPS),
                    t + 1 + torch.arange(STEPS + 1)[None, None],
                    decoder.context_kv,
                    torch.ones(1, 1, t + 1, dtype=torch.bool),
                )
            torch.testing.assert_close(original(captured[k][row]), original(block[0, 0, 1 + k]), rtol=1e-4, atol=1e-4)
            assert drafts[k] == int(model.to_target(original(block[0, 0, 1 + k]).argmax()))
            checked += 1
    assert checked > 10


def test_a_block_attends_to_all_of_itself():
    """The first row of a block reads the masks after it: changing the last id changes it (a causal block would not)."""
    q, k, v = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    context = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    visible = torch.ones(1, 1, 5, dtype=torch.bool)
    out = block_attention(q, k, v, *context, visible, 4, 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 1.0
    v2[:, :, -1] += 1.0
    changed = block_attention(q, k2, v2, *context, visible, 4, 0.3)
    assert not torch.allclose(out[:, :, 0], changed[:, :, 0])
    hidden = visible.clone()
    hidden[..., -1] = False
    assert not torch.allclose(out, block_attention(q, k, v, *context, hidden, 4, 0.3))


def test_the_checkpoint_is_what_vllm_loads_and_loads_back(data, tmp_path):
    model = tiny_dflash(data, num_layers=2)
    draft.save(model, tmp_path / "draft")
    exported = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"] and exported["num_hidden_layers"] == 2
    assert exported["dflash_config"] == {"mask_token_id": 2, "target_layer_ids": [1, 3, 4], "block_size": STEPS + 1}
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and "eagle_config" not in exported
    names = set(model.state_dict())
    for i in range(2):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            assert f"layers.{i}.self_attn.{part}.weight" in names
        for part in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
            assert f"layers.{i}.{part}.weight" in names
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    loaded = methods.load(tmp_path / "draft", model.embed_tokens)
    assert isinstance(loaded, DFlashDraft) and loaded.cfg == model.cfg
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_a_dflash_drafter_trains_and_refuses_the_target_init(data, tmp_path):
    params = config.Train(**{**PARAMS, "epochs": 1, "method": "dflash", "dflash": {"num_layers": 2}})
    model, report, _ = train.run(data / "hidden", data / "target", params, tmp_path / "checkpoints")
    start = train.setup(data / "hidden", data / "target", params)[0]
    assert isinstance(model, DFlashDraft) and len(model.layers) == 2
    assert not torch.equal(model.fc.weight, start.fc.weight)
    with pytest.raises(UserError, match="train.init target starts EAGLE-3's layer"):
        train.run(data / "hidden", data / "target", params.model_copy(update={"init": "target"}), tmp_path / "x")
