"""The EAGLE-3 drafter's training-time-test (TTT) objective: a batch of stored states, ids and loss masks in, the
weighted loss and per-step statistics out (``ttt_forward``, as a module: ``TTT``, the one a distributed run wraps).

Alignment (position t, TTT step k = 0..K-1, ids x, chain mask m):
    step 0 pairs the target's state at t with x[t+1]; step k pairs the drafter's step-(k-1) output at t with x[t+1+k]
    at RoPE position t + k, and predicts x[t+2+k], whose target distribution is the target's logits at t+1+k,
    softmaxed over the draft vocabulary.
    Loss mask of (t, k): m[t+1] & m[t+2] & .. & m[t+2+k]; it never reads past a sample. m is the sample's ``chain``
    (the loss mask, or every token under ``train.positions: all``: train.load_samples); validation always uses the
    loss mask. Positions whose target argmax is outside the draft vocabulary are left out of the loss (and count as
    misses in the accuracy).
Attention at step k: position t attends to the step-0 keys of positions <= t and to its own keys of steps 1..k.
Only "active" positions (m[t+1] & m[t+2]) run queries, the MLP and the head; every position provides step-0 keys and
values. Past ``CHUNK`` queries the scores are computed in blocks recomputed in backward.

Loss: sum_k w^k * soft cross-entropy(target distribution over the draft vocabulary, drafter), w =
``train.step_weight``, averaged per step over its positions. acc_k: share of the step's positions where the drafter's
argmax (as a target id) equals the target's argmax over the full vocabulary.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eaglepipe.drafter.eagle3 import model as draft


def chain_masks(mask: torch.Tensor, steps: int) -> torch.Tensor:
    """bool [steps, n]: (t, k) is trained when mask[t+1 .. t+2+k] are all set."""
    n = mask.shape[0]
    padded = torch.cat((mask.bool(), torch.zeros(steps + 2, dtype=torch.bool)))
    out = torch.empty(steps, n, dtype=torch.bool)
    cur = padded[1 : n + 1]
    for k in range(steps):
        cur = cur & padded[2 + k : n + 2 + k]
        out[k] = cur
    return out


def noisy(aux: torch.Tensor, width: float, keys: list, lengths: list[int]) -> torch.Tensor:
    """``aux`` [B, T, 3H] (float32, right-padded) with each layer's state x plus U(-width/2, width/2) * rms(x) per
    element (train.feature_noise). Row b's ``lengths[b]`` positions draw from a generator on aux's device seeded by
    ``keys[b]`` (train's: seed, epoch, sample), so a sample gets the same noise in any batch, at any number of
    processes and in a resumed run; padding stays zero."""
    states = aux.unflatten(-1, (3, -1))
    draws = torch.zeros_like(states)
    for row, (key, n) in enumerate(zip(keys, lengths)):
        seed = int(hashlib.sha256(repr(key).encode()).hexdigest()[:15], 16)
        generator = torch.Generator(aux.device).manual_seed(seed)
        draws[row, :n] = torch.rand(n, *states.shape[2:], generator=generator, device=aux.device) - 0.5
    return (states + draws * width * states.pow(2).mean(-1, keepdim=True).sqrt()).flatten(-2)


@torch.no_grad()
def collate(samples: list, states: list[dict], steps: int, head_draft: torch.Tensor, t2d: torch.Tensor) -> dict:
    """One batch on ``head_draft``'s device, from the samples and their ``features.STATES``: ids [B, T], aux [B, T, 3H]
    float32, target probabilities over the draft vocabulary [B, T, Vd] float32 (the logits computed in ``head_draft``'s
    dtype), target argmax ``top`` [B, T], active positions ``act`` [B, A] (padding rows point at 0), the per-step chain
    masks ``masks`` [steps, B, A] and ``kept`` [steps], the number of loss positions of each step (chain positions whose
    target argmax is in the draft vocabulary: ``t2d``)."""
    B, T = len(samples), max(s.ids.shape[0] for s in samples)
    ids = torch.zeros(B, T, dtype=torch.int64)
    top = torch.zeros(B, T, dtype=torch.int64)
    aux = torch.zeros(B, T, states[0]["aux"].shape[1])
    final = torch.zeros(B, T, states[0]["final"].shape[1], dtype=head_draft.dtype)
    chains = [chain_masks(s.chain, steps) for s in samples]
    active = [torch.nonzero(c[0]).flatten() for c in chains]
    A = max(a.numel() for a in active)
    act = torch.zeros(B, A, dtype=torch.int64)
    masks = torch.zeros(steps, B, A, dtype=torch.bool)
    for b, (s, st, c, a) in enumerate(zip(samples, states, chains, active)):
        n = s.ids.shape[0]
        ids[b, :n], top[b, :n], aux[b, :n], final[b, :n] = s.ids, st["top"], st["aux"], st["final"]
        act[b, : a.numel()] = a
        masks[:, b, : a.numel()] = c[:, a]
    dev = head_draft.device
    batch = {name: x.to(dev) for name, x in (("ids", ids), ("aux", aux), ("top", top), ("act", act), ("masks", masks))}
    batch["probs"] = torch.softmax((final.to(dev) @ head_draft.T).float(), dim=-1)
    kept = []
    for k in range(steps):
        b, a = torch.nonzero(batch["masks"][k], as_tuple=True)
        kept.append(t2d[batch["top"][b, batch["act"][b, a] + 1 + k]].sum())
    batch["kept"] = torch.stack(kept)
    return batch


CHUNK = 512
"""Queries per block of ``attention`` beyond which the blocks are recomputed in backward instead of stored."""


def _attend(q, k0, v0, act, own_k, own_v, scale):
    """Softmax attention (scores times ``scale``) of queries ``q`` [B, heads, A, d] at positions ``act`` [B, A] over
    the step-0 keys and values ``k0``, ``v0`` [B, heads, T, d] up to their own position, and over their own keys of
    steps 1..k ``own_k``, ``own_v`` [B, heads, A, k, d] (None at step 0)."""
    T = k0.shape[-2]
    future = torch.arange(T, device=q.device)[None, None, None, :] > act[:, None, :, None]
    scores = (q @ k0.transpose(-1, -2) * scale).masked_fill(future, float("-inf"))  # [B, heads, A, T]
    if own_k is None:
        return torch.softmax(scores, -1) @ v0
    own = (q[..., None, :] * own_k).sum(-1) * scale  # [B, heads, A, k]
    p = torch.softmax(torch.cat((scores, own), -1), -1)
    return p[..., :T] @ v0 + (p[..., T:, None] * own_v).sum(-2)


def attention(q, k0, v0, act, own_k, own_v, scale):
    """``_attend``; past ``CHUNK`` queries in blocks of ``CHUNK``, each block's scores recomputed in backward
    (``torch.utils.checkpoint``) rather than kept: the same values within float rounding."""
    A, chunk = q.shape[-2], CHUNK
    if chunk >= A:
        return _attend(q, k0, v0, act, own_k, own_v, scale)
    blocks = []
    for i in range(0, A, chunk):
        part = slice(i, i + chunk)
        own = (own_k[:, :, part], own_v[:, :, part]) if own_k is not None else (None, None)
        blocks.append(checkpoint(_attend, q[:, :, part], k0, v0, act[:, part], *own, scale, use_reentrant=False))
    return torch.cat(blocks, 2)


def ttt_forward(model: draft.Eagle3Draft, batch: dict, steps: int, step_weight: float = 1.0, per_row: bool = False):
    """(loss, stats [steps, 4] = loss sum, loss positions, correct, positions) for one batch, and with ``per_row``
    the correct and positions of each row [steps, B, 2] third. Step k's loss is its sum over the batch divided by
    ``batch["norm"][k]`` (default: the batch's own loss positions, ``kept``), times ``batch["weight"]`` (default 1)
    and ``step_weight ** k`` (the stats are not weighted)."""
    ids, act, masks = batch["ids"], batch["act"], batch["masks"]
    norm, weight = batch.get("norm", batch["kept"].tolist()), batch.get("weight", 1.0)
    B, T = ids.shape
    dev = ids.device
    rows = torch.arange(B, device=dev)[:, None]
    layer, attn = model.midlayer, model.midlayer.self_attn

    g = model.project(batch["aux"])  # [B, T, H]
    x0 = layer.attn_input(model.embed(torch.cat((ids[:, 1:], torch.zeros_like(ids[:, :1])), 1)), g)
    k0, v0 = attn.keys_values(x0, *model.rope(torch.arange(T, device=dev)[None].expand(B, T)))  # step-0 keys
    h, x = g[rows, act], x0[rows, act]
    diag, total, stats, rows_hit = [], 0.0, [], []
    for k in range(steps):
        cos, sin = model.rope(act + k)
        if k:
            x = layer.attn_input(model.embed(ids[rows, (act + 1 + k).clamp(max=T - 1)]), h)
        q = attn.queries(x, cos, sin)  # before the keys: autograd's node order fixes backward's sums
        if k:
            diag.append(attn.keys_values(x, cos, sin))  # this step's own keys and values
        own = [torch.stack(d, -2) for d in zip(*diag)] if k else (None, None)  # [B, heads, A, k, d]
        out = attention(q, k0, v0, act, *own, attn.scale)
        h = layer.finish(attn.merge(out), h)

        b, a = torch.nonzero(masks[k], as_tuple=True)
        t = act[b, a] + 1 + k  # the target's position whose logits predict x[act + 2 + k]
        logits = model.logits(h[b, a])
        target = batch["top"][b, t]
        keep = model.t2d[target]
        ce = -(batch["probs"][b, t] * torch.log_softmax(logits, -1)).sum(-1)[keep]
        loss = ce.sum() / max(norm[k], 1)
        total = total + step_weight**k * (loss * weight)
        hit = model.to_target(logits.argmax(-1)) == target
        stats.append(
            torch.stack(
                [
                    ce.detach().sum(),
                    ce.new_tensor(float(ce.numel())),
                    hit.sum().float(),
                    ce.new_tensor(float(b.numel())),
                ]
            )
        )
        if per_row:
            rows_hit.append(
                torch.stack([torch.bincount(b, hit.float(), B), torch.bincount(b, minlength=B).float()], -1)
            )
    return (total, torch.stack(stats)) + ((torch.stack(rows_hit),) if per_row else ())


class TTT(nn.Module):
    """The drafter with its objective, the module DDP wraps: ``forward(batch)`` is ``ttt_forward``'s (loss, stats)."""

    def __init__(self, model: draft.Eagle3Draft, steps: int, step_weight: float):
        super().__init__()
        self.draft, self.steps, self.step_weight = model, steps, step_weight

    def forward(self, batch: dict):
        return ttt_forward(self.draft, batch, self.steps, self.step_weight)
