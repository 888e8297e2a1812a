"""The EAGLE-3 drafter's config (``DraftConfig``) and its ``config.json``, the file the engines read to build it.

``config.json``: ``architectures`` and ``model_type`` per
``DRAFTERS`` (qwen3: vLLM's ``qwen3_eagle3.py``; deepseek_mla: its ``deepseek_eagle3.py``, with the target's
``MLA_KEYS``), ``num_hidden_layers: 1``, ``tie_word_embeddings: false`` (else SGLang makes lm_head the embedding),
``vocab_size`` (the target's), ``draft_vocab_size``, the target's Llama fields (sizes, heads, head_dim, rms_norm_eps,
rope_theta/rope_scaling and rope_parameters, max_position_embeddings, hidden_act), and the aux layer ids once per
engine, each in a key only that engine reads (they mean different ids):
    ``eagle_aux_hidden_state_layer_ids`` (top level): the HF indices ([2, 15, 27]). vLLM 0.32 reads this key first, as
        HF ``hidden_states`` indices (``gpu_model_runner._get_eagle3_aux_layers_from_config``; its newer runner reads
        only this one); SGLang never reads it.
    ``eagle_config.eagle_aux_hidden_state_layer_ids``: the HF indices minus one ([1, 14, 26]). SGLang reads only this
        key and adds one (``set_eagle3_layers_to_capture`` counts layer outputs); vLLM reads it only when the
        top-level key is absent.
``load`` refuses a config whose two keys disagree, or that has only one of them.

EAGLE-3.1 (``train.method: eagle3.1``, its toggles in ``train.eagle3_1``): two keys vLLM 0.32 reads in each of its
EAGLE-3 drafters (``llama_eagle3.py``, ``qwen3_eagle3.py``, ``deepseek_eagle3.py``), written only when on, so an EAGLE-3
checkpoint's config.json is the same as before they existed:
    ``fc_norm: true``: one RMS norm per aux state (weights ``fc_norm.{i}.weight``) before ``fc``.
    ``norm_output: true``: the state fed back to the next draft step is the final norm's output, not its input.

Parallel drafting (``train.method: peagle``): ``ptd_token_id``, the mask token's id (the first key of those vLLM 0.32
reads for it, ``v1/spec_decode/llm_base_proposer.py``; the target's pad token, else its end of sequence), written only
for this method; its weights add ``mask_hidden`` [3H]. vLLM serves it with ``"parallel_drafting": true`` in the
speculative config, and serves the same checkpoint as plain EAGLE-3 without it (ignoring ``mask_hidden``).
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglepipe.core.errors import UserError
from eaglepipe.target import families

DRAFTERS = {
    "llama": ("LlamaForCausalLMEagle3", "llama"),  # the Llama layer: SGLang and vLLM
    "qwen3": ("Eagle3Qwen3ForCausalLM", "qwen3"),  # with q_norm/k_norm: vLLM only
    "deepseek_mla": ("Eagle3DeepseekV2ForCausalLM", "deepseek_v2"),
}  # MLA, dense MLP: vLLM only
"""train.drafter's layers: name -> (config.json's ``architectures`` name, ``model_type``). deepseek_mla's is
deepseek_v2 for V2 and V3 targets alike: vLLM makes a drafter of type deepseek_v3 its multi-token-prediction model."""
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The MLA drafter's attention sizes, the target's (its config.json keys)."""
TOGGLES = ("fc_norm", "norm_output")
"""EAGLE-3.1's config.json keys (module docstring), each a ``DraftConfig`` field."""
MASK_KEY = "ptd_token_id"
"""The config.json key of parallel drafting's mask token (module docstring)."""
MROPE = ("mrope_section", "mrope_interleaved")  # a multimodal target's RoPE keys: text positions make them 1-D RoPE


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    hidden_act: str
    vocab_size: int
    draft_vocab_size: int
    aux_layers: list  # HF output_hidden_states indices (state entering decoder layer i), low, mid, high
    drafter: str = "llama"  # one of DRAFTERS
    mla: dict | None = None  # the deepseek_mla drafter's MLA_KEYS (head_dim is then qk_rope_head_dim, RoPE's)
    fc_norm: bool = False  # EAGLE-3.1: an RMS norm per aux state before fc
    norm_output: bool = False  # EAGLE-3.1: the normed output fed back to the next step
    mask_token_id: int | None = None  # parallel drafting's mask token (None: chain drafting)

    @property
    def qk_norm(self) -> bool:
        """Whether the drafter's attention norms each head's q and k before RoPE (Qwen3's q_norm, k_norm)."""
        return self.drafter == "qwen3"

    @property
    def parallel(self) -> bool:
        """Whether the drafter proposes all its tokens in one forward (parallel drafting, mask slots)."""
        return self.mask_token_id is not None

    @classmethod
    def from_target(
        cls,
        config,
        draft_vocab_size: int,
        aux_layers: list,
        drafter: str = "llama",
        parallel_drafting: bool = False,
        **toggles: bool,
    ) -> DraftConfig:
        """The ``drafter``'s config from the target's (a transformers config): same widths, heads and RoPE (an
        M-RoPE made the 1-D RoPE of text positions); ``toggles``: the EAGLE-3.1 keys (``fc_norm``, ``norm_output``);
        ``parallel_drafting``: a mask token, the target's (``mask_token``)."""
        c = families.text_config(config)
        rope = {k: v for k, v in c.rope_parameters.items() if k not in MROPE}
        mla = None
        if drafter == "deepseek_mla":
            mla = {k: getattr(c, k, None) for k in MLA_KEYS}
            if None in mla.values():  # without q_lora_rank vLLM's loader would stack kv_a_proj_with_mqa into nothing
                raise UserError(
                    f"train.drafter deepseek_mla needs a target with MLA attention and a query "
                    f"low-rank projection; its {c.model_type} config has no "
                    f"{', '.join(k for k, v in mla.items() if v is None)}"
                )
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_attention_heads
            if mla
            else getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=mla["qk_rope_head_dim"]
            if mla
            else getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=float(c.rms_norm_eps),
            rope_parameters=rope,
            max_position_embeddings=c.max_position_embeddings,
            hidden_act=c.hidden_act,
            vocab_size=c.vocab_size,
            draft_vocab_size=int(draft_vocab_size),
            aux_layers=list(aux_layers),
            drafter=drafter,
            mla=mla,
            mask_token_id=mask_token(config) if parallel_drafting else None,
            **toggles,
        )

    def to_json(self) -> dict:
        """config.json in the layout the engines load (module docstring, Checkpoint)."""
        rope = dict(self.rope_parameters)
        legacy_scaling = (
            None
            if rope.get("rope_type", "default") == "default"
            else {k: v for k, v in rope.items() if k != "rope_theta"}
        )
        architecture, model_type = DRAFTERS[self.drafter]
        return {
            "architectures": [architecture],
            "model_type": model_type,
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": rope["rope_theta"],
            "rope_scaling": legacy_scaling,
            "rope_parameters": rope,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            "eagle_config": {
                "use_aux_hidden_state": True,
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layers],
            },
            **(self.mla or {}),
            **{key: True for key in TOGGLES if getattr(self, key)},
            **({MASK_KEY: self.mask_token_id} if self.parallel else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> DraftConfig:
        drafter = next((name for name, (arch, _) in DRAFTERS.items() if arch in d.get("architectures", [])), None)
        if drafter is None or d.get("num_hidden_layers") != 1:
            raise ValueError(
                f"not a one-layer config of {', '.join(a for a, _ in DRAFTERS.values())}: {d.get('architectures')}"
            )
        rope = d.get("rope_parameters") or {
            "rope_theta": d["rope_theta"],
            **(d.get("rope_scaling") or {"rope_type": "default"}),
        }
        return cls(
            **{
                k: d[k]
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "rms_norm_eps",
                    "max_position_embeddings",
                    "hidden_act",
                    "vocab_size",
                    "draft_vocab_size",
                )
            },
            rope_parameters=rope,
            aux_layers=aux_layers_of(d),
            drafter=drafter,
            mla={k: d[k] for k in MLA_KEYS} if drafter == "deepseek_mla" else None,
            **{key: bool(d.get(key, False)) for key in TOGGLES},
            mask_token_id=d.get(MASK_KEY),
        )


