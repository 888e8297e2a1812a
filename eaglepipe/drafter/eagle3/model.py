"""The EAGLE-3 drafter: module, draft vocabulary, and the checkpoint SGLang and vLLM load (its config:
eagle3/config.py; its attention variants: eagle3/attention.py; its init from the target's weights: eagle3/init.py).

One decoder layer over the target's features (as SafeAILab/EAGLE ``traineagle3/cnets.py``, SGLang
``models/llama_eagle3.py``)::

    g  = fc(aux)                                    aux = cat(low, mid, high) [.., 3H] -> g [.., H]
    x  = cat(input_layernorm(embed(token)), hidden_norm(h))       [.., 2H]   (h = g at step 0)
    a  = h + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))   q/k/v take 2H inputs; RoPE; GQA
                                            (qwen3: RMS norms q_norm, k_norm on each head before RoPE;
                                             deepseek_mla: DeepSeek's MLA, ``attention.MLAttention``)
    h' = a + mlp(post_attention_layernorm(a))                     pre-norm output, fed back as h
                                            (EAGLE-3.1: fc_norm's norm per aux state before fc; norm_output
                                             feeds back norm(h'))
    draft_logits = lm_head(norm(h'))                               [.., draft_vocab_size]

``embed_tokens`` is the target's input embedding: a frozen, non-persistent buffer, neither trained nor saved (the
engines supply it). Everything is float32.

Inference (chain drafting, top-1, batch rows share one length)::

    model = methods.load("models/draft", target_embeddings)   # in eval mode; target_embeddings [V, H]
    model.aux_layers                   # HF output_hidden_states indices to concatenate (low, mid, high)
    g = model.project(aux)             # aux [B, T, 3H] (any float dtype) -> [B, T, H] float32
    logits, h_out, cache = model(input_ids, hidden, cache=None, position_ids=None)
        input_ids [B, T] target ids; hidden [B, T, H] (project(aux) or a previous h_out); cache a DraftCache (None
        starts one); position_ids default to len(cache) + arange(T)
        -> logits [B, T, draft_vocab_size] float32, h_out [B, T, H] fed_back(h'), cache (the same object, extended by T)
    model.to_target(draft_ids)         # target ids: draft_id + d2t[draft_id]
    cache.crop(n); len(cache)          # keep the first n positions / number of positions held

Alignment (as in training): the target's state at t is paired with token t + 1, and the drafter's output there
predicts token t + 2. A position id is its hidden state's: t for the target's state at t, t + k at draft step k of a
chain from it, so len(cache) is always the next position id.

Chain drafting (evaluate/decode.py's ``EagleDrafter``): after a prefill of x_0..x_{n-1} and the target's next token
x_n, extend with x[1..n] paired with project(aux[0..n-1]); each draft step feeds ``to_target(logits[:, -1].argmax(-1))``
with ``h[:, -1:]``; after verification (m drafts accepted, plus the bonus token) ``cache.crop(n)`` drops the chain and
x_{n+1}..x_{n+m+1} paired with project(aux[n..n+m]) extend it.

Parallel drafting (``cfg.parallel``, vLLM's ``parallel_drafting``): the first draft is the extend's last logits as
above; drafts 2..K are those of K - 1 mask slots (``mask_slot``: the mask token paired with project(mask_hidden)) at
the next positions, in the same causal attention, all in one forward (``parallel_drafts``), cropped on ``accept``.

Draft vocabulary: the N most frequent loss-masked token ids, sorted ascending (ties: lower id first), padded with the
lowest unused ids when the data has fewer. ``d2t`` int64 [N]: target_id = draft_id + d2t[draft_id]; ``t2d`` bool [V]:
whether a target id is in the draft vocabulary.

Checkpoint (``save``; ``drafter/methods.load``): ``model.safetensors`` holds exactly the float32 ``fc``, ``norm``,
``lm_head``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}``, ``midlayer.mlp.{gate,up,down}_proj``,
``midlayer.self_attn.{q,k,v,o}_proj`` weights (``<name>.weight``; qwen3: and ``self_attn.{q,k}_norm``; deepseek_mla,
in place of q/k/v, DeepSeek's ``self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,
kv_b_proj}``; EAGLE-3.1's ``fc_norm``: ``fc_norm.{0,1,2}``; parallel drafting's ``mask_hidden`` [3H], no
``.weight``), ``d2t`` (int64) and ``t2d`` (bool). Its
``config.json``: eagle3/config.py.
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from eaglepipe.drafter.eagle3.attention import (
    Attention,
    MLAttention,
    RMSNorm,
)
from eaglepipe.drafter.eagle3.config import DraftConfig


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


class DraftBase(nn.Module):
    """What every drafter has beside its layers: the target's frozen embedding, RoPE, the draft vocabulary (``d2t``,
    ``t2d``) and the head (``norm``, ``lm_head``: the subclass's)."""

    def _register_shared(self, cfg: DraftConfig, embed_tokens: torch.Tensor) -> None:
        """The vocabulary buffers, the embedding and RoPE (no random draws: the subclass's init order stands)."""
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("embed_tokens", embed_tokens.detach().float().clone(), persistent=False)
        rope_cfg = LlamaConfig(
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(cfg.rope_parameters),
        )
        self.rotary = LlamaRotaryEmbedding(rope_cfg)  # buffers only (not persistent)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor):
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def embed(self, input_ids):
        return F.embedding(input_ids, self.embed_tokens)

    def rope(self, position_ids):
        """cos, sin [B, T, head_dim] for position ids [B, T] (or [T])."""
        position_ids = position_ids if position_ids.dim() == 2 else position_ids[None]
        return self.rotary(self.embed_tokens, position_ids)

    def logits(self, h):
        """Draft logits from the last layer's pre-norm output ``h``."""
        return self.lm_head(self.norm(h))

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


def check_embeddings(cfg: DraftConfig, embed_tokens: torch.Tensor) -> None:
    if tuple(embed_tokens.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"target embeddings {tuple(embed_tokens.shape)} do not match the config "
            f"({cfg.vocab_size}, {cfg.hidden_size})"
        )


class Eagle3Draft(DraftBase):
    def __init__(self, cfg: DraftConfig, embed_tokens: torch.Tensor):
        super().__init__()
        check_embeddings(cfg, embed_tokens)
        self.cfg = cfg
        self.aux_layers = list(cfg.aux_layers)
        H = cfg.hidden_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        if cfg.fc_norm:  # EAGLE-3.1 (eagle3/config.py)
            self.fc_norm = nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in cfg.aux_layers)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self._register_shared(cfg, embed_tokens)
        if cfg.parallel:  # the aux states of every mask slot (parallel drafting); drawn last: the rest as EAGLE-3's
            self.mask_hidden = nn.Parameter(torch.randn(len(cfg.aux_layers) * H) * 0.02)

    def project(self, aux):
        """The aux states [.., 3H] (any float dtype) -> fc's output [.., H] float32 (EAGLE-3.1's ``fc_norm``: each
        state normed first)."""
        aux = aux.float()
        if self.cfg.fc_norm:
            states = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(state) for norm, state in zip(self.fc_norm, states)], dim=-1)
        return self.fc(aux)

    def fed_back(self, h):
        """The state the next draft step reads from the layer's pre-norm output ``h``: ``h`` itself, or its final
        norm's output under EAGLE-3.1's ``norm_output`` (vLLM's ``aux_output``)."""
        return self.norm(h) if self.cfg.norm_output else h

    def mask_slot(self, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, hidden) of mask slots filling ``shape`` (parallel drafting): the mask token and
        ``project(mask_hidden)``, [*shape] and [*shape, H]."""
        ids = torch.full(shape, self.cfg.mask_token_id, dtype=torch.long, device=self.mask_hidden.device)
        return ids, self.project(self.mask_hidden).expand(*shape, -1)

    def parallel_drafts(self, n: int, cache: DraftCache) -> torch.Tensor:
        """Draft logits [1, n, draft_vocab_size] of ``n`` mask slots after the positions in ``cache``; they extend
        ``cache`` (crop it after)."""
        ids, hidden = self.mask_slot((1, n))
        return self(ids, hidden, cache)[0]

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
        return self.logits(h), self.fed_back(h), cache


def save(model: Eagle3Draft, folder) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_json(), indent=2, sort_keys=True) + "\n")
    save_file(
        {k: v.detach().contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
