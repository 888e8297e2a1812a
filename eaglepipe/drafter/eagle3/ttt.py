"""The EAGLE-3 drafter's training-time-test (TTT) objective: a ``Batch`` of stored states, ids and loss masks in
(``collate``), the weighted loss and the per-step statistics (``StepStats``) out (``ttt_forward``, as a module:
``TTT``, the one a distributed run wraps).

Alignment (position t, TTT step k = 0..K-1, ids x, chain mask m):
    step 0 pairs the target's state at t with x[t+1]; step k pairs the drafter's step-(k-1) output at t with x[t+1+k]
    at RoPE position t + k, and predicts x[t+2+k], whose target distribution is the target's logits at t+1+k,
    softmaxed over the draft vocabulary.
    Loss mask of (t, k): m[t+1] & m[t+2] & .. & m[t+2+k]; it never reads past a sample. m is the sample's ``chain``
    (the loss mask, or every token under ``train.positions: all``: sources.load_samples); validation always uses the
    loss mask. Positions whose target argmax is outside the draft vocabulary are left out of the loss (and count as
    misses in the accuracy).
Parallel drafting (the drafter's ``cfg.parallel``): step k >= 1 at t reads a mask slot (``Eagle3Draft.mask_slot``:
the mask token and project(mask_hidden), also its residual) instead of x[t+1+k] and the fed-back output, as vLLM's
parallel_drafting runs the K - 1 slots after the last committed position; its targets, masks and attention are the
same. (P-EAGLE's speculators recipe trains a random subset of the positions at each depth with a KL loss and learns
the mask token's embedding; here every chain position at every step, with the loss below and the target's embedding.)
Attention at step k: position t attends to the step-0 keys of positions <= t and to its own keys of steps 1..k.
Only "active" positions (m[t+1] & m[t+2]) run queries, the MLP and the head; every position provides step-0 keys and
values. Past ``CHUNK`` queries the scores are computed in blocks recomputed in backward.

Loss: sum_k w^k * soft cross-entropy(target distribution over the draft vocabulary, drafter), w =
``train.step_weight``, averaged per step over its positions. acc_k: share of the step's positions where the drafter's
argmax (as a target id) equals the target's argmax over the full vocabulary.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eaglepipe.drafter.eagle3.model import Eagle3Draft


@dataclass(frozen=True)
class Batch:
    """One batch on the training device (``collate``), its rows right-padded to T tokens and A active positions."""

    ids: torch.Tensor  # int64 [B, T]
    aux: torch.Tensor  # float32 [B, T, 3H]: the target's states of the aux layers (low, mid, high), concatenated
    top: torch.Tensor  # int64 [B, T]: the target's argmax over the full vocabulary
    act: torch.Tensor  # int64 [B, A]: the active positions (padding rows point at 0)
    masks: torch.Tensor  # bool [steps, B, A]: the chain masks of the active positions, per step
    probs: torch.Tensor  # float32 [B, T, Vd]: the target's distribution over the draft vocabulary
    kept: torch.Tensor  # int64 [steps]: the loss positions, the chain positions whose target is in the draft vocab
    norm: list | None = None  # each step's loss divisor (train: the global batch's ``kept``); None: ``kept``
    weight: float = 1.0  # the loss's factor (train: the world size, 0 for a rank's stand-in row)


@dataclass
class StepStats:
    """Per TTT step, float32 [steps] each: ``loss`` (the soft cross-entropy summed over the step's loss positions),
    ``loss_positions``, ``correct`` (positions where the drafter's argmax is the target's) and ``positions``. With
    ``ttt_forward``'s ``per_row`` also ``row_correct`` and ``row_positions`` [steps, B], per row of the batch (a sum
    of several batches' stats has none)."""

    loss: torch.Tensor
    loss_positions: torch.Tensor
    correct: torch.Tensor
    positions: torch.Tensor
    row_correct: torch.Tensor | None = None
    row_positions: torch.Tensor | None = None

    @classmethod
    def zeros(cls, steps: int) -> StepStats:
        return cls.from_table(torch.zeros(steps, 4))

    @classmethod
    def from_table(cls, table: torch.Tensor) -> StepStats:
        """The stats whose ``table()`` is ``table``."""
        return cls(*table.unbind(-1))

    @classmethod
    def stacked(cls, per_step: list[StepStats]) -> StepStats:
        """The stats of several steps, each step's own (sums 0-dim, per-row counts [B]) in order."""
        columns = {}
        for f in fields(cls):
            values = [getattr(s, f.name) for s in per_step]
            columns[f.name] = None if values[0] is None else torch.stack(values)
        return cls(**columns)

    def table(self) -> torch.Tensor:
        """float32 [steps, 4]: loss, loss positions, correct, positions; the layout the ranks add up and a checkpoint
        holds."""
        return torch.stack((self.loss, self.loss_positions, self.correct, self.positions), -1)

    def __add__(self, other: StepStats) -> StepStats:
        """The sums of both, step by step (without per-row counts)."""
        return StepStats(
            self.loss + other.loss,
            self.loss_positions + other.loss_positions,
            self.correct + other.correct,
            self.positions + other.positions,
        )

    def cpu(self) -> StepStats:
        here = {f.name: getattr(self, f.name) for f in fields(self)}
        return StepStats(**{name: None if x is None else x.cpu() for name, x in here.items()})

    def summary(self) -> list[dict]:
        """[{step, loss, acc}], one per TTT step: the mean loss and the accuracy (None where the step had no
        positions)."""
        return [
            {
                "step": k,
                "loss": round(loss / n_loss, 5) if n_loss else None,
                "acc": round(correct / n, 5) if n else None,
            }
            for k, (loss, n_loss, correct, n) in enumerate(
                zip(self.loss.tolist(), self.loss_positions.tolist(), self.correct.tolist(), self.positions.tolist())
            )
        ]


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
def collate(samples: list, states: list[dict], steps: int, head_draft: torch.Tensor, t2d: torch.Tensor) -> Batch:
    """The ``Batch`` of ``samples`` and their states (hidden/layout.py's ``STATES``) on ``head_draft``'s device, the
    target's logits computed in ``head_draft``'s dtype; ``t2d`` is the draft vocabulary (``Eagle3Draft.t2d``)."""
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
    ids, aux, top, act, masks = (x.to(dev) for x in (ids, aux, top, act, masks))
    probs = torch.softmax((final.to(dev) @ head_draft.T).float(), dim=-1)
    kept = []
    for k in range(steps):
        b, a = torch.nonzero(masks[k], as_tuple=True)
        kept.append(t2d[top[b, act[b, a] + 1 + k]].sum())
    return Batch(ids=ids, aux=aux, top=top, act=act, masks=masks, probs=probs, kept=torch.stack(kept))


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


def _step_zero(model: Eagle3Draft, batch: Batch) -> tuple:
    """(k0, v0, h, x): the step-0 keys and values of every position [B, heads, T, d], and at the active positions
    the projected states h [B, A, H] and step 0's attention input x [B, A, 2H]."""
    ids, act = batch.ids, batch.act
    B, T = ids.shape
    dev = ids.device
    rows = torch.arange(B, device=dev)[:, None]
    layer, attn = model.midlayer, model.midlayer.self_attn
    g = model.project(batch.aux)  # [B, T, H]
    x0 = layer.attn_input(model.embed(torch.cat((ids[:, 1:], torch.zeros_like(ids[:, :1])), 1)), g)
    k0, v0 = attn.keys_values(x0, *model.rope(torch.arange(T, device=dev)[None].expand(B, T)))  # step-0 keys
    return k0, v0, g[rows, act], x0[rows, act]


def _draft_step(model: Eagle3Draft, batch: Batch, k: int, h, x, k0, v0, own_kv: list) -> torch.Tensor:
    """The drafter's step-``k`` output [B, A, H] at the active positions from its step-(k-1) output ``h`` (step 0:
    the projected states, and ``x`` its attention input; parallel drafting: a mask slot past step 0). Past step 0, the
    step's own keys and values are appended to ``own_kv``."""
    ids, act = batch.ids, batch.act
    B, T = ids.shape
    rows = torch.arange(B, device=ids.device)[:, None]
    layer, attn = model.midlayer, model.midlayer.self_attn
    cos, sin = model.rope(act + k)
    if k:
        if model.cfg.parallel:
            tokens, h = model.mask_slot(act.shape)
        else:
            tokens = ids[rows, (act + 1 + k).clamp(max=T - 1)]
        x = layer.attn_input(model.embed(tokens), h)
    q = attn.queries(x, cos, sin)  # before the keys: autograd's node order fixes backward's sums
    if k:
        own_kv.append(attn.keys_values(x, cos, sin))  # this step's own keys and values
    own = [torch.stack(d, -2) for d in zip(*own_kv)] if k else (None, None)  # [B, heads, A, k, d]
    out = attention(q, k0, v0, act, *own, attn.scale)
    return layer.finish(attn.merge(out), h)


def _step_stats(model: Eagle3Draft, logits, target, ce, b, rows: int | None) -> StepStats:
    """One step's stats (0-dim sums), from the drafter's ``logits`` at its chain positions (in rows ``b``), the
    target's argmax there and the cross-entropy ``ce`` of its loss positions; with ``rows``, per row of the batch."""
    hit = model.to_target(logits.argmax(-1)) == target
    return StepStats(
        loss=ce.detach().sum(),
        loss_positions=ce.new_tensor(float(ce.numel())),
        correct=hit.sum().float(),
        positions=ce.new_tensor(float(b.numel())),
        row_correct=None if rows is None else torch.bincount(b, hit.float(), rows),
        row_positions=None if rows is None else torch.bincount(b, minlength=rows).float(),
    )


def ttt_forward(
    model: Eagle3Draft, batch: Batch, steps: int, step_weight: float = 1.0, per_row: bool = False
) -> tuple[torch.Tensor, StepStats]:
    """(loss, stats) for one batch, the stats with their per-row counts under ``per_row``. Step k's loss is its sum
    over the batch divided by ``batch.norm[k]`` (``batch.kept[k]`` without a norm), times ``batch.weight`` and
    ``step_weight ** k`` (the stats are not weighted)."""
    norm = batch.kept.tolist() if batch.norm is None else batch.norm
    weight = batch.weight
    k0, v0, h, x = _step_zero(model, batch)
    own_kv, total, per_step = [], 0.0, []
    for k in range(steps):
        out = _draft_step(model, batch, k, h, x, k0, v0, own_kv)
        h = model.fed_back(out)
        ce_sum, stats = step_loss(model, batch, k, out, per_row)
        loss = ce_sum / max(norm[k], 1)
        total = total + step_weight**k * (loss * weight)
        per_step.append(stats)
    return total, StepStats.stacked(per_step)


def step_loss(model, batch: Batch, k: int, out: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, StepStats]:
    """(the soft cross-entropy summed over step ``k``'s loss positions, its stats) from the drafter's last-layer output
    ``out`` [B, A, H] at the active positions; step k at position t predicts x[t + 2 + k]."""
    b, a = torch.nonzero(batch.masks[k], as_tuple=True)
    t = batch.act[b, a] + 1 + k  # the target's position whose logits predict x[act + 2 + k]
    logits = model.logits(out[b, a])
    target = batch.top[b, t]
    keep = model.t2d[target]
    ce = -(batch.probs[b, t] * torch.log_softmax(logits, -1)).sum(-1)[keep]
    return ce.sum(), _step_stats(model, logits, target, ce, b, batch.ids.shape[0] if per_row else None)


class TTT(nn.Module):
    """The drafter with its objective (``ttt_forward``'s signature; DFlash's: dflash/objective.py), the module DDP
    wraps: ``forward(batch)`` is the objective's (loss, stats)."""

    def __init__(self, model: nn.Module, steps: int, step_weight: float, objective=ttt_forward):
        super().__init__()
        self.draft, self.steps, self.step_weight, self.objective = model, steps, step_weight, objective

    def forward(self, batch: Batch) -> tuple[torch.Tensor, StepStats]:
        return self.objective(self.draft, batch, self.steps, self.step_weight)