def mask_token(config) -> int:
    """Parallel drafting's mask token for a target (a transformers config): its pad token, else its end of sequence
    (the first, if several). Its embedding is the target's, frozen; the drafter learns ``mask_hidden`` beside it."""
    c = families.text_config(config)
    for key in ("pad_token_id", "eos_token_id"):
        found = getattr(c, key, None)
        if found is None:
            found = getattr(config, key, None)
        if isinstance(found, list):
            found = found[0] if found else None
        if found is not None:
            return int(found)
    raise UserError(
        "parallel and block drafting (train.method peagle, dflash) need a mask token: the target's config names no "
        "pad_token_id or eos_token_id"
    )


def aux_layers_of(d: dict) -> list:
    """The HF indices a checkpoint's config.json names in both engines' keys (module docstring); ValueError unless
    both are there and agree."""
    vllm_ids = d.get("eagle_aux_hidden_state_layer_ids")
    sglang_ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if vllm_ids is None or sglang_ids is None:
        raise ValueError(
            "config.json should name the aux layers for both engines: eagle_aux_hidden_state_layer_ids "
            "(vLLM, HF indices) and eagle_config.eagle_aux_hidden_state_layer_ids (SGLang, minus one)"
        )
    if [i + 1 for i in sglang_ids] != list(vllm_ids):
        raise ValueError(
            f"config.json's aux layers disagree: vLLM would read hidden_states {list(vllm_ids)}, "
            f"SGLang {[i + 1 for i in sglang_ids]} (eagle_config's ids plus one)"
        )
    return list(vllm_ids)
