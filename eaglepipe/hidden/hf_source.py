"""The states source of ``hidden.engine: hf``: a transformers target's forward in this process (``Forward``); the
vLLM one is vllm_source.py. A source yields, per sequence, its states (with the head's figures over them,
``head_figures``) or the reason it failed alone; it says the dtype it computes in (``compute_dtype``) and gives the
head's logits over final states (``logits``) for hidden's agreement check (agreement.py)."""

from __future__ import annotations

import logging

import torch

from eaglepipe.dataset import sequences

log = logging.getLogger(__name__)
FAILURES = (RuntimeError, ValueError, IndexError, MemoryError)
"""What a batch's forward may raise that sends the batch back in halves (torch's OutOfMemoryError is a RuntimeError)."""


def base_model(model):
    """The decoder stack without the LM head (``LlamaModel`` for ``LlamaForCausalLM``)."""
    return getattr(model, "base_model", None) or model.model


@torch.inference_mode()
def forward_states(model, input_ids: torch.Tensor, layers: list[int]):
    """(aux [B, S, 3H], final [B, S, H]) from one base-model forward, in the model's dtype, on the last layer's device
    (a target spread over devices, ``runtime.device_map``, leaves each state on its layer's)."""
    out = base_model(model)(input_ids=input_ids, output_hidden_states=list(layers), use_cache=False)
    final = out.last_hidden_state
    aux = torch.cat([out.hidden_states[i].to(final.device) for i in layers], dim=-1)
    return aux, final


@torch.inference_mode()
def head_figures(head, states: torch.Tensor, ids, rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(top int64 [n], target_logprob float32 [n]) from the output ``head`` (a callable: final states -> logits) over
    the final states [n, H] of the sequence ``ids`` [n], ``rows`` at a time (a big batch's logits would not fit):
    ``top[t]`` is the head's argmax at t; ``target_logprob[t]`` = log p(ids[t] | ids[:t]), the float32 log-softmax
    of the logits at t - 1 taken at ids[t] (NaN at t = 0, which nothing predicts)."""
    n = states.shape[0]
    ids = torch.as_tensor(ids).to(device=states.device, dtype=torch.long)
    top = []
    target_logprob = torch.full((n,), float("nan"), dtype=torch.float32, device=states.device)
    for start in range(0, n, rows):
        logits = head(states[start : start + rows])
        top.append(logits.argmax(-1))
        end = min(start + rows, n - 1)  # positions start .. end - 1 predict ids[start + 1 .. end]
        if end > start:
            logprobs = torch.log_softmax(logits[: end - start].float(), -1)
            target_logprob[start + 1 : end + 1] = logprobs.gather(-1, ids[start + 1 : end + 1, None])[:, 0]
    return torch.cat(top), target_logprob


def failure_reason(error: BaseException) -> str:
    """Why a sequence failed alone, as its shard stores it: no device name or free memory in it (a shard's bytes)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return type(error).__name__
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


class Forward:
    """The states source of a transformers target. The fingerprint and the index read ``config`` and ``dtype``."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.dtype = str(model.dtype)
        self.compute_dtype = self.dtype.removeprefix("torch.")
        self.code = ()
        self.report = {}

    @torch.inference_mode()
    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """float32 logits of the head over final states [n, H] (the agreement check's fallback)."""
        return self.model.get_output_embeddings()(final).float()

    @torch.inference_mode()
    def states(self, samples: list, layers: list[int], batch_tokens: int, pad_id: int = 0):
        """Yield (index into ``samples`` = [(key, ids, mask)], (aux, final, top, target_logprob) (``head_figures``) or
        the reason it failed), in right-padded batches of at most ``batch_tokens``; a failing batch (out of memory, a
        bad id) is retried in halves down to one sample, so a poison sequence never takes its batch mates down."""
        lengths = [len(sample[1]) for sample in samples]
        for batch in sequences.plan_batches(lengths, batch_tokens):
            yield from self._batch(samples, batch, layers, pad_id)

    def _batch(self, samples: list, batch: list[int], layers: list[int], pad_id: int):
        """``states`` for the samples of indices ``batch``, in one forward, or in halves if it fails."""
        lengths = [len(samples[i][1]) for i in batch]
        ids = torch.full((len(batch), max(lengths)), pad_id, dtype=torch.long, device=self.model.device)
        for row, i in enumerate(batch):
            ids[row, : lengths[row]] = torch.as_tensor(samples[i][1])
        try:
            aux, final = forward_states(self.model, ids, layers)
        except FAILURES as e:
            if len(batch) == 1:
                yield batch[0], failure_reason(e)
                return
            log.warning("a batch of %d sequences failed (%s): retrying it in halves", len(batch), type(e).__name__)
            half = len(batch) // 2
            yield from self._batch(samples, batch[:half], layers, pad_id)
            yield from self._batch(samples, batch[half:], layers, pad_id)
            return
        head = self.model.get_output_embeddings()
        for row, i in enumerate(batch):
            n = lengths[row]
            yield i, (aux[row, :n], final[row, :n], *head_figures(head, final[row, :n], samples[i][1]))
