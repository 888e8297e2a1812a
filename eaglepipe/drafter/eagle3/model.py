"""The EAGLE-3 drafter: config, module, draft vocabulary, and the checkpoint SGLang and vLLM load (its attention
variants: eagle3/attention.py; its init from the target's weights: eagle3/init.py).

One decoder layer over the target's features (as SafeAILab/EAGLE ``traineagle3/cnets.py``, SGLang
``models/llama_eagle3.py``)::

    g  = fc(aux)                                    aux = cat(low, mid, high) [.., 3H] -> g [.., H]
    x  = cat(input_layernorm(embed(token)), hidden_norm(h))       [.., 2H]   (h = g at step 0)
    a  = h + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))   q/k/v take 2H inputs; RoPE; GQA
                                            (qwen3: RMS norms q_norm, k_norm on each head before RoPE;
                                             deepseek_mla: DeepSeek's MLA, ``attention.MLAttention``)
    h' = a + mlp(post_attention_layernorm(a))                     pre-norm output, fed back as h
    draft_logits = lm_head(norm(h'))                               [.., draft_vocab_size]

``embed_tokens`` is the target's input embedding: a frozen, non-persistent buffer, neither trained nor saved (the
engines supply it). Everything is float32.

Inference (chain drafting, top-1, batch rows share one length)::

    model = load("models/draft", target_embeddings)   # Eagle3Draft in eval mode; target_embeddings [V, H]
    model.aux_layers                   # HF output_hidden_states indices to concatenate (low, mid, high)
    g = model.project(aux)             # aux [B, T, 3H] (any float dtype) -> [B, T, H] float32
    logits, h_out, cache = model(input_ids, hidden, cache=None, position_ids=None)
        input_ids [B, T] target ids; hidden [B, T, H] (project(aux) or a previous h_out); cache a DraftCache (None
        starts one); position_ids default to len(cache) + arange(T)
        -> logits [B, T, draft_vocab_size] float32, h_out [B, T, H] pre-norm, cache (the same object, extended by T)
    model.to_target(draft_ids)         # target ids: draft_id + d2t[draft_id]
    cache.crop(n); len(cache)          # keep the first n positions / number of positions held

Alignment (as in training): the target's state at t is paired with token t + 1, and the drafter's output there
predicts token t + 2. A position id is its hidden state's: t for the target's state at t, t + k at draft step k of a
chain from it, so len(cache) is always the next position id.

Chain drafting (evaluate/decode.py's ``EagleDrafter``): after a prefill of x_0..x_{n-1} and the target's next token
x_n, extend with x[1..n] paired with project(aux[0..n-1]); each draft step feeds ``to_target(logits[:, -1].argmax(-1))``
with ``h[:, -1:]``; after verification (m drafts accepted, plus the bonus token) ``cache.crop(n)`` drops the chain and
x_{n+1}..x_{n+m+1} paired with project(aux[n..n+m]) extend it.

Draft vocabulary: the N most frequent loss-masked token ids, sorted ascending (ties: lower id first), padded with the
lowest unused ids when the data has fewer. ``d2t`` int64 [N]: target_id = draft_id + d2t[draft_id]; ``t2d`` bool [V]:
whether a target id is in the draft vocabulary.

Checkpoint (``save``/``load``): ``model.safetensors`` holds exactly the float32 ``fc``, ``norm``, ``lm_head``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}``, ``midlayer.mlp.{gate,up,down}_proj``,
``midlayer.self_attn.{q,k,v,o}_proj`` weights (``<name>.weight``; qwen3: and ``self_attn.{q,k}_norm``; deepseek_mla,
in place of q/k/v, DeepSeek's ``self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,
kv_b_proj}``), ``d2t`` (int64) and ``t2d`` (bool). ``config.json``: ``architectures`` and ``model_type`` per
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
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from eaglepipe.core.errors import UserError
from eaglepipe.drafter.eagle3.attention import (
    Attention,
    MLAttention,
    RMSNorm,
)
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

    @property
    def qk_norm(self) -> bool:
        """Whether the drafter's attention norms each head's q and k before RoPE (Qwen3's q_norm, k_norm)."""
        return self.drafter == "qwen3"

    @classmethod
    def from_target(cls, config, draft_vocab_size: int, aux_layers: list, drafter: str = "llama") -> DraftConfig:
        """The ``drafter``'s config from the target's (a transformers config): same widths, heads and RoPE (an
        M-RoPE made the 1-D RoPE of text positions)."""
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


def build_vocab(counts: Counter, size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [size], t2d bool [vocab_size]) from token counts of the loss-masked tokens."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft_vocab_size {size} should be in [1, {vocab_size}]")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = {tok for tok, _ in ranked[:size]}
    chosen |= set(islice((tok for tok in range(vocab_size) if tok not in chosen), size - len(chosen)))  # lowest unused
    ids = torch.tensor(sorted(chosen), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = MLAttention(cfg) if cfg.mla else Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attn_input(self, embeds, hidden):
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)

    def finish(self, attn, residual):
        """attention output [B, T, heads * d] and the layer's input hidden state -> pre-norm output."""
        h = residual + self.self_attn.o_proj(attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftCache:
    """Rotated keys and values [B, heads, L, d] of the positions processed so far (position ids 0..L-1)."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self):
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k, v):
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v

    def crop(self, n: int):
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, embed_tokens: torch.Tensor):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        if tuple(embed_tokens.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"target embeddings {tuple(embed_tokens.shape)} do not match the config "
                f"({cfg.vocab_size}, {cfg.hidden_size})"
            )
        self.cfg = cfg
        self.aux_layers = list(cfg.aux_layers)
        H = cfg.hidden_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed_tokens", embed_tokens.detach().float().clone(), persistent=False)
        rope_cfg = LlamaConfig(
            hidden_size=H,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(cfg.rope_parameters),
        )
        self.rotary = LlamaRotaryEmbedding(rope_cfg)  # buffers only (not persistent)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor):
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def project(self, aux):
        return self.fc(aux.float())

    def embed(self, input_ids):
        return F.embedding(input_ids, self.embed_tokens)

    def rope(self, position_ids):
        """cos, sin [B, T, head_dim] for position ids [B, T] (or [T])."""
        position_ids = position_ids if position_ids.dim() == 2 else position_ids[None]
        return self.rotary(self.embed_tokens, position_ids)

    def logits(self, h):
        return self.lm_head(self.norm(h))

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    def forward(self, input_ids, hidden, cache: DraftCache | None = None, position_ids=None):
        cache = DraftCache() if cache is None else cache
        B, T = input_ids.shape
        past = len(cache)
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device)[None].expand(B, T)
        cos, sin = self.rope(position_ids)
        layer = self.midlayer
        x = layer.attn_input(self.embed(input_ids), hidden)
        q = layer.self_attn.queries(x, cos, sin)
        k, v = cache.append(*layer.self_attn.keys_values(x, cos, sin))
        scores = q @ k.transpose(-1, -2) * layer.self_attn.scale
        steps = torch.arange(past + T, device=input_ids.device)
        visible = steps[None, :] <= steps[past:, None]
        attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
        h = layer.finish(layer.self_attn.merge(attn), hidden)
        return self.logits(h), h, cache


def save(model: Eagle3Draft, folder) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_json(), indent=2, sort_keys=True) + "\n")
    save_file(
        {k: v.detach().contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )


def read_config(folder) -> DraftConfig:
    """The config of the drafter saved in ``folder`` (its config.json), without its weights."""
    return DraftConfig.from_json(json.loads((Path(folder) / "config.json").read_text()))


def load(folder, target_embeddings: torch.Tensor) -> Eagle3Draft:
    model = Eagle3Draft(read_config(folder), target_embeddings)
    model.load_state_dict(load_file(str(Path(folder) / "model.safetensors")), strict=True)
    return model.eval()
