"""Extraction of the target's hidden states into ``data/hidden`` (layout, layer ids and reader:
``features.py``; train reads the folder through that module alone).

Extraction: sequences are planned into shards of at most ``hidden.shard_tokens`` tokens (stored order kept), each
shard's samples sorted by length and batched with right padding up to ``hidden.batch_tokens`` tokens (rows x longest)
per forward pass, no attention mask needed (causal attention never looks at the padding on the right). The base
model runs without ``lm_head`` and keeps only the selected hidden states; the head then runs on the real rows only,
in blocks, for ``top``. Storage is 8·H bytes of hidden state per token in bf16 (3·H aux + H final), plus 9 bytes of
ids, mask and ``top``.

Resume: shards are written atomically into the work folder ``.cache/hidden/<fingerprint>/``, so a shard there is
finished and belongs to that fingerprint, which covers the sequences (their bytes), the ``hidden`` params, the code
that writes the shards, the target model's fingerprint and compute dtype and the torch / transformers versions. A
rerun after an interruption keeps the finished shards; a different fingerprint never sees them. At the end the work
folder gets its index.json and is moved (renamed) to the output folder. A sequence that fails alone
(``extract_shard``) is left out of its shard and listed with its reason in ``failures.jsonl`` (published with the
shards; kept across resumes in ``left_out/<shard>.jsonl``, written before its shard). The fingerprint stays out of
the published files (it is in the run report): a code change that leaves the states as they are changes no
published byte.

Ranks (torchrun, ``runtime.py``): the shards still missing when the run starts are dealt round-robin to the ranks,
each computing its own; once all are written, rank 0 writes the index and publishes. The plan, the batches and so
the published bytes are the same whatever the number of processes; a process killed mid-run loses only the shard it
was writing, and a rerun at any world size computes the rest.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from . import features, runtime, sequences, shards
from .hashing import files_hash
from .errors import UserError
from .records import read_jsonl, write_json, write_jsonl

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def fingerprint(seq_hash: str, params: dict, layers: list[int], model_fp: str, model_dtype: str = "") -> str:
    """Fingerprint of everything that decides the shards: inputs, params, code (this module and the shard format's),
    model (files and compute dtype) and library versions."""
    import transformers

    code = files_hash([__file__, sequences.__file__, shards.__file__])
    blob = json.dumps({"sequences": seq_hash, "params": params, "layers": layers, "code": code,
                       "model": model_fp, "model_dtype": model_dtype, "torch": torch.__version__,
                       "transformers": transformers.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
                  pad_id: int = 0) -> tuple[dict, list[dict]]:
    """The tensors of one shard (``features.py``) for ``samples`` = [(id, input_ids, loss_mask)], in the given
    order, and the samples left out of it [{id, tokens, reason}]. A batch that fails (out of memory, a bad id) is
    retried in two halves, down to one sample; a sample that fails alone is left out with its reason, so a poison
    sequence never takes its batch mates down."""
    lengths = [len(s[1]) for s in samples]
    rows, failed = {}, []

    def run_batch(batch):
        ids = torch.full((len(batch), max(lengths[i] for i in batch)), pad_id, dtype=torch.long, device=model.device)
        for row, i in enumerate(batch):
            ids[row, :lengths[i]] = torch.as_tensor(samples[i][1])
        try:
            a, f = forward_states(model, ids, layers)
        except (RuntimeError, ValueError, IndexError, MemoryError) as e:  # torch's OutOfMemoryError included
            if len(batch) == 1:
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                log.warning("hidden: sequence %s (%d tokens) fails alone, left out: %s", samples[batch[0]][0],
                            lengths[batch[0]], reason)
                failed.append({"id": samples[batch[0]][0], "tokens": lengths[batch[0]], "reason": reason})
                return
            log.warning("a batch of %d sequences failed (%s): retrying it in halves", len(batch), type(e).__name__)
            run_batch(batch[:len(batch) // 2])
            run_batch(batch[len(batch) // 2:])
            return
        for row, i in enumerate(batch):
            n = lengths[i]
            rows[i] = (a[row, :n].to("cpu", dtype), f[row, :n].to("cpu", dtype), greedy(model, f[row, :n]).cpu())

    for batch in plan_batches(lengths, batch_tokens):
        run_batch(batch)
    kept = [i for i in range(len(samples)) if i in rows]
    packed = sequences.pack([(samples[i][1], samples[i][2]) for i in kept])
    H = text_config(model.config).hidden_size
    stack = lambda part, width, kind: torch.cat([rows[i][part] for i in kept]) if kept \
        else torch.empty((0, width) if width else 0, dtype=kind)  # noqa: E731
    return {**packed, "aux": stack(0, 3 * H, dtype), "final": stack(1, H, dtype),
            "top": stack(2, 0, torch.int32).to(torch.int32)}, failed


SKIPPED = "train.features is online: train computes the states itself, hidden extracts nothing"


def skip(out) -> dict:
    """With online training: publish ``out`` holding only an index that says why it holds no states; return the run
    report."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_json(out / "index.json", {"skipped": SKIPPED})
    return {"skipped": SKIPPED, "samples": 0, "tokens": 0, "run": {"computed_tokens": 0}}


def run(seq_folder, out, model, params, model_fp: str, cache_root, rt: runtime.Runtime = runtime.Runtime()) -> dict:
    """Extract hidden states for every split of ``seq_folder`` into ``out``; return the run report (the same on every
    rank). ``params``: the ``hidden`` section (config.Hidden); ``rt``: this process's rank and world (runtime.py)."""
    seq_folder, out = Path(seq_folder), Path(out)
    cfg = text_config(model.config)
    layers = features.layer_ids(params.layers, cfg.num_hidden_layers)
    dtype_name = params.dtype
    dtype, H = DTYPES[dtype_name], cfg.hidden_size
    fp = fingerprint(shards.dataset_hash(seq_folder), params.tracked(), layers, model_fp, str(model.dtype))
    work = Path(cache_root) / fp
    left_out_dir = work / "left_out"  # per shard, the samples left out of it: {shard, id, tokens, reason} lines
    left_out_dir.mkdir(parents=True, exist_ok=True)
    seq_index = json.loads((seq_folder / "index.json").read_text())
    plan = []  # (split, shard file, its samples [(id, input_ids, loss_mask)]), every split's shards in order
    for split in shards.SPLITS:
        samples = [(rid, ids, mask) for rid, _source, ids, mask in sequences.read(seq_folder, split)] \
            if split in seq_index else []
        plan += [(split, f"{split}-{k:05d}.safetensors", samples[a:b])
                 for k, (a, b) in enumerate(shards.plan([len(s[1]) for s in samples], params.shard_tokens))]
    # a shard in this fingerprint's folder was written atomically: it is finished, and of these inputs
    missing = [p for p in plan if not (work / p[1]).exists()]
    if rt.is_main:
        for stale in work.glob("**/*.tmp*"):  # a file being written when the last run stopped
            stale.unlink()
    rt.barrier()  # every rank has listed the missing shards before any is written
    computed_tokens, elapsed = 0, 0.0
    for _split, file, chunk in missing[rt.rank::rt.world]:
        start = time.perf_counter()
        tensors, left_out = extract_shard(model, chunk, layers, params.batch_tokens, dtype)
        record = left_out_dir / f"{file}.jsonl"
        if left_out:  # recorded before the shard, so a finished shard's left-out samples are always known
            write_jsonl(record, [{"shard": file, **f} for f in left_out])
        else:
            record.unlink(missing_ok=True)  # of an earlier attempt at this shard
        shards.write(work / file, tensors)
        elapsed += time.perf_counter() - start
        computed_tokens += int(tensors["offsets"][-1])
        log.info("hidden %s: %d samples, %d tokens (%.0f tokens/s so far%s)", file, len(chunk),
                 int(tensors["offsets"][-1]), computed_tokens / max(elapsed, 1e-9),
                 f", rank {rt.rank} of {rt.world}" if rt.world > 1 else "")
    ranks = rt.gather((computed_tokens, elapsed))  # also waits until every rank's shards are written

    index = {"layers": layers, "layer_convention": features.LAYER_CONVENTION, "hidden_size": H, "dtype": dtype_name}
    failures = []
    for split in shards.SPLITS:
        entries = []
        for _split, file, chunk in (p for p in plan if p[0] == split):
            record = left_out_dir / f"{file}.jsonl"
            left_out = {f["id"]: f for _line, f in read_jsonl(record)} if record.exists() else {}
            failures += left_out.values()
            kept = [c for c in chunk if c[0] not in left_out]
            entries.append({"file": file, "samples": len(kept), "tokens": sum(len(c[1]) for c in kept),
                            "ids": [c[0] for c in kept]})
        index[split] = {"shards": entries, "samples": sum(e["samples"] for e in entries),
                        "tokens": sum(e["tokens"] for e in entries)}
    total = sum(len(p[2]) for p in plan)
    if len(failures) > params.max_failure_rate * total:
        raise UserError(f"hidden: {len(failures)} of {total} sequences fail alone, more than hidden.max_failure_rate "
                        f"{params.max_failure_rate} (reasons in {left_out_dir}; finished shards are kept)")
    total_bytes = sum((work / p[1]).stat().st_size for p in plan)
    tokens = sum(index[split]["tokens"] for split in shards.SPLITS)
    rt.barrier()  # every rank has read the work folder before rank 0 moves it
    if rt.is_main:
        if failures:
            write_jsonl(work / "failures.jsonl", failures)
        write_json(work / "index.json", index)
        # publish: the work folder becomes the output folder (a rename on the same filesystem)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(work), str(out))
        shutil.rmtree(out / left_out_dir.name)  # in failures.jsonl now
    rt.barrier()  # no rank ends before the output is in place
    computed_tokens, seconds = sum(r[0] for r in ranks), max(r[1] for r in ranks)
    bytes_el = torch.tensor([], dtype=dtype).element_size()
    return {"layers": layers, "hidden_size": H, "samples": sum(index[s]["samples"] for s in shards.SPLITS),
            "tokens": tokens, "train_tokens": index["train"]["tokens"], "valid_tokens": index["valid"]["tokens"],
            "hidden_bytes_per_token": 4 * H * bytes_el, "bytes_per_token": round(total_bytes / max(tokens, 1), 2),
            "bytes": total_bytes, "left_out": len(failures),
            "run": {"fingerprint": fp, "world": rt.world, "computed_tokens": computed_tokens,
                    "computed_shards": len(missing), "reused_shards": len(plan) - len(missing),
                    "seconds": round(seconds, 2),
                    "tokens_per_s": round(computed_tokens / seconds, 1) if seconds else None}}
