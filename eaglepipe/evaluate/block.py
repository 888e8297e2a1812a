"""Block drafting with a trained DFlash drafter (dflash/model.py), as vLLM's ``dflash`` runs it: after the last
committed position P, one non-causal forward over ``[bonus, mask x K]`` at positions P+1 .. P+1+K, reading the
context keys and values of positions 0..P, gives K drafts. K is the served ``num_speculative_tokens`` (evaluate's
``num_steps``), always the whole block: a block of fewer masks would attend differently, so near the end of an answer
the first k of the K drafts are proposed. The context's keys and values are computed once per committed position."""

from __future__ import annotations

import torch

from eaglepipe.drafter.dflash.model import DFlashDraft


class BlockDrafter:
    """decode.py's drafter interface for a ``DFlashDraft``."""

    needs_hidden = True

    def __init__(self, model: DFlashDraft, num_steps: int):
        self.model = model
        self.num_steps = num_steps
        self.layers = list(model.aux_layers)
        self.context_kv = None  # per layer, keys and values [1, heads, committed, d]
        self.committed = 0
        self.bonus = None  # the target's token after the last committed one
        self.last: list[int] = []

    def _extend(self, aux: torch.Tensor) -> None:
        """Adds the context of the next committed positions, their aux states [n, 3H]."""
        positions = torch.arange(self.committed, self.committed + aux.shape[0], device=aux.device)[None]
        new = self.model.context_kv(aux[None], positions)
        if self.context_kv is not None:
            new = [(torch.cat((k, k2), 2), torch.cat((v, v2), 2)) for (k, v), (k2, v2) in zip(self.context_kv, new)]
        self.context_kv = new
        self.committed += aux.shape[0]

    def reset(self, prompt_ids, aux, next_token):
        self.context_kv, self.committed = None, 0
        self._extend(aux)
        self.bonus = next_token

    def propose(self, k: int) -> list[int]:
        self.last = []
        if k <= 0:
            return []
        m = self.model
        device = self.context_kv[0][0].device
        ids = m.block_ids(torch.tensor([[self.bonus]], device=device), self.num_steps)
        positions = self.committed + torch.arange(self.num_steps + 1, device=device)[None, None]
        visible = torch.ones(1, 1, self.committed, dtype=torch.bool, device=device)
        out = m.block(ids, positions, self.context_kv, visible)
        self.last = m.to_target(m.logits(out[0, 0, 1:]).argmax(-1)).tolist()[:k]
        return list(self.last)

    def accept(self, n, aux, next_token):
        self._extend(aux)
        self.bonus = next_token
