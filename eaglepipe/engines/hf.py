"""In-process Hugging Face engine (``infer.engine: hf``): a decoding loop over the model's forward with a KV cache.

Each record is yielded as its row finishes (finished rows leave the batch once a quarter has finished); adjacent
identical prompts share one prefill; only the explicit ``Sampling`` touches the logits (never
``generation_config.json``). Prompts are left-padded and position ids count real tokens, so a row sees the positions
it would alone. Sampling runs on the CPU, each row with its own seeded generator, and keeps the tokens SGLang's
temperature, top-k, top-p, min-p keep (``pick`` applies min-p first: it cuts only the tail, below a share of the top
probability, so no order changes the kept set). Each answer is ``Scored``: the raw log-probability of every id, the
float32 log-softmax of the logits it was picked from (before temperature and the filters; engines/logprobs.py).
"""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache

from eaglepipe.engines import Failure, Sampling, seed_for
from eaglepipe.engines.logprobs import Scored, clean

log = logging.getLogger(__name__)


class HFEngine:
    name = "hf"

    def __init__(self, model, pad_token_id: int, batch_size: int = 16, batch_tokens: int = 32768):
        self.model = model
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens

    def identity(self) -> dict:
        """What, beyond the model files, decides this engine's ids (part of the infer cache's fingerprint)."""
        return {"dtype": str(self.model.dtype)}

    def describe(self) -> dict:
        """What the stage keeps about the engine next to its records (engine.json)."""
        return {"engine": self.name, "model": type(self.model).__name__, **self.identity()}

    def stream(self, prompts: list[list[int]], sampling: Sampling, rids: list[str]):
        """Yield (index, Scored) as rows finish, or (index, Failure) for a record that fails alone (``isolated``).
        Batches go longest first, at most ``batch_size`` rows and ``batch_tokens`` of KV cache (rows x (longest prompt
        + max_new_tokens))."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # stable: duplicates stay adjacent
        batch = []
        for i in order:
            rows = len(batch) + 1
            if batch and (
                rows > self.batch_size or rows * (len(prompts[batch[0]]) + sampling.max_new_tokens) > self.batch_tokens
            ):
                yield from self.isolated(batch, prompts, sampling, rids)
                batch = []
            batch.append(i)
        if batch:
            yield from self.isolated(batch, prompts, sampling, rids)

    def isolated(self, batch: list[int], prompts, sampling: Sampling, rids):
        """Decode ``batch`` (indices into ``prompts``); on an error the unfinished rows are retried in halves, down to
        a single record, which becomes a Failure with the reason. A retried row gives the answer it gives alone."""
        finished = set()
        try:
            for row, out in self._decode([prompts[i] for i in batch], sampling, [rids[i] for i in batch]):
                finished.add(batch[row])
                yield batch[row], out
        except (RuntimeError, ValueError, IndexError, MemoryError) as e:  # torch's OutOfMemoryError is a RuntimeError
            left = [i for i in batch if i not in finished]
            if len(left) == 1:
                yield left[0], Failure(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                return
            log.warning(
                "a batch of %d failed (%s): retrying its %d unfinished rows in halves",
                len(batch),
                type(e).__name__,
                len(left),
            )
            yield from self.isolated(left[: len(left) // 2], prompts, sampling, rids)
            yield from self.isolated(left[len(left) // 2 :], prompts, sampling, rids)

    @torch.inference_mode()
    def _decode(self, prompts: list[list[int]], sampling: Sampling, rids: list[str]):
        """Yield (row, Scored) for one batch, each row as it finishes."""
        rngs = [torch.Generator().manual_seed(seed_for(sampling.seed, rid)) for rid in rids]  # one per record
        meta = {"engine": self.name}
        stops = set(sampling.stop_token_ids)
        dev = self.model.device
        cache, logits, attention, position = self._prefill(prompts)
        rows = list(range(len(prompts)))  # batch row -> prompt row, None once finished
        outputs, figures = [[] for _ in prompts], [[] for _ in prompts]
        while True:
            scores = logits.float().cpu()  # each row's generator is on the CPU
            chosen = pick(scores, sampling, rngs)
            raw, tokens = chosen_logprobs(scores, chosen).tolist(), chosen.tolist()
            for j, (row, token) in enumerate(zip(rows, tokens)):
                if row is None:
                    continue
                outputs[row].append(token)
                figures[row].append(clean(raw[j]))
                if token in stops or len(outputs[row]) >= sampling.max_new_tokens:
                    yield row, Scored(outputs[row], "stop" if token in stops else "length", dict(meta), figures[row])
                    rows[j] = None
            live = [j for j, row in enumerate(rows) if row is not None]
            if not live:
                return
            if len(live) <= 0.75 * len(rows):  # drop finished rows; not one at a time (each drop copies the cache)
                sel = torch.tensor(live, device=dev)
                cache.batch_select_indices(sel)
                attention, position = attention[sel], position[sel]
                rows, tokens, rngs = [rows[j] for j in live], [tokens[j] for j in live], [rngs[j] for j in live]
            attention = torch.cat((attention, torch.ones_like(attention[:, :1])), 1)
            position = position + 1
            logits = self.model(
                input_ids=torch.tensor(tokens, device=dev)[:, None],
                attention_mask=attention,
                position_ids=position[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]

    def _prefill(self, prompts: list[list[int]]):
        """(KV cache, last logits, attention mask, last position) of every row after its prompt: each distinct
        adjacent prompt is prefilled once, then every row gets its copy."""
        unique, source = [], []
        for ids in prompts:
            if not unique or unique[-1] != ids:
                unique.append(ids)
            source.append(len(unique) - 1)
        dev, width = self.model.device, max(len(p) for p in unique)
        input_ids = torch.full((len(unique), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(unique), width), dtype=torch.long)
        for row, ids in enumerate(unique):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        index = torch.tensor(source, device=dev)
        if len(unique) < len(prompts):
            cache.batch_select_indices(index)
        return cache, logits[index], attention[index], positions[index, -1]


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The raw log-probability of ``tokens[i]`` in row i of the float32 ``logits``: its log-softmax, at temperature
    1, before any filter."""
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]


def pick(logits: torch.Tensor, sampling: Sampling, rngs: list) -> torch.Tensor:
    """The next token of every row: argmax when greedy; else a draw with ``rngs[i]`` from the temperature-scaled
    probabilities less what top-k, top-p (mass ranked above > top_p) or min-p (below min_p x the top) rule out."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / sampling.temperature, -1)
    if sampling.min_p > 0:
        probs = probs.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), 0.0)
    if sampling.top_k <= 0 and sampling.top_p >= 1.0:  # no ranking needed (a sort of the vocabulary is slow)
        return draw(probs, rngs)
    probs, order = probs.sort(-1, descending=True)
    if sampling.top_k > 0:
        probs[:, sampling.top_k :] = 0.0
    if sampling.top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(-1) - probs > sampling.top_p, 0.0)
    return order.gather(-1, draw(probs, rngs)[:, None])[:, 0]


def draw(probs: torch.Tensor, rngs: list) -> torch.Tensor:
    """One index per row of ``probs``, drawn with that row's generator."""
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, rngs)])
