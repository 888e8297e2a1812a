"""Target hidden states for training the drafter: extraction (writer) and the reader the train stage uses.

Layout of ``data/hidden/``:
    index.json    {"layers": [2, 15, 27], "layer_convention": LAYER_CONVENTION, "hidden_size": H,
                   "dtype": "bfloat16", "fingerprint": <work fingerprint>,
                   "train": {"shards": [{"file", "samples", "tokens", "ids"}], "samples", "tokens"}, "valid": {...}}
    train-00000.safetensors, ...   per shard (samples in the stored order of ``data/sequences``):
        input_ids  int32 [T]      exactly the merged sequence ids
        loss_mask  uint8 [T]      exactly the merged loss mask (1 on the target's output tokens)
        offsets    int64 [n + 1]  sample i is rows offsets[i]:offsets[i+1]
        aux        bf16  [T, 3H]  the hidden states entering decoder layers layers[0], layers[1], layers[2]
                                  (low, mid, high), concatenated in that order; row t = state at position t
        final      bf16  [T, H]   the final *normed* hidden state (the input of lm_head); the target's logits at
                                  position t are ``final[t] @ lm_head.weight.T`` (recompute them at train time)
        top        int32 [T]      the target's greedy next token at position t: the argmax of its ``lm_head`` over
                                  the full vocabulary, from the unrounded final state (from the bf16 ``final`` the
                                  argmax differs at some positions: 0.18% in the default run; acc_k is scored on this)

Layer convention (checked by tests/test_hidden.py against a bare forward): ids are Hugging Face
``output_hidden_states`` indices. ``hidden_states[0]`` is the embedding output and ``hidden_states[i]`` is the input
of decoder layer ``i`` (= the output of layer ``i - 1``); ``hidden_states[L]`` is *not* the last layer's raw output
in transformers 5.x: it is replaced by the final normed state. ``auto`` = ``[2, L // 2, L - 3]`` (EAGLE-3's official
choice, what SGLang feeds a drafter by default). SGLang's ``eagle_aux_hidden_state_layer_ids`` and SpecForge's ids
count layer *outputs*, so they are these ids minus one (``[1, L // 2 - 1, L - 4]``).

Extraction: sequences are planned into shards of at most ``hidden.shard_tokens`` tokens (stored order kept), each
shard's samples sorted by length and batched with right padding up to ``hidden.batch_tokens`` tokens (rows x longest)
per forward pass, no attention mask needed (causal attention never looks at the padding on the right). The base
model runs without ``lm_head`` and keeps only the selected hidden states; the head then runs on the real rows only,
in blocks, for ``top``. Storage is 8·H bytes of hidden state per token in bf16 (3·H aux + H final), plus 9 bytes of
ids, mask and ``top``.

Resume: finished shards are written atomically into ``.cache/hidden/<fingerprint>/`` where the fingerprint covers
the sequences (their bytes), the ``hidden`` params, this file's code, the target model's fingerprint and the torch /
transformers versions. A rerun after an interruption keeps the finished shards; a different fingerprint never sees
them. At the end the work folder gets its index.json and is moved (renamed) to the output folder.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from . import sequences
from .records import write_json

log = logging.getLogger(__name__)

LAYER_CONVENTION = ("HF output_hidden_states index: layers[i] is hidden_states[i], the hidden state entering decoder "
                    "layer i (hidden_states[0] = embedding output); SGLang/SpecForge aux layer ids are these minus 1")
SPLITS = ("train", "valid")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------------------- layers
def layer_ids(value, num_layers: int) -> list[int]:
    """The three HF ``hidden_states`` indices (low, mid, high) for ``hidden.layers``: ``auto`` or explicit ids.

    ``auto`` = ``[2, L // 2, L - 3]``. Explicit ids must be three strictly increasing integers in ``[0, L - 1]``
    (inputs of decoder layers; index ``L`` would be the normed final state, which is stored separately)."""
    L = int(num_layers)
    if value is None or value == "auto":
        ids = [2, L // 2, L - 3]
    elif isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        ids = [int(i) for i in value]
    else:
        raise ValueError(f"hidden.layers should be 'auto' or a list of three layer ids, got {value!r}")
    if len(ids) != 3 or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] > L - 1:
        raise ValueError(f"hidden.layers {ids} should be three strictly increasing ids in [0, {L - 1}] "
                         f"(a target with {L} layers); convention: {LAYER_CONVENTION}")
    return ids


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# ---------------------------------------------------------------------------------------------------------- reader
def load_index(folder) -> dict:
    return json.loads((Path(folder) / "index.json").read_text())


def read_shards(folder, split: str) -> Iterator[tuple[dict, dict]]:
    """Yield (shard entry of index.json, {input_ids, loss_mask, offsets, aux, final} as torch tensors) per shard."""
    folder = Path(folder)
    for shard in load_index(folder)[split]["shards"]:
        yield shard, load_file(folder / shard["file"])


def read(folder, split: str) -> Iterator[dict]:
    """Yield one dict per sample of ``split``, in stored order (the order of ``data/sequences``):
    ``id`` str, ``input_ids`` int32 [n], ``loss_mask`` uint8 [n], ``aux`` bf16 [n, 3H], ``final`` bf16 [n, H],
    ``top`` int32 [n] (views into the loaded shard: clone what you keep beyond the shard's lifetime if memory
    matters)."""
    for shard, t in read_shards(folder, split):
        off = t["offsets"].tolist()
        for i, rid in enumerate(shard["ids"]):
            a, b = off[i], off[i + 1]
            yield {"id": rid, "input_ids": t["input_ids"][a:b], "loss_mask": t["loss_mask"][a:b],
                   "aux": t["aux"][a:b], "final": t["final"][a:b], "top": t["top"][a:b]}


# ---------------------------------------------------------------------------------------------------------- writer
def _code_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def inputs_hash(seq_folder) -> str:
    """Hash of the merged sequences: index.json and every shard file's bytes."""
    seq_folder = Path(seq_folder)
    h = hashlib.sha256((seq_folder / "index.json").read_bytes())
    index = json.loads((seq_folder / "index.json").read_text())
    for split in SPLITS:
        for shard in index.get(split, {}).get("shards", []):
            with open(seq_folder / shard["file"], "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
    return h.hexdigest()


def fingerprint(seq_hash: str, params: dict, layers: list[int], model_fp: str, model_dtype: str = "") -> str:
    """Fingerprint of everything that decides the shards: inputs, params, code, model (files and compute dtype)
    and library versions."""
    import transformers

    blob = json.dumps({"sequences": seq_hash, "params": params, "layers": layers, "code": _code_hash(),
                       "model": model_fp, "model_dtype": model_dtype, "torch": torch.__version__,
                       "transformers": transformers.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def plan_shards(samples: list, shard_tokens: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of samples, each up to ``shard_tokens`` tokens (at least one sample)."""
    ranges, start = [], 0
    while start < len(samples):
        end, tokens = start, 0
        while end < len(samples) and (tokens == 0 or tokens + len(samples[end][1]) <= shard_tokens):
            tokens += len(samples[end][1])
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into right-padded batches, longest first, rows x longest <= batch_tokens (>= 1 row)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, i = [], 0
    while i < len(order):
        rows = max(1, batch_tokens // max(1, lengths[order[i]]))
        batches.append(order[i:i + rows])
        i += rows
    return batches


def base_model(model):
    """The decoder stack without the LM head (``LlamaModel`` for ``LlamaForCausalLM``)."""
    return getattr(model, "base_model", None) or model.model


@torch.inference_mode()
def forward_states(model, input_ids: torch.Tensor, layers: list[int]):
    """One forward pass of the base model: (aux [B, S, 3H], final [B, S, H]) in the model's dtype."""
    out = base_model(model)(input_ids=input_ids, output_hidden_states=list(layers), use_cache=False)
    aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    return aux, out.last_hidden_state


@torch.inference_mode()
def greedy(model, states: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """int64 [n]: the argmax of the model's own output head over final states [n, H], ``rows`` at a time (the full
    logits of a big batch would not fit)."""
    head = model.get_output_embeddings()
    return torch.cat([head(states[r:r + rows]).argmax(-1) for r in range(0, states.shape[0], rows)])


@torch.inference_mode()
def extract_shard(model, samples: list, layers: list[int], batch_tokens: int, dtype: torch.dtype,
                  pad_id: int = 0) -> dict:
    """The tensors of one shard for ``samples`` = [(id, input_ids, loss_mask)], in the given order."""
    lengths = [len(s[1]) for s in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    T, H = int(offsets[-1]), text_config(model.config).hidden_size
    aux = torch.empty((T, 3 * H), dtype=dtype)
    final = torch.empty((T, H), dtype=dtype)
    top = torch.empty(T, dtype=torch.int32)
    for batch in plan_batches(lengths, batch_tokens):
        width = lengths[batch[0]]
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, :lengths[i]] = torch.from_numpy(np.asarray(samples[i][1], dtype=np.int64))
        a, f = forward_states(model, ids, layers)
        for row, i in enumerate(batch):
            s, n = int(offsets[i]), lengths[i]
            aux[s:s + n] = a[row, :n]
            final[s:s + n] = f[row, :n]
            top[s:s + n] = greedy(model, f[row, :n])
    return {"input_ids": torch.from_numpy(np.concatenate([np.asarray(s[1], dtype=np.int32) for s in samples])),
            "loss_mask": torch.from_numpy(np.concatenate([np.asarray(s[2], dtype=np.uint8) for s in samples])),
            "offsets": torch.from_numpy(offsets), "aux": aux, "final": final, "top": top}


def _finished(path: Path, fp: str) -> bool:
    if not path.exists():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("fingerprint") == fp
    except Exception:  # a damaged file is recomputed
        return False


def run(seq_folder, out, model, params: dict, model_fp: str, cache_root) -> dict:
    """Extract hidden states for every split of ``seq_folder`` into ``out``; return the run report."""
    seq_folder, out = Path(seq_folder), Path(out)
    cfg = text_config(model.config)
    layers = layer_ids(params.get("layers", "auto"), cfg.num_hidden_layers)
    dtype_name = str(params.get("dtype", "bfloat16"))
    if dtype_name not in DTYPES:
        raise ValueError(f"hidden.dtype should be one of {sorted(DTYPES)}, got {dtype_name!r}")
    dtype, H = DTYPES[dtype_name], cfg.hidden_size
    batch_tokens, shard_tokens = int(params["batch_tokens"]), int(params["shard_tokens"])
    fp = fingerprint(inputs_hash(seq_folder), params, layers, model_fp, str(model.dtype))
    work = Path(cache_root) / fp
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob("*.tmp*"):  # a shard being written when the last run stopped
        stale.unlink()
    index = {"layers": layers, "layer_convention": LAYER_CONVENTION, "hidden_size": H, "dtype": dtype_name,
             "fingerprint": fp}
    computed_tokens, reused, computed, elapsed = 0, 0, 0, 0.0
    seq_index = json.loads((seq_folder / "index.json").read_text())
    for split in SPLITS:
        samples = [(rid, ids, mask) for rid, _source, ids, mask in sequences.read(seq_folder, split)] \
            if split in seq_index else []
        shards = []
        for k, (a, b) in enumerate(plan_shards(samples, shard_tokens)):
            chunk, file = samples[a:b], f"{split}-{k:05d}.safetensors"
            path = work / file
            if _finished(path, fp):
                reused += 1
            else:
                start = time.perf_counter()
                tensors = extract_shard(model, chunk, layers, batch_tokens, dtype)
                tmp = path.with_name(f"{file}.tmp{os.getpid()}")
                save_file(tensors, str(tmp), metadata={"fingerprint": fp})  # one key: a byte-identical header
                os.chmod(tmp, 0o644)  # safetensors creates files readable by their owner only
                os.replace(tmp, path)
                elapsed += time.perf_counter() - start
                computed += 1
                computed_tokens += int(tensors["offsets"][-1])
                log.info("hidden %s: %d samples, %d tokens (%.0f tokens/s so far)", file, len(chunk),
                         int(tensors["offsets"][-1]), computed_tokens / max(elapsed, 1e-9))
            shards.append({"file": file, "samples": len(chunk), "tokens": sum(len(c[1]) for c in chunk),
                           "ids": [c[0] for c in chunk]})
        index[split] = {"shards": shards, "samples": len(samples), "tokens": sum(s["tokens"] for s in shards)}
    write_json(work / "index.json", index)
    files = [work / s["file"] for split in SPLITS for s in index[split]["shards"]]
    total_bytes = sum(p.stat().st_size for p in files)
    tokens = sum(index[split]["tokens"] for split in SPLITS)
    # publish: the work folder becomes the output folder (a rename on the same filesystem)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(work), str(out))
    bytes_el = torch.tensor([], dtype=dtype).element_size()
    return {"layers": layers, "layer_convention": LAYER_CONVENTION, "hidden_size": H, "dtype": dtype_name,
            "fingerprint": fp, "samples": sum(index[s]["samples"] for s in SPLITS), "tokens": tokens,
            "train_tokens": index["train"]["tokens"], "valid_tokens": index["valid"]["tokens"],
            "hidden_bytes_per_token": 4 * H * bytes_el, "max_hidden_bytes_per_token_bf16": 8 * H,
            "bytes_per_token": round(total_bytes / max(tokens, 1), 2), "bytes": total_bytes,
            "computed_tokens": computed_tokens, "computed_shards": computed, "reused_shards": reused,
            "tokens_per_s": round(computed_tokens / elapsed, 1) if elapsed else None,
            "seconds": round(elapsed, 2)}
