"""families: the drafter's init from a target layer, by hand: the deepseek_mla drafter started from a dense
DeepseekV3 layer computes that layer, auto layer ids of targets below 7 layers, and a part of the layer that does not
fit starting fresh with the log saying why (the init of each family's tiny target is in test_families.py)."""

from collections import Counter

import pytest
import torch
from tiny_targets import FAMILIES, build_target, deviation

from eaglepipe.drafter import train
from eaglepipe.drafter.eagle3 import attention
from eaglepipe.drafter.eagle3 import config as draft_config
from eaglepipe.drafter.eagle3 import init as draft_init
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.hidden import layout
from eaglepipe.target import model as target


def test_the_mla_drafter_started_from_a_dense_deepseek_layer_computes_that_layer(tmp_path, tokenizer):
    """A DeepseekV3 target whose layers are all dense (first_k_dense_replace past the last): the deepseek_mla drafter
    started from its layer 3 computes that layer at step 0 (MLA with the query low rank, the shared rope key and
    YaRN's softmax scale, the dense MLP), and the init says exact."""
    cls, keys = FAMILIES["deepseek_v3"]
    FAMILIES["deepseek_dense"] = (cls, {**keys, "first_k_dense_replace": keys["num_hidden_layers"]})
    try:
        build_target(tmp_path / "target", "deepseek_dense", tokenizer)
    finally:
        del FAMILIES["deepseek_dense"]
    model = target.load_model(tmp_path / "target")
    cfg = draft_config.DraftConfig.from_target(model.config, 256, [1, 2, 3], "deepseek_mla")
    drafter = draft.Eagle3Draft(cfg, model.get_input_embeddings().weight)
    drafter.set_vocab(*draft.build_vocab(Counter(range(256)), 256, cfg.vocab_size))
    text = draft_init.init_from_target(drafter, train.target_tensors(tmp_path / "target", 3))
    assert text.startswith("exact: the midlayer is target layer 3 (deepseek_v3), a deepseek_mla layer"), text
    assert deviation(model, drafter, torch.tensor([list(range(5, 40))]), [1, 2, 3]) < 1e-5
    assert (
        cfg.mla
        == {"q_lora_rank": 32, "kv_lora_rank": 512, "qk_nope_head_dim": 8, "qk_rope_head_dim": 64, "v_head_dim": 16}
        and attention.yarn_mscale(cfg.rope_parameters) > 1
    )  # the scale is exercised


def test_auto_layer_ids_for_targets_below_7_layers():
    """[2, L // 2, L - 3] collides below 7 layers: auto is then the three consecutive ids around the middle, never 0
    (from 7 layers on it is the default, checked in test_hidden.py)."""
    assert [layout.layer_ids("auto", L) for L in (4, 5, 6, 7, 8)] == [
        [1, 2, 3],
        [1, 2, 3],
        [2, 3, 4],
        [2, 3, 4],
        [2, 4, 5],
    ]
    with pytest.raises(ValueError, match="^the target has 3 decoder layers: .* it needs at least 4$"):
        layout.layer_ids("auto", 3)
    assert layout.layer_ids([0, 1, 2], 3) == [0, 1, 2]  # explicit ids stay the user's choice


def test_a_part_that_does_not_fit_starts_fresh_and_the_log_says_why():
    """By hand: a layer with the Llama names whose gate_proj has another size (MLP fresh: zero down_proj), one whose
    q_proj is stored quantized (attention fresh, the seeded default init), and a family not known to compute the
    Llama layer from the same weights (every weight copied, still not exact)."""
    cfg = draft_config.DraftConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e4, "rope_type": "default"},
        max_position_embeddings=256,
        hidden_act="silu",
        vocab_size=128,
        draft_vocab_size=32,
        aux_layers=[1, 2, 3],
    )
    shapes = draft_init.layer_shapes(draft.Eagle3Draft(cfg, torch.randn(128, 64)))

    def init(model_type, **changed):
        layer = {**{n: torch.rand(s) for n, s in shapes.items()}, **changed}
        torch.manual_seed(0)
        model = draft.Eagle3Draft(cfg, torch.randn(128, 64))
        default_q = model.midlayer.self_attn.q_proj.weight.clone()
        text = draft_init.init_from_target(
            model,
            {
                "layer": layer,
                "layer_names": sorted(layer),
                "layer_index": 3,
                "model_type": model_type,
                "head": torch.randn(128, 64),
                "norm": torch.ones(64),
            },
        )
        return text, model, layer, default_q

    text, model, layer, _ = init("llama", **{"mlp.gate_proj.weight": torch.rand(64, 64)})
    assert text == (
        "not exact: the midlayer starts from target layer 3 (llama): attention copied; MLP fresh (seeded "
        "gate/up, zero down_proj), its mlp.gate_proj.weight is [64, 64], the drafter's [128, 64]; dropped "
        "mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight, post_attention_layernorm.weight"
    )
    assert not model.midlayer.mlp.down_proj.weight.any() and model.midlayer.mlp.up_proj.weight.any()
    assert torch.equal(model.midlayer.self_attn.o_proj.weight, layer["self_attn.o_proj.weight"])
    text, model, _, default_q = init("llama", **{"self_attn.q_proj.weight": torch.rand(64, 64).to(torch.float8_e4m3fn)})
    assert "attention fresh (seeded), its self_attn.q_proj.weight is stored as torch.float8_e4m3fn; MLP copied" in text
    assert torch.equal(model.midlayer.self_attn.q_proj.weight, default_q)
    text, _, _, _ = init("granite")
    assert text.endswith("attention copied; MLP copied; granite's layer is not known to be the llama drafter's layer")
    assert init("llama")[0].startswith("exact: ")
