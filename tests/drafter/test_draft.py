"""eagle3/model.py: the draft vocabulary and its d2t/t2d invariants, parameter names and shapes, and the exported
checkpoint read back by a loader written here with plain torch ops (none of model.py's), giving the same draft outputs
as its ``load``; eagle3/init.py's init from the target."""

import json
import math
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from eaglepipe.drafter import methods, train
from eaglepipe.drafter.eagle3 import config as draft_config
from eaglepipe.drafter.eagle3 import init
from eaglepipe.drafter.eagle3 import model as draft

EXPECTED = {  # name -> shape, from H (hidden), I (intermediate), heads, kv heads, d (head dim), V, Vd
    "fc.weight": lambda c: (c["H"], 3 * c["H"]),
    "midlayer.self_attn.q_proj.weight": lambda c: (c["heads"] * c["d"], 2 * c["H"]),
    "midlayer.self_attn.k_proj.weight": lambda c: (c["kv"] * c["d"], 2 * c["H"]),
    "midlayer.self_attn.v_proj.weight": lambda c: (c["kv"] * c["d"], 2 * c["H"]),
    "midlayer.self_attn.o_proj.weight": lambda c: (c["H"], c["heads"] * c["d"]),
    "midlayer.mlp.gate_proj.weight": lambda c: (c["I"], c["H"]),
    "midlayer.mlp.up_proj.weight": lambda c: (c["I"], c["H"]),
    "midlayer.mlp.down_proj.weight": lambda c: (c["H"], c["I"]),
    "midlayer.input_layernorm.weight": lambda c: (c["H"],),
    "midlayer.hidden_norm.weight": lambda c: (c["H"],),
    "midlayer.post_attention_layernorm.weight": lambda c: (c["H"],),
    "norm.weight": lambda c: (c["H"],),
    "lm_head.weight": lambda c: (c["Vd"], c["H"]),
    "d2t": lambda c: (c["Vd"],),
    "t2d": lambda c: (c["V"],),
}


def test_draft_vocab_most_frequent_sorted_and_padded():
    counts = Counter({7: 5, 3: 9, 11: 5, 2: 1, 40: 5})
    d2t, t2d = draft.build_vocab(counts, 3, 50)
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [3, 7, 11]  # 3 most frequent; the tie 7/11/40 goes to the lower ids
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (50,)
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    d2t, t2d = draft.build_vocab(counts, 8, 50)  # more room than distinct ids: lowest unused ids pad
    assert (torch.arange(8) + d2t).tolist() == [0, 1, 2, 3, 4, 7, 11, 40] and int(t2d.sum()) == 8
    with pytest.raises(ValueError):
        draft.build_vocab(counts, 51, 50)


