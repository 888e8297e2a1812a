"""The DFlash drafter (block drafting: Chen et al., "DFlash", arXiv:2602.06036; z-lab's reference), as vLLM 0.32's
``qwen3_dflash.py`` computes it. Its config and config.json: dflash/config.py.

A block after the last committed position P (its ids ``[bonus, mask, .., mask]`` at positions P+1 .. P+1+K)::

    c = hidden_norm(fc(aux))                 the context, one row per committed position (aux [.., 3H] -> [.., H])
    h = embed(ids)
    per layer (Qwen3's):
        x = input_layernorm(h)
        q, k, v of x (q_norm, k_norm per head; RoPE at the block's positions); the context's k, v: the same
        projections of c (RoPE at the context's positions), no norm before them
        h = h + o_proj(attention(q over the context's positions <= P and the whole block: no causal mask in it))
        h = h + mlp(post_attention_layernorm(h))
    draft i = argmax lm_head(norm(h[i])), i = 1..K: the token at position P+1+i (no shift)

The context depends only on the target's states, so its keys and values are computed once per position and kept
(``context_kv``); blocks read them and never write them. ``embed_tokens`` is the target's (frozen, not saved), as in
EAGLE-3 (eagle3/model.py's ``DraftBase``: vocabulary, RoPE, head).

Checkpoint: ``model.safetensors`` holds ``fc``, ``hidden_norm``, ``layers.{i}.{input_layernorm,
post_attention_layernorm}``, ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.self_attn.{q,k}_norm``,
``layers.{i}.mlp.{gate,up,down}_proj``, ``norm``, ``lm_head`` (``<name>.weight``, float32), ``d2t``, ``t2d``: the names
vLLM loads (it prefixes ``model.``; it skips ``t2d``).
"""

from __future__ import annotations

import torch
from torch import nn

from eaglepipe.drafter.dflash.config import DFlashConfig
from eaglepipe.drafter.eagle3.attention import Attention, RMSNorm
from eaglepipe.drafter.eagle3.model import MLP, DraftBase, check_embeddings


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg, inputs=1)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def block_attention(q, k, v, context_k, context_v, visible, size: int, scale: float):
    """Softmax attention of block queries ``q`` [B, heads, N * size, d] (N blocks of ``size``) over the context's keys
    and values [B, heads, T, d] where ``visible`` [B, N, T] and over their own block's keys and values ``k``, ``v``
    (like ``q``), every one of them."""
    T = context_k.shape[2]
    scores = (q @ context_k.transpose(-1, -2) * scale).unflatten(2, (-1, size))  # [B, heads, N, size, T]
    scores = scores.masked_fill(~visible[:, None, :, None, :], float("-inf"))
    blocks = [x.unflatten(2, (-1, size)) for x in (q, k, v)]  # [B, heads, N, size, d]
    own = blocks[0] @ blocks[1].transpose(-1, -2) * scale  # [B, heads, N, size, size]
    p = torch.softmax(torch.cat((scores, own), -1), -1)
    out = (p[..., :T].flatten(2, 3) @ context_v).unflatten(2, (-1, size)) + p[..., T:] @ blocks[2]
    return out.flatten(2, 3)


class DFlashDraft(DraftBase):
    def __init__(self, cfg: DFlashConfig, embed_tokens: torch.Tensor):
        super().__init__()
        check_embeddings(cfg, embed_tokens)
        self.cfg = cfg
        self.aux_layers = list(cfg.aux_layers)
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self._register_shared(cfg, embed_tokens)

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list:
        """Per layer, the context's keys and values [B, heads, T, d] from the aux states [B, T, 3H] (any float dtype)
        at ``positions`` [B, T]."""
        context = self.hidden_norm(self.fc(aux.float()))
        cos, sin = self.rope(positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def block(self, ids, positions, context_kv: list, visible) -> torch.Tensor:
        """The last layer's output [B, N, size, H] of N blocks: ``ids``, ``positions`` [B, N, size]; each block
        attends to the context positions where ``visible`` [B, N, T] and to all of itself."""
        size = ids.shape[2]
        h = self.embed(ids.flatten(1, 2))
        cos, sin = self.rope(positions.flatten(1, 2))
        for layer, (context_k, context_v) in zip(self.layers, context_kv):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.queries(x, cos, sin)
            k, v = attn.keys_values(x, cos, sin)
            out = block_attention(q, k, v, context_k, context_v, visible, size, attn.scale)
            h = h + attn.o_proj(attn.merge(out))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h.unflatten(1, (-1, size))

    def block_ids(self, bonus: torch.Tensor, drafts: int) -> torch.Tensor:
        """[*bonus.shape, 1 + drafts]: each bonus token followed by ``drafts`` mask tokens."""
        ids = torch.full((*bonus.shape, 1 + drafts), self.cfg.mask_token_id, dtype=torch.long, device=bonus.device)
        ids[..., 0] = bonus
        return ids
