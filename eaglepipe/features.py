"""The target's hidden states in ``data/hidden`` (written by ``hidden.py``): their layout, the layer ids, the reader.

Layout (a sharded dataset, format: ``shards.py``):
    index.json    {"layers": [2, 15, 27], "layer_convention": "hf_hidden_states", "hidden_size": H,
                   "dtype": "bfloat16", "train": {"shards": [{"file", "samples", "tokens", "ids", "rows"}], "samples",
                   "tokens"}, "valid": {...}}: the entries name, in the stored order of ``data/sequences``, the row
                   of a shard that holds each sample (a shard may serve both splits and several data versions:
                   hidden.py stores states by content)
    shard-<hash>.safetensors, ...  per shard (metadata ``content``: the content key of each sample, and the failed):
        input_ids  int32 [T]      exactly the merged sequence ids
        loss_mask  uint8 [T]      exactly the merged loss mask (1 on the target's output tokens)
        offsets    int64 [n + 1]  sample i is rows offsets[i]:offsets[i+1]
        aux        bf16  [T, 3H]  the hidden states of ``layers`` (low, mid, high), concatenated in that order;
                                  row t = state at position t
        final      bf16  [T, H]   the final *normed* hidden state (the input of lm_head); the target's logits at
                                  position t are ``final[t] @ lm_head.weight.T`` (recompute them at train time)
        top        int32 [T]      the target's greedy next token at position t: the argmax of its ``lm_head`` over
                                  the full vocabulary, from the unrounded final state (from the bf16 ``final`` the
                                  argmax differs at some positions; acc_k is scored on this)
The folder holds data only (no fingerprint, no code version): the same sequences, model and ``hidden`` params,
extracted from an empty store, give the same bytes.

Layer ids (``layer_convention: hf_hidden_states``; checked by tests/test_hidden.py against a bare forward): ids are
Hugging Face ``output_hidden_states`` indices. ``hidden_states[0]`` is the embedding output and ``hidden_states[i]``
is the input of decoder layer ``i`` (= the output of layer ``i - 1``); ``hidden_states[L]`` is *not* the last
layer's raw output in transformers 5.x: it is replaced by the final normed state. ``auto`` = ``[2, L // 2, L - 3]``
(EAGLE-3's official choice, what SGLang and vLLM capture when a drafter names no layers) where those ids are valid
(L >= 7; smaller targets: ``layer_ids``). vLLM's ``eagle_aux_hidden_state_layer_ids`` are these ids; SGLang's and
SpecForge's count layer *outputs*, so they are these ids minus one (``[1, L // 2 - 1, L - 4]``); draft.py writes both.
"""
from __future__ import annotations

from typing import Iterator

from . import shards

LAYER_CONVENTION = "hf_hidden_states"


def layer_ids(value, num_layers: int) -> list[int]:
    """The three layer ids (low, mid, high) for ``hidden.layers``: ``auto`` or explicit ids.

    ``auto`` = ``[2, L // 2, L - 3]`` for L >= 7 layers. Below 7 those ids collide, and ``auto`` is the three
    consecutive ids around the middle, ``[L // 2 - 1, L // 2, L // 2 + 1]`` ([1, 2, 3] for 4 or 5 layers, [2, 3, 4]
    for 6, the default's value at 7): never id 0 (the embedding output, which several SGLang and vLLM models cannot
    capture: they add a residual that does not exist yet), so ``auto`` needs at least 4 layers. The drafter's config
    names its layers for both engines (draft.py), so ids other than the engines' default are served as they are.
    Explicit ids must be three strictly increasing integers in ``[0, L - 1]`` (inputs of decoder layers; index ``L``
    would be the normed final state, which is stored separately)."""
    L = int(num_layers)
    if value is None or value == "auto":
        if L < 4:
            raise ValueError(f"the target has {L} decoder layers: EAGLE-3 reads the inputs of three distinct layers "
                             "other than the embedding output, so it needs at least 4")
        ids = [2, L // 2, L - 3] if L >= 7 else [L // 2 - 1, L // 2, L // 2 + 1]
    elif isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        ids = [int(i) for i in value]
    else:
        raise ValueError(f"hidden.layers should be 'auto' or a list of three layer ids, got {value!r}")
    if len(ids) != 3 or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] > L - 1:
        raise ValueError(f"hidden.layers {ids} should be three strictly increasing ids in [0, {L - 1}] (a target "
                         f"with {L} layers): Hugging Face hidden_states indices, see eaglepipe/features.py")
    return ids


def read(folder, split: str) -> Iterator[dict]:
    """Yield one dict per sample of ``split``, in stored order (the order of ``data/sequences``):
    ``id`` str, ``input_ids`` int32 [n], ``loss_mask`` uint8 [n], ``aux`` bf16 [n, 3H], ``final`` bf16 [n, H],
    ``top`` int32 [n], each read from its shard's rows."""
    for entry, i, rows in shards.samples(folder, split):
        yield {"id": entry["ids"][i], **rows}
