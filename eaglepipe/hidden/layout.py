"""The target's hidden states in ``data/hidden`` (written by extract.py): their layout, the layer ids, the readers
(``read``; ``Stored`` and ``read_states``, train's).

Layout (a sharded dataset, format: ``shards.py``):
    index.json    {"layers": [2, 15, 27], "layer_convention": "hf_hidden_states", "hidden_size": H,
                   "dtype": "bfloat16", "train": {"shards": [{"file", "samples", "tokens", "ids", "rows"}], "samples",
                   "tokens"}, "valid": {...}}: the entries name, in the stored order of ``data/sequences``, the row
                   of a shard that holds each sample (a shard may serve both splits and several data versions:
                   hidden's store holds states by content, store.py)
    shard-<hash>.safetensors, ...  per shard (metadata ``content``: the content key of each sample, and the failed):
        input_ids  int32 [T]      exactly the merged sequence ids
        loss_mask  uint8 [T]      exactly the merged loss mask (1 on the target's output tokens)
        offsets    int64 [n + 1]  sample i is rows offsets[i]:offsets[i+1]
        aux        dtype [T, 3H]  the hidden states of ``layers`` (low, mid, high), concatenated in that order;
                                  row t = state at position t
        final      dtype [T, H]   the final *normed* hidden state (the input of lm_head); the target's logits at
                                  position t are ``final[t] @ lm_head.weight.T`` (recompute them at train time)
        aux_scale, final_scale  float32 [T, 3], [T, 1]  with ``dtype: float8_e4m3fn`` only: each token's scale per
                                  layer (``encode``); a state is its values times their scale (``decode``)
        top        int32 [T]      the target's greedy next token at position t: the argmax of its ``lm_head`` over
                                  the full vocabulary, from the unrounded final state (from the bf16 ``final`` the
                                  argmax differs at some positions; acc_k is scored on this)
        target_logprob  float32 [T]  log p(input_ids[t] | input_ids[:t]) under the target: the float32 log-softmax
                                  of the head's logits at t - 1, from the same unrounded states as ``top``; NaN at
                                  t = 0 (hidden's agreement check, agreement.py; train does not read it)
The folder holds data only (no fingerprint, no code version): the same sequences, model and ``hidden`` params,
extracted from an empty store, give the same bytes.

Layer ids (``layer_convention: hf_hidden_states``) are Hugging Face ``output_hidden_states`` indices:
``hidden_states[0]`` is the embedding output, ``hidden_states[i]`` the input of decoder layer ``i`` (the output of
layer ``i - 1``); ``hidden_states[L]`` is, in transformers 5.x, the final normed state, not the last layer's raw
output. ``auto`` (``layer_ids``: ``[2, L // 2, L - 3]`` for L >= 7) is EAGLE-3's official choice, what SGLang and
vLLM capture when a drafter names no layers. vLLM's ``eagle_aux_hidden_state_layer_ids`` are these ids; SGLang's
and SpecForge's count layer *outputs*: these ids minus one (``[1, L // 2 - 1, L - 4]``). The drafter's
checkpoint (drafter/eagle3/model.py) names both.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglepipe.core.errors import UserError
from eaglepipe.dataset import shards

LAYER_CONVENTION = "hf_hidden_states"
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
"""``hidden.dtype``: how ``aux`` and ``final`` are stored."""
SCALED = ("float8_e4m3fn",)
"""The dtypes stored with a scale per token and layer (``encode``)."""
FP8_MAX = 448.0  # the largest float8_e4m3fn value
STATES = ("aux", "final", "top")
"""A sample's states as train reads them (decoded: ``decode``)."""
TARGET_LOGPROB = "target_logprob"
"""The column of the target's log-probability of each id (the agreement check's; not a state train reads)."""
SCALES = ("aux_scale", "final_scale")


def columns(dtype: str) -> tuple[str, ...]:
    """The tensors a sample's ``STATES`` are stored as in ``dtype``: with their ``SCALES`` under FP8."""
    return STATES + (SCALES if dtype in SCALED else ())


