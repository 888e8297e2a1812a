"""The EAGLE-3 drafter's attention variants over the 2H input (``cat(embedding, hidden state)``, model.py), with
the RMS norm and the RoPE layouts they use: ``Attention``, Llama's (grouped-query; with ``DraftConfig.qk_norm``
Qwen3's, an RMS norm on each head's q and k before RoPE), and ``MLAttention``, DeepSeek's multi-head latent
attention. Both give queries, keys and values per head (``queries``, ``keys_values``) for the caller's own softmax
(``Eagle3Draft.forward`` with its cache; training: ``ttt.attention``), and ``merge`` the heads again."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from eaglepipe.drafter.eagle3.config import DraftConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate(x, cos, sin):
    """RoPE (HF's rotate-half layout); cos/sin [B, T, head_dim] broadcast over heads of x [B, heads, T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def rotate_pairs(x, cos, sin):
    """RoPE over interleaved pairs (x0, x1), (x2, x3), .. (DeepSeek's layout; vLLM's ``is_neox_style=False``), the
    result in rotate-half order: query-key products equal the interleaved rotation's."""
    return rotate(x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2), cos, sin)


def yarn_mscale(rope: dict) -> float:
    """YaRN's attention factor on MLA's softmax scale, applied twice (DeepSeek's ``mscale_all_dim``; 1 without)."""
    factor, m = rope.get("factor", 1.0), rope.get("mscale_all_dim", 0)
    return (
        0.1 * m * math.log(factor) + 1.0 if rope.get("rope_type", "default") != "default" and m and factor > 1 else 1.0
    )


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, inputs: int = 2):
        """``inputs``: the input's width in hidden sizes (EAGLE-3's 2H; DFlash's layers read H)."""
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.scale = 1.0 / math.sqrt(d)  # softmax scale
        self.q_proj = nn.Linear(inputs * H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(inputs * H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(inputs * H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def _split(self, y, heads):
        return y.view(*y.shape[:2], heads, self.head_dim).transpose(1, 2)

    def queries(self, x, cos, sin):
        """[B, heads, T, d], rotated."""
        return rotate(self.q_norm(self._split(self.q_proj(x), self.heads)), cos, sin)

    def keys_values(self, x, cos, sin):
        """Keys (rotated) and values [B, heads, T, d], the KV heads already repeated for grouped-query attention."""
        rep = self.heads // self.kv_heads
        k = rotate(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), cos, sin)
        v = self._split(self.v_proj(x), self.kv_heads)
        return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def merge(self, out):
        """[B, heads, T, d] -> [B, T, heads * d]."""
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


class MLAttention(nn.Module):
    """Multi-head latent attention over the 2H input, as vLLM's ``DeepseekV2MLAAttention`` computes it: queries
    through q_a_proj, an RMS norm and q_b_proj; keys and values through the latent (kv_a_proj_with_mqa, an RMS norm,
    kv_b_proj); RoPE (``rotate_pairs``) on the last qk_rope_head_dim of each query head and on one shared rope key;
    softmax scale (qk_nope + qk_rope head dims) ** -0.5 times YaRN's mscale squared. Keys and values are expanded per
    head."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, m, eps = cfg.hidden_size, cfg.mla, cfg.rms_norm_eps
        self.heads, self.nope, self.rope_dim, self.v_dim = (
            cfg.num_attention_heads,
            m["qk_nope_head_dim"],
            m["qk_rope_head_dim"],
            m["v_head_dim"],
        )
        self.kv_rank = m["kv_lora_rank"]
        self.q_a_proj = nn.Linear(2 * H, m["q_lora_rank"], bias=False)
        self.q_a_layernorm = RMSNorm(m["q_lora_rank"], eps)
        self.q_b_proj = nn.Linear(m["q_lora_rank"], self.heads * (self.nope + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, H, bias=False)
        self.scale = (self.nope + self.rope_dim) ** -0.5 * yarn_mscale(cfg.rope_parameters) ** 2

    def queries(self, x, cos, sin):
        """[B, heads, T, nope + rope], the rope part rotated."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(*x.shape[:2], self.heads, -1).transpose(1, 2).split([self.nope, self.rope_dim], -1)
        return torch.cat((q_nope, rotate_pairs(q_rope, cos, sin)), -1)

    def keys_values(self, x, cos, sin):
        """Keys [B, heads, T, nope + rope] (the shared rope key rotated) and values [B, heads, T, v_head_dim]."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(*x.shape[:2], self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        k_rope = rotate_pairs(k_rope[:, None], cos, sin).expand(-1, self.heads, -1, -1)
        return torch.cat((k_nope, k_rope), -1), v

    merge = Attention.merge  # [B, heads, T, v_head_dim] -> [B, T, heads * v_head_dim]
