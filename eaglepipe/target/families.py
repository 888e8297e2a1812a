"""Target families: what the pipeline knows about a target from its transformers config.

``load_config`` is the one reader of a target's config; ``text_config`` the one place its language model's (widths,
layer count, norm, context length) is read from. ``FAMILIES``: families by ``model_type``; ``of`` gives a config's,
or ``OTHER`` (served on compat.py's checks alone). A new family is one entry here, with a tiny random target of it in
tests/tiny_targets.py (tests/target/test_families.py runs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eaglepipe.target import remote


@dataclass(frozen=True)
class Family:
    """What the pipeline knows about one family of targets."""

    name: str
    layer: str | None  # the drafter layer (eagle3/config.py DRAFTERS) over its decoder layer's weights (init exact)
    drafter: str = "llama"  # train.drafter: auto's choice, the EAGLE-3 drafter vLLM's registry serves for it
    mla: bool = False  # multi-head latent attention (DeepSeek's): engines page its KV cache in their own blocks


OTHER = Family("other", layer=None)
FAMILIES = {
    kind: family
    for family in (
        Family("llama", layer="llama"),
        Family("mistral", layer="llama"),
        Family("qwen2", layer=None),  # q/k/v biases
        Family("qwen3", layer="qwen3", drafter="qwen3"),  # q_norm/k_norm: vLLM's Eagle3Qwen3ForCausalLM
        Family("qwen3_moe", layer="qwen3", drafter="qwen3"),  # the same attention, routed experts
        Family("qwen3_vl_text", layer="qwen3"),  # Qwen3-VL's language model: Qwen3's layer, M-RoPE; vLLM's drafter
        Family("qwen3_vl_moe_text", layer="qwen3"),  # for Qwen3-VL (Eagle3Qwen3vlForCausalLM) is the Llama one
        Family("gpt_oss", layer=None),  # q/k/v/o biases, attention sinks, sliding windows, MoE; vLLM: the Llama drafter
        Family("deepseek_v3", layer="deepseek_mla", drafter="deepseek_mla", mla=True),  # Kimi-K2's too (YaRN RoPE)
    )
    for kind in (family.name,)
}
COMPOSITES = ("qwen3_vl", "qwen3_vl_moe", "kimi_k25")
"""Composite ``model_type``s served text-only: with text positions alone their language model runs as it does alone
(Qwen3-VL's M-RoPE is then the 1-D RoPE of its language model; Kimi-K2.5's is a DeepseekV3), and the drafter is the
one its language model's family gets (vLLM's ``Eagle3Qwen3vlForCausalLM`` for Qwen3-VL is its Llama drafter)."""


def load_config(folder: Path):
    """The transformers config of the target in ``folder``."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=remote.trusted(folder))


def text_config(config):
    """The language model's config inside ``config`` (itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def composite(config) -> bool:
    """Whether ``config`` nests its language model's config (a multimodal wrapper)."""
    return text_config(config) is not config


def of(config) -> Family:
    """The family of a target's config (its language model's ``model_type``)."""
    return FAMILIES.get(text_config(config).model_type, OTHER)
