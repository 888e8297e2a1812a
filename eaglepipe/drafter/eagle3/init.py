"""How an EAGLE-3 drafter (eagle3/model.py) starts, per ``train.init`` (one log line per run says which): ``fresh`` (the
default) keeps the seeded default init of every weight; ``head`` (``init_head``): lm_head = the target's rows of the
draft vocabulary, norm = the target's final norm; ``target`` (``init_from_target``): the same, fc passing the high aux
state through, and the midlayer from the target's decoder layer that consumes the high state.

Each part of that layer is copied where the target has its weights with the drafter's shapes, stored as floats: the
attention (q/k/v on the hidden-state half, the embedding half zero; o_proj; hidden_norm = its input norm; the qwen3
drafter's q_norm/k_norm; the deepseek_mla drafter's q_a/kv_a projections on the hidden-state half, the rest of the MLA
as it is) and the MLP (post-attention norm, gate/up/down). A part that does not fit starts fresh: the attention from
the seeded default init, the MLP from seeded gate/up and a zero down_proj. The init is *exact* (step 0 computes that
target layer over the target's states, within its sliding window if it has one) when both parts fit, no weight of the
layer is left over and the family's layer is the drafter's (``families.Family.layer``). Otherwise the log says not
exact and names what it dropped (e.g. Qwen3's q_norm/k_norm under the llama drafter, Qwen2's q/k/v biases) or started
fresh (e.g. an MoE layer's MLP, at the target config's ``intermediate_size``).
"""

from __future__ import annotations

import logging
import re

import torch

from eaglepipe.drafter.eagle3.config import DraftConfig
from eaglepipe.drafter.eagle3.model import Eagle3Draft
from eaglepipe.target import families

log = logging.getLogger(__name__)

LLAMA_ATTENTION = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
)
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # the qwen3 drafter's attention has them too
MLA_ATTENTION = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_a_layernorm.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_a_layernorm.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
)
MLP_WEIGHTS = ("post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
LAYER_WEIGHTS = tuple(
    dict.fromkeys(LLAMA_ATTENTION + QK_NORMS + MLA_ATTENTION + ("input_layernorm.weight",) + MLP_WEIGHTS)
)
"""A target layer's weights the midlayer can start from (train.target_tensors reads those the target has)."""
INPUT_PROJECTIONS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.q_a_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
)  # 2H inputs: the hidden half
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def attention_weights(cfg: DraftConfig) -> tuple:
    """The target layer's weights the drafter's attention starts from: its projections (and norms), and its input
    norm (which becomes hidden_norm)."""
    own = MLA_ATTENTION if cfg.mla else LLAMA_ATTENTION + (QK_NORMS if cfg.qk_norm else ())
    return own + ("input_layernorm.weight",)


def layer_shapes(model: Eagle3Draft) -> dict:
    """The shape each target weight the midlayer can start from must have: the drafter's own (the 2H-input
    projections: their hidden-state half)."""
    H, mid = model.cfg.hidden_size, model.midlayer
    shapes = {
        name: tuple(mid.get_parameter(name).shape)
        for name in attention_weights(model.cfg) + MLP_WEIGHTS
        if name != "input_layernorm.weight"
    }
    return {
        **shapes,
        **{name: (shapes[name][0], H) for name in INPUT_PROJECTIONS if name in shapes},
        "input_layernorm.weight": (H,),
    }


def misfit(layer: dict, names, shapes: dict) -> str:
    """Why the target weights ``names`` cannot be copied ("" when they can)."""
    for name in names:
        w = layer.get(name)
        if w is None:
            return f"no {name}"
        if tuple(w.shape) != shapes[name]:
            return f"its {name} is {list(w.shape)}, the drafter's {list(shapes[name])}"
        if w.dtype not in FLOATS:
            return f"its {name} is stored as {w.dtype}"
    return ""


@torch.no_grad()
def init_head(model: Eagle3Draft, target: dict) -> None:
    """``train.init: head`` (module docstring)."""
    model.lm_head.weight.copy_(target["head"][torch.arange(model.cfg.draft_vocab_size) + model.d2t])
    model.norm.weight.copy_(target["norm"])


def init_from_target(model: Eagle3Draft, target: dict) -> str:
    """``train.init: target`` (module docstring), ``target`` from ``train.target_tensors``. Returns the init's
    one-line description, also logged."""
    H = model.cfg.hidden_size
    layer, mid = target["layer"], model.midlayer
    shapes, attention = layer_shapes(model), attention_weights(model.cfg)
    why_attn, why_mlp = misfit(layer, attention, shapes), misfit(layer, MLP_WEIGHTS, shapes)
    used = (() if why_attn else attention) + (() if why_mlp else MLP_WEIGHTS)
    dropped = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in target["layer_names"] if n not in used))
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, 2 * H :] = torch.eye(H)
        for name in used:
            w = mid.hidden_norm.weight if name == "input_layernorm.weight" else mid.get_parameter(name)
            if name in INPUT_PROJECTIONS:
                w.zero_()
                w[:, H:] = layer[name]
            else:
                w.copy_(layer[name])
        if why_mlp:
            mid.mlp.down_proj.weight.zero_()
    init_head(model, target)
    source = f"target layer {target['layer_index']} ({target['model_type']})"
    family, drafter = families.FAMILIES.get(target["model_type"], families.OTHER), model.cfg.drafter
    if not (why_attn or why_mlp or dropped or model.cfg.fc_norm) and family.layer == drafter:
        text = f"exact: the midlayer is {source}, a {drafter} layer with every weight used; step 0 computes that layer"
    else:
        parts = [
            f"attention {'fresh (seeded), ' + why_attn if why_attn else 'copied'}",
            f"MLP {'fresh (seeded gate/up, zero down_proj), ' + why_mlp if why_mlp else 'copied'}",
        ]
        if dropped:
            parts.append(f"dropped {', '.join(dropped)}")
        elif family.layer != drafter:
            parts.append(f"{target['model_type']}'s layer is not known to be the {drafter} drafter's layer")
        if model.cfg.fc_norm:
            parts.append("EAGLE-3.1's fc_norm norms the high state fc passes on")
        text = f"not exact: the midlayer starts from {source}: {'; '.join(parts)}"
    log.info("drafter init: %s", text)
    return text