def test_config_layout_and_layer_convention(target_folder):
    cfg = draft_config.DraftConfig.from_target(AutoConfig.from_pretrained(target_folder), 4096, [2, 15, 27])
    j = cfg.to_json()
    assert j["architectures"] == ["LlamaForCausalLMEagle3"] and j["model_type"] == "llama"
    assert j["num_hidden_layers"] == 1 and j["tie_word_embeddings"] is False
    assert j["vocab_size"] == 49152 and j["draft_vocab_size"] == 4096 and j["hidden_size"] == 576
    assert j["num_attention_heads"] == 9 and j["num_key_value_heads"] == 3 and j["head_dim"] == 64
    assert j["rope_theta"] == 100000.0 and j["rope_scaling"] is None
    # each engine's key where only it reads it: vLLM the HF indices, SGLang (which adds one) the indices minus one
    assert j["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert j["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert draft_config.DraftConfig.from_json(json.loads(json.dumps(j))) == cfg
    assert not set(draft_config.TOGGLES) & set(j)  # an EAGLE-3 config.json as before EAGLE-3.1's keys existed
    toggled = draft_config.DraftConfig.from_target(
        AutoConfig.from_pretrained(target_folder), 4096, [2, 15, 27], fc_norm=True, norm_output=True
    )
    assert toggled.to_json() == {**j, "fc_norm": True, "norm_output": True}
    assert draft_config.DraftConfig.from_json(json.loads(json.dumps(toggled.to_json()))) == toggled
    one_engine = {k: v for k, v in j.items() if k != "eagle_aux_hidden_state_layer_ids"}
    with pytest.raises(ValueError, match="both engines"):
        draft_config.DraftConfig.from_json(one_engine)
    with pytest.raises(ValueError, match="disagree"):
        draft_config.DraftConfig.from_json({**j, "eagle_aux_hidden_state_layer_ids": [1, 14, 26]})


@pytest.fixture(scope="module", params=[{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"])
def exported(request, tmp_path_factory, target_folder):
    """A drafter for the embedded target (random weights, seeded; EAGLE-3 and EAGLE-3.1), saved; plus the target's
    embedding."""
    from safetensors import safe_open

    with safe_open(str(target_folder / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
    cfg = draft_config.DraftConfig.from_target(
        AutoConfig.from_pretrained(target_folder), 4096, [2, 15, 27], **request.param
    )
    torch.manual_seed(0)
    model = draft.Eagle3Draft(cfg, embed)
    ids, freq = torch.randint(0, 49152, (20000,)), torch.randint(1, 50, (20000,))
    counts = Counter({int(t): int(c) for t, c in zip(ids, freq)})
    model.set_vocab(*draft.build_vocab(counts, 4096, 49152))
    with torch.no_grad():  # non-trivial norms
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("draft")
    draft.save(model, folder)
    return folder, model, embed


def test_checkpoint_names_shapes_dtypes_and_vocab_invariants(exported):
    folder, model, _ = exported
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    c = {
        "H": config["hidden_size"],
        "I": config["intermediate_size"],
        "heads": config["num_attention_heads"],
        "kv": config["num_key_value_heads"],
        "d": config["head_dim"],
        "V": config["vocab_size"],
        "Vd": config["draft_vocab_size"],
    }
    expected = dict(EXPECTED)
    if config.get("fc_norm"):  # EAGLE-3.1: one norm per aux state, vLLM's model.fc_norm.{i}
        expected |= {f"fc_norm.{i}.weight": lambda c: (c["H"],) for i in range(3)}
    assert set(tensors) == set(expected), "exactly the LlamaForCausalLMEagle3 names, no embed_tokens"
    for name, shape in expected.items():
        assert tuple(tensors[name].shape) == shape(c), name
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.float32)
        assert tensors[name].dtype == want, name
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    target_ids = torch.arange(c["Vd"]) + d2t
    assert (target_ids[1:] > target_ids[:-1]).all() and target_ids.min() >= 0 and target_ids.max() < c["V"]
    assert int(t2d.sum()) == c["Vd"] and t2d[target_ids].all()
    assert set(model.state_dict()) == set(expected)
    assert dict(model.named_parameters()).keys() == set(expected) - {"d2t", "t2d"}


def reference_forward(folder, embed, tokens, hiddens):
    """One draft layer over a whole sequence with plain torch ops, from config.json + model.safetensors only:
    pairs (tokens[i], hiddens[i]) at positions 0..T-1, causal attention. Returns (draft logits, the state fed back:
    the pre-norm output, or with config.json's norm_output the normed one)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    nh, kvh, d, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    T = tokens.shape[0]

    def rms(x, name):
        return w[name] * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rot(z):  # [T, heads, d], rotate-half RoPE with the config's theta
        ang = torch.arange(T).float()[:, None] * cfg["rope_theta"] ** (-torch.arange(0, d, 2).float() / d)
        cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        z1, z2 = z[..., : d // 2], z[..., d // 2 :]
        return torch.cat((z1 * cos - z2 * sin, z2 * cos + z1 * sin), -1)

    x = torch.cat(
        (rms(embed[tokens], "midlayer.input_layernorm.weight"), rms(hiddens, "midlayer.hidden_norm.weight")), -1
    )
    q = rot((x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, nh, d))
    k = rot((x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, kvh, d))
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, kvh, d)
    group = torch.arange(nh) // (nh // kvh)  # query head h reads kv head h // (nh / kvh)
    scores = torch.einsum("thd,shd->hts", q, k[:, group]) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    att = torch.einsum("hts,shd->thd", scores.softmax(-1), v[:, group]).reshape(T, nh * d)
    a = hiddens + att @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(a, "midlayer.post_attention_layernorm.weight")
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
    out = a + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    normed = rms(out, "norm.weight")
    return normed @ w["lm_head.weight"].T, normed if cfg.get("norm_output") else out, w


def reference_project(folder, aux):
    """fc over the (low, mid, high) states; with config.json's fc_norm, each state RMS-normed by its own weight."""
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    states = aux.float().chunk(3, -1)
    if cfg.get("fc_norm"):
        eps = cfg["rms_norm_eps"]
        states = [
            w[f"fc_norm.{i}.weight"] * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))
            for i, x in enumerate(states)
        ]
    return torch.cat(states, -1) @ w["fc.weight"].T


def test_independent_loader_gives_identical_chain(exported):
    """Extend over a prompt, then draft 3 tokens with the KV cache (draft.load) vs recomputing the whole sequence
    with the independent loader: the same logits, hidden states and drafted target ids."""
    folder, _, embed = exported
    loaded = methods.load(folder, embed)
    g = torch.Generator().manual_seed(1)
    n, H = 9, 576
    tokens = torch.randint(0, 49152, (n,), generator=g)
    aux = torch.randn(n, 3 * H, generator=g).bfloat16()
    w = load_file(str(folder / "model.safetensors"))
    hiddens = reference_project(folder, aux)

    with torch.no_grad():
        logits, h, cache = loaded(tokens[None], loaded.project(aux[None]))
        ref_logits, ref_h, _ = reference_forward(folder, embed, tokens, hiddens)
        torch.testing.assert_close(logits[0], ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h[0], ref_h, rtol=1e-5, atol=1e-5)
        for _ in range(3):
            drafted = loaded.to_target(logits[:, -1].argmax(-1))
            ref_drafted = ref_logits[-1].argmax() + w["d2t"][ref_logits[-1].argmax()]
            assert int(drafted) == int(ref_drafted) and bool(w["t2d"][ref_drafted])
            logits, h, cache = loaded(drafted[:, None], h[:, -1:], cache)
            tokens, hiddens = torch.cat((tokens, drafted)), torch.cat((hiddens, ref_h[-1:]))
            ref_logits, ref_h, _ = reference_forward(folder, embed, tokens, hiddens)
            torch.testing.assert_close(logits[0, -1], ref_logits[-1], rtol=1e-5, atol=1e-5)
        assert len(cache) == n + 3
        cache.crop(n)
        assert len(cache) == n


def test_init_from_target_step_zero_is_the_target_layer(target_folder, model, tokenizer):
    """With the init, the drafter's step 0 over the target's own states is exactly the target's decoder layer 27
    (its output is the target's hidden_states[28]); lm_head holds the target's rows of the draft vocabulary."""
    tgt = train.target_tensors(target_folder, 27)
    cfg = draft_config.DraftConfig.from_target(model.config, 512, [2, 15, 27])
    drafter = draft.Eagle3Draft(cfg, tgt["embed"])
    drafter.set_vocab(*draft.build_vocab(Counter({i * 7: 1 for i in range(512)}), 512, 49152))
    assert init.init_from_target(drafter, tgt).startswith("exact: the midlayer is target layer 27 (llama)")
    assert torch.equal(drafter.lm_head.weight, tgt["head"][drafter.to_target(torch.arange(512))])
    ids = tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat((states[2], states[15], states[27]), -1)
        _, h, _ = drafter(ids, drafter.project(aux))  # the tokens do not matter yet: the embedding half is zero
    torch.testing.assert_close(h, states[28], rtol=1e-4, atol=1e-3)
