"""What train trains on: the samples (``load_samples``: ids and masks, kept in memory) and where a batch's states
come from, read or computed when it is collated (``features_of``). ``train.features: offline`` reads them from
``data/hidden`` (hidden/layout.py's ``Stored``); ``online`` has the frozen target compute them from
``data/sequences`` (``Online`` over the target) with hidden's extraction and params, and writes nothing;
``streamed`` has a vLLM server compute them the same way (``Online`` over hidden/vllm_source.py's ``VLLMStates``),
through a spool bounded in bytes (drafter/spool.py). Computed states are checked against the answers' engine as
hidden would check them (hidden/agreement.py, ``hidden.agreement``)."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from eaglepipe.core import records
from eaglepipe.core.errors import UserError
from eaglepipe.core.fingerprint import code_key
from eaglepipe.dataset import sequences, shards
from eaglepipe.drafter.eagle3.ttt import chain_masks
from eaglepipe.hidden import agreement, extract, layout
from eaglepipe.hidden.comparison import Context
from eaglepipe.target import families

log = logging.getLogger(__name__)


class Online:
    """Computed features: per batch of ``folder``'s sequences (``data/sequences``), what hidden would store with
    ``params`` (config.Hidden), from ``model``: the frozen target, or a states source such as
    hidden/vllm_source.py's ``VLLMStates`` (extract.source_of); a sequence it cannot run is a UserError. Each sequence
    is checked against the engine's figures (their dtype: ``folder``'s policy, hidden/comparison.Context) the first
    time it is computed (``agreement`` gives the figures)."""

    kind = "online"

    def __init__(self, folder, model, params):
        if isinstance(model, torch.nn.Module):
            model.eval().requires_grad_(False)
        self.folder, self.source, self.params = Path(folder), extract.source_of(model), params
        index = shards.load_index(self.folder)
        self.layers = layout.layer_ids(params.layers, families.text_config(self.source.config).num_hidden_layers)
        self.splits = [s for s in shards.SPLITS if s in index]
        self.context = Context.of(params.agreement, index.get("policy"), self.source.compute_dtype)
        self.live = agreement.live(self.context, sum(index[s]["samples"] for s in self.splits))

    def identity(self) -> dict:
        return {
            "data": shards.dataset_hash(self.folder),
            "hidden": self.params.tracked(),
            "layers": self.layers,
            "model_dtype": self.source.dtype,
            "code": code_key(extract.RESULT_CODE + self.source.code),
        }

    def stored(self, samples: list[layout.Sample]) -> list[dict]:
        """Each sample's states as hidden stores them (``layout.columns`` of ``hidden.dtype``), in order."""
        tensors, failed = extract.extract_shard(
            self.source,
            [(s.id, s.ids, s.mask) for s in samples],
            self.layers,
            self.params.batch_tokens,
            self.params.dtype,
            self.live.bound(samples) if self.live is not None else None,
        )
        if failed:
            raise UserError(
                f"{self.folder}: the target cannot run {failed[0]['id']} ({failed[0]['reason']}); online "
                "training has no way to leave a sequence out (hidden leaves it out: train offline)"
            )
        off = tensors["offsets"].tolist()
        names = layout.columns(self.params.dtype)
        return [{name: tensors[name][off[i] : off[i + 1]] for name in names} for i in range(len(samples))]

    def states(self, samples: list[layout.Sample]) -> list[dict]:
        return [layout.decode(rows) for rows in self.stored(samples)]

    def agreement(self, rt) -> dict:
        """The agreement figures over the sequences every rank (``rt``: core/runtime.Runtime) checked, each once; the
        verdict first given on what came in, when fewer than ``min_sequences`` did."""
        if self.live is None:
            return {"mode": "off"}
        self.live.finish()
        checked = {f.id: f for figures in rt.gather(list(self.live.checked.values())) for f in figures}
        return agreement.summary(agreement.aggregate(list(checked.values())), self.context)


def features_of(feats):
    """``feats`` itself (``layout.Stored``, ``Online``, spool.py's ``Spool``), or ``Stored(feats)`` for a folder."""
    return layout.Stored(feats) if isinstance(feats, (str, Path)) else feats


def load_samples(folder, split: str, positions: str = "generated", keep=None) -> list[layout.Sample]:
    """Every sample of ``split`` with a trained position (those without are counted in the log). ``positions``:
    "generated" runs chains over the loss mask only; "all" over every token of a prompt's first sample, prompt
    included (further answers to it, ``infer.samples``, over their own tokens only). ``keep(id)`` picks the samples
    to load."""
    folder, samples, prompts, untrained = Path(folder), [], set(), 0
    figures = (sequences.ENGINE_LOGPROB,) if sequences.holds_figures(folder) else ()
    for entry, spans, t in shards.columns(folder, split, ("input_ids", "loss_mask", *figures)):
        for sid, (start, end) in zip(entry["ids"], spans):
            if keep is not None and not keep(sid):
                continue
            mask = t["loss_mask"][start:end].bool()
            prompt = records.prompt_of(sid)
            chain = torch.ones_like(mask) if positions == "all" and prompt not in prompts else mask
            prompts.add(prompt)
            if not chain_masks(chain, 1)[0].any():
                untrained += 1
                continue
            ids, engine_logprob = t["input_ids"][start:end], t[figures[0]][start:end] if figures else None
            samples.append(layout.Sample(sid, ids, mask, chain, folder / entry["file"], start, engine_logprob))
    if untrained:
        log.info("%s: %d samples left out, no position to train (an answer of one token)", split, untrained)
    return samples


def token_counts(samples: list[layout.Sample]) -> Counter:
    """How often each id occurs among the loss-masked tokens."""
    ids = torch.cat([s.ids[s.mask] for s in samples]) if samples else torch.zeros(0, dtype=torch.int64)
    values, counts = torch.unique(ids, return_counts=True)
    return Counter(dict(zip(values.tolist(), counts.tolist())))
