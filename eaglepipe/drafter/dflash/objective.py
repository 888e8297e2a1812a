"""DFlash's training objective over the batches EAGLE-3's TTT trains on (eagle3/ttt.py's ``Batch``: the same states,
active positions, chain masks and targets), so one ``make hidden`` feeds both.

Each active position t is an anchor: the block after it, ``[x[t+1], mask x K]`` at positions t+1 .. t+1+K (K =
``train.ttt_steps``), attends to the context of positions <= t (hidden_norm(fc(aux)), dflash/model.py) and to all of
itself, as vLLM drafts after the last committed position t. Block row k+1 predicts x[t+2+k], EAGLE-3's step k: the
same target distribution (the target's at t+1+k over the draft vocabulary), loss mask and ``step_weight ** k``
weighting (the DFlash recipe's exp(-(k-1)/gamma) is step_weight = exp(-1/gamma)), and the same statistics per step.
The published recipes (SpecForge, speculators) sample up to 512 anchors a sequence; here every chain position is one.
Blocks past ``CHUNK`` queries are computed in groups recomputed in backward (``torch.utils.checkpoint``).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from eaglepipe.drafter.dflash.model import DFlashDraft
from eaglepipe.drafter.eagle3.ttt import CHUNK, Batch, StepStats, step_loss


def blocks(model: DFlashDraft, ids, positions, context_kv: list, visible) -> torch.Tensor:
    """``model.block`` over N blocks [B, N, size], past ``CHUNK`` queries in groups recomputed in backward."""
    group = max(1, CHUNK // ids.shape[2])
    if ids.shape[1] <= group:
        return model.block(ids, positions, context_kv, visible)
    parts = []
    for i in range(0, ids.shape[1], group):
        part = slice(i, i + group)
        args = (ids[:, part], positions[:, part], context_kv, visible[:, part])
        parts.append(checkpoint(model.block, *args, use_reentrant=False))
    return torch.cat(parts, 1)


def dflash_forward(
    model: DFlashDraft, batch: Batch, steps: int, step_weight: float = 1.0, per_row: bool = False
) -> tuple[torch.Tensor, StepStats]:
    """(loss, stats) for one batch, as eagle3/ttt.py's ``ttt_forward`` (the same normalisation and weights)."""
    norm = batch.kept.tolist() if batch.norm is None else batch.norm
    B, T = batch.ids.shape
    device = batch.ids.device
    positions = torch.arange(T, device=device)[None].expand(B, T)
    context_kv = model.context_kv(batch.aux, positions)
    rows = torch.arange(B, device=device)[:, None]
    bonus = batch.ids[rows, (batch.act + 1).clamp(max=T - 1)]  # [B, A]
    block_positions = batch.act[..., None] + 1 + torch.arange(steps + 1, device=device)
    visible = positions[:, None, :] <= batch.act[..., None]  # [B, A, T]
    out = blocks(model, model.block_ids(bonus, steps), block_positions, context_kv, visible)
    total, per_step = 0.0, []
    for k in range(steps):
        ce_sum, stats = step_loss(model, batch, k, out[:, :, 1 + k], per_row)
        total = total + step_weight**k * (ce_sum / max(norm[k], 1) * batch.weight)
        per_step.append(stats)
    return total, StepStats.stacked(per_step)