def layer_ids(value, num_layers: int) -> list[int]:
    """The three layer ids (low, mid, high) for ``hidden.layers``, ``auto`` or explicit; ValueError otherwise.

    ``auto`` = ``[2, L // 2, L - 3]`` for L >= 7 layers, else ``[L // 2 - 1, L // 2, L // 2 + 1]``; never id 0 (the
    embedding output, which several SGLang and vLLM models cannot capture), so it needs at least 4 layers. Explicit
    ids: three strictly increasing integers in ``[0, L - 1]`` (``L`` is the normed final state, stored apart)."""
    L = int(num_layers)
    if value is None or value == "auto":
        if L < 4:
            raise ValueError(
                f"the target has {L} decoder layers: EAGLE-3 reads the inputs of three distinct layers "
                "other than the embedding output, so it needs at least 4"
            )
        ids = [2, L // 2, L - 3] if L >= 7 else [L // 2 - 1, L // 2, L // 2 + 1]
    elif isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        ids = [int(i) for i in value]
    else:
        raise ValueError(f"hidden.layers should be 'auto' or a list of three layer ids, got {value!r}")
    if len(ids) != 3 or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] > L - 1:
        raise ValueError(
            f"hidden.layers {ids} should be three strictly increasing ids in [0, {L - 1}] (a target "
            f"with {L} layers): Hugging Face hidden_states indices, see eaglepipe/hidden/layout.py"
        )
    return ids


def encode(x: torch.Tensor, dtype: str, parts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` [n, parts * H] as stored in ``dtype``: (values, None), or under FP8 (values, scale float32 [n, parts]):
    each token's part divided by its scale, its absolute maximum over FP8_MAX (so its largest value is stored
    exactly, the others to 3 significant bits)."""
    if dtype not in SCALED:
        return x.to(DTYPES[dtype]), None
    n, width = x.shape
    split = x.float().reshape(n, parts, width // parts)
    scale = split.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (split / scale[..., None]).to(DTYPES[dtype]).reshape(n, width), scale


def decode(rows: dict) -> dict:
    """Stored ``rows`` as values: under FP8 ``aux`` and ``final`` times their scales, float32, scales dropped;
    otherwise as stored."""
    out = {k: v for k, v in rows.items() if k not in SCALES}
    for name in ("aux", "final"):
        scale = rows.get(f"{name}_scale")
        if scale is not None:
            n, width = rows[name].shape
            out[name] = (rows[name].float().reshape(n, scale.shape[1], -1) * scale[..., None]).reshape(n, width)
    return out


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Bytes of stored state per token: ``aux`` and ``final`` (4 states of ``hidden_size``), their scales."""
    return 4 * hidden_size * torch.tensor([], dtype=DTYPES[dtype]).element_size() + (16 if dtype in SCALED else 0)


def read(folder, split: str) -> Iterator[dict]:
    """Yield one dict per sample of ``split``, in stored order (the order of ``data/sequences``):
    ``id`` str, ``input_ids`` int32 [n], ``loss_mask`` uint8 [n], ``aux`` [n, 3H], ``final`` [n, H] (``decode``d),
    ``top`` int32 [n], ``target_logprob`` float32 [n], each read from its shard's rows."""
    for entry, i, rows in shards.samples(folder, split):
        yield {"id": entry["ids"][i], **decode(rows)}


@dataclass
class Sample:
    """A sample's ids and masks (train.load_samples); its ``STATES`` stay in the shard ``file``, rows
    ``start:start + n``."""

    id: str
    ids: torch.Tensor  # int32 [n], as stored
    mask: torch.Tensor  # bool [n], the loss mask (tokens the target generated)
    chain: torch.Tensor  # bool [n], the tokens chains may run over: the loss mask, or every token (train.load_samples)
    file: Path
    start: int
    engine_logprob: torch.Tensor | None = None  # float32 [n], read from data/sequences where it has them (online)


class Stored:
    """Offline features: the states hidden stored in ``folder`` (``data/hidden``)."""

    kind = "offline"

    def __init__(self, folder):
        self.folder = Path(folder)
        index = shards.load_index(self.folder)
        if "skipped" in index:
            raise UserError(
                f"{self.folder} holds no hidden states ({index['skipped']}): rerun hidden with "
                "train.features: offline, or train online"
            )
        self.layers, self.splits = index["layers"], [s for s in shards.SPLITS if s in index]
        self.names = columns(index.get("dtype"))

    def identity(self) -> dict:
        """What decides these states (for the checkpoint fingerprint)."""
        return {"data": shards.dataset_hash(self.folder)}

    def states(self, samples: list[Sample]) -> list[dict]:
        return read_states(samples, self.names)


def read_states(samples: list[Sample], names=STATES) -> list[dict]:
    """Each sample's decoded ``STATES`` (stored as ``names``: with scales under FP8), in order, reading each shard
    file once."""
    by_file = {}
    for i, s in enumerate(samples):
        by_file.setdefault(s.file, []).append(i)
    out = [None] * len(samples)
    for file, which in by_file.items():
        rows = shards.read_rows(
            file, names, [(samples[i].start, samples[i].start + len(samples[i].ids)) for i in which]
        )
        for i, r in zip(which, rows):
            out[i] = decode(r)
    return out
