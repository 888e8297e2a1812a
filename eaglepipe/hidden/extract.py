"""The target's hidden states into ``data/hidden`` (layout, layer ids and reader: ``features.py``).

Store ``.cache/hidden/<fingerprint>/`` (``fingerprint``): shards of states keyed by content (``sequence_key``). A
shard's safetensors metadata ``content`` ({keys, failed}) lists its samples and the sequences that failed in it, so
the store is its own index: a run computes only the sequences no shard holds, whatever the order, split or shard
layout merge gives the data.

Run (rank 0 holds the store's lock): the missing sequences (unique keys, in ``data/sequences`` order) are planned into
shards of at most ``hidden.shard_tokens`` tokens; the plan is saved under the sequences' hash and ``shard_tokens``
(``plans/``) so a resumed run computes the same shards, dealt round-robin to the ranks (torchrun, ``runtime.py``). A
shard runs its samples sorted by length in right-padded batches of at most ``hidden.batch_tokens`` tokens (rows x
longest; causal attention never reads the padding), is named by the hash of its keys and written atomically: one that
exists is finished, and a killed process loses only the shard it was writing.

Publish (rank 0, once every shard is written): ``data/hidden`` = hard links to (or copies of) the shards its sequences
use and an index naming, in ``data/sequences`` order, each sample's shard row (``shards.py``); no fingerprint. A
reused sequence keeps the states of the batch it was computed in (another batch shape can round a few values
differently), so a fresh or resumed run at any number of processes publishes the same bytes. A sequence that fails
alone is left out, its key and reason kept in its shard's metadata and ``failures.jsonl``; the next run retries it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open

from eaglepipe.core import runtime
from eaglepipe.core.errors import UserError
from eaglepipe.core.fingerprint import code_key
from eaglepipe.core.records import write_json, write_jsonl
from eaglepipe.dataset import sequences, shards
from eaglepipe.hidden import layout as features
from eaglepipe.target import families

log = logging.getLogger(__name__)
# The code that decides the states of a sequence (core/fingerprint.py): their computation, layout and storage, and
# how the target is loaded. A source's own code (the vLLM source) is added by the source.
RESULT_CODE = (
    "hidden.extract",
    "hidden.layout",
    "dataset.shards",
    "target.model",
    "target.quant",
    "target.families",
    "core.runtime",
)


def fingerprint(params: dict, layers: list[int], model_fp: str, model_dtype: str = "", code: tuple = ()) -> str:
    """The store's name: a hash of what decides a sequence's states: the params but ``shard_tokens``, the layers,
    the code (``RESULT_CODE`` and the source's ``code``), the model (files, compute dtype;
    for vLLM its version) and library versions. Not the sequences: the store holds states by content."""
    import transformers

    code = code_key([*RESULT_CODE, *code])
    blob = json.dumps(
        {
            "params": {k: v for k, v in params.items() if k != "shard_tokens"},
            "layers": layers,
            "code": code,
            "model": model_fp,
            "model_dtype": model_dtype,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sequence_key(ids, mask) -> str:
    """A sequence's content key: the sha256 of its ids (int32) and loss mask (uint8) bytes, 32 hex digits."""
    h = hashlib.sha256(torch.as_tensor(ids).to(torch.int32).numpy().tobytes())
    h.update(torch.as_tensor(mask).to(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def shard_name(keys: list[str]) -> str:
    return f"shard-{hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:16]}.safetensors"


def content(path: Path) -> dict:
    """A finished shard's metadata ``content``: {keys: the samples it holds, failed: [{key, tokens, reason}]}."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta.get("content", '{"keys": [], "failed": []}'))


def scan(store: Path) -> tuple[dict, dict]:
    """({key: (shard file, row)}, {key: {key, tokens, reason, shard}}) from the metadata of the finished shards in
    ``store``. A key some shard holds is not failed; a failure names a shard that holds samples too where there is
    one (a retry's shard of failures alone is never published)."""
    held, failed = {}, {}
    found = [(path.name, content(path)) for path in sorted(store.glob("shard-*.safetensors"))]
    for name, got in sorted(found, key=lambda found: not found[1]["keys"]):  # shards with samples first
        for row, key in enumerate(got["keys"]):
            held.setdefault(key, (name, row))
        for fail in got["failed"]:
            failed.setdefault(fail["key"], {**fail, "shard": name})
    return held, {key: fail for key, fail in failed.items() if key not in held}


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
def greedy(model, states: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """int64 [n]: the output head's argmax over final states [n, H], ``rows`` at a time (a big batch's logits would
    not fit)."""
    head = model.get_output_embeddings()
    return torch.cat([head(states[r : r + rows]).argmax(-1) for r in range(0, states.shape[0], rows)])


class Forward:
    """States source for ``hidden.engine: hf``: a transformers target in this process (vLLM's: engines/states.py).
    The fingerprint and the index read ``config`` and ``dtype``."""

    def __init__(self, model):
        self.model, self.config, self.dtype = model, model.config, str(model.dtype)
        self.code, self.report = (), {}

    @torch.inference_mode()
    def states(self, samples: list, layers: list[int], batch_tokens: int, pad_id: int = 0):
        """Yield (index into ``samples`` = [(key, ids, mask)], (aux, final, top) or the reason it failed), in
        right-padded batches of at most ``batch_tokens``; a failing batch (out of memory, a bad id) is retried in
        halves down to one sample, so a poison sequence never takes its batch mates down."""
        model, lengths = self.model, [len(s[1]) for s in samples]

        def run_batch(batch):
            ids = torch.full(
                (len(batch), max(lengths[i] for i in batch)), pad_id, dtype=torch.long, device=model.device
            )
            for row, i in enumerate(batch):
                ids[row, : lengths[i]] = torch.as_tensor(samples[i][1])
            try:
                a, f = forward_states(model, ids, layers)
            except (RuntimeError, ValueError, IndexError, MemoryError) as e:  # torch's OutOfMemoryError included
                if len(batch) == 1:  # the reason is stored: no device name or free memory in it (a shard's bytes)
                    yield (
                        batch[0],
                        type(e).__name__
                        if isinstance(e, (torch.OutOfMemoryError, MemoryError))
                        else f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                    )
                    return
                log.warning("a batch of %d sequences failed (%s): retrying it in halves", len(batch), type(e).__name__)
                yield from run_batch(batch[: len(batch) // 2])
                yield from run_batch(batch[len(batch) // 2 :])
                return
            for row, i in enumerate(batch):
                n = lengths[i]
                yield i, (a[row, :n], f[row, :n], greedy(model, f[row, :n]))

        for batch in sequences.plan_batches(lengths, batch_tokens):
            yield from run_batch(batch)


def source_of(model):
    """A states source (``Forward`` or engines.states.VLLMStates) for ``model``: a transformers model is wrapped."""
    return Forward(model) if isinstance(model, torch.nn.Module) else model


def extract_shard(model, samples: list, layers: list[int], batch_tokens: int, dtype: str) -> tuple[dict, list[dict]]:
    """(one shard's tensors (``features.py``, states in ``dtype``, a ``hidden.dtype``) for ``samples`` = [(id,
    input_ids, loss_mask)] in order, the samples that failed alone [{id, tokens, reason}]); ``model``: see
    ``source_of``."""
    source, lengths, rows, failed = source_of(model), [len(s[1]) for s in samples], {}, []
    for i, got in source.states(samples, layers, batch_tokens):
        if isinstance(got, str):
            log.warning("hidden: sequence %s (%d tokens) fails alone, left out: %s", samples[i][0], lengths[i], got)
            failed.append({"id": samples[i][0], "tokens": lengths[i], "reason": got})
            continue
        a, f, top = got
        stored = [*features.encode(a, dtype, 3), *features.encode(f, dtype, 1)]
        rows[i] = [None if x is None else x.cpu() for x in stored] + [top.cpu()]
    kept = [i for i in range(len(samples)) if i in rows]
    packed = sequences.pack([(samples[i][1], samples[i][2]) for i in kept])
    H, kind = families.text_config(source.config).hidden_size, features.DTYPES[dtype]

    def stack(part: int, width: int, kind: torch.dtype) -> torch.Tensor:
        """The kept rows' ``part``, concatenated; with none kept, an empty tensor of ``width`` columns (0: 1-D)."""
        return torch.cat([rows[i][part] for i in kept]) if kept else torch.empty((0, width) if width else 0, dtype=kind)

    tensors = {
        **packed,
        "aux": stack(0, 3 * H, kind),
        "final": stack(2, H, kind),
        "top": stack(4, 0, torch.int32).to(torch.int32),
    }
    if dtype in features.SCALED:
        tensors |= {"aux_scale": stack(1, 3, torch.float32), "final_scale": stack(3, 1, torch.float32)}
    return tensors, failed


SKIPPED = "train.features is online: train computes the states itself, hidden extracts nothing"


def skip(out) -> dict:
    """Online training: publish ``out`` as only an index saying why it holds no states; return the run report."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_json(out / "index.json", {"skipped": SKIPPED})
    return {"skipped": SKIPPED, "samples": 0, "tokens": 0, "run": {"computed_tokens": 0}}


def shards_of(seqs: dict, wanted, shard_tokens: int) -> list[list[str]]:
    """The keys of ``seqs`` that ``wanted`` picks, each once, in order, cut into shards of at most ``shard_tokens``."""
    todo = {}
    for key, ids in ((key, ids) for split in seqs.values() for _rid, ids, _mask, key in split):
        if wanted(key):
            todo.setdefault(key, len(ids))
    keys = list(todo)
    return [keys[a:b] for a, b in shards.plan(list(todo.values()), shard_tokens)]


def make_plan(store: Path, plan_path: Path, seqs: dict, shard_tokens: int) -> list[list[str]]:
    """The shards to compute: the saved plan when its unfinished shards hold exactly the keys the store lacks (a
    resumed run), else a new plan of them, saved. Failed sequences are ``retry_plan``'s."""
    held, failed = scan(store)
    plan = shards_of(seqs, lambda key: key not in held and key not in failed, shard_tokens)
    if plan_path.exists():
        saved = json.loads(plan_path.read_text())
        unfinished = {k for keys in saved if not (store / shard_name(keys)).exists() for k in keys}
        if unfinished == {k for keys in plan for k in keys}:
            return saved
    write_json(plan_path, plan)
    return plan


def retry_plan(store: Path, seqs: dict, shard_tokens: int) -> list[list[str]]:
    """Shards of the sequences that failed before and no shard holds: each run retries them (a server fault or a
    passing lack of memory heals), after the plan, so a resumed run publishes what an uninterrupted one does."""
    failed = scan(store)[1]
    return shards_of(seqs, lambda key: key in failed, shard_tokens)


def run(
    seq_folder,
    out,
    model,
    params,
    model_fp: str,
    cache_root,
    rt: runtime.Runtime = runtime.Runtime(),  # noqa: B008  Runtime is frozen: the one-process default is a constant
) -> dict:
    """Publish the states of every split of ``seq_folder`` into ``out``, computing those the store lacks; return the
    run report (the same on every rank). ``model``: see ``source_of``; ``params``: config.Hidden."""
    model = source_of(model)
    store = Path(cache_root) / fingerprint(
        params.tracked(),
        features.layer_ids(params.layers, families.text_config(model.config).num_hidden_layers),
        model_fp,
        model.dtype,
        model.code,
    )
    with rt.locked(store):  # another run waits instead of deleting this one's files in flight
        return _run(seq_folder, out, model, params, store, rt)


def _run(seq_folder, out, model, params, store: Path, rt: runtime.Runtime) -> dict:
    """``run`` under the store's lock."""
    seq_folder, out = Path(seq_folder), Path(out)
    cfg = families.text_config(model.config)
    layers = features.layer_ids(params.layers, cfg.num_hidden_layers)
    seq_index = shards.load_index(seq_folder)
    seqs = {
        split: [
            (rid, ids, mask, sequence_key(ids, mask)) for rid, _source, ids, mask in sequences.read(seq_folder, split)
        ]
        for split in shards.SPLITS
        if split in seq_index
    }
    plan, before = _plan(store, seq_folder, seqs, params.shard_tokens, rt)
    missing = [keys for keys in plan if shard_name(keys) not in before]
    ranks = _compute(store, missing, seqs, model, layers, params, rt)
    index = {
        "layers": layers,
        "layer_convention": features.LAYER_CONVENTION,
        "hidden_size": cfg.hidden_size,
        "dtype": params.dtype,
    }
    failures, used, reused_sequences = _index(store, seqs, before, index)
    total = sum(len(items) for items in seqs.values())
    if len(failures) > params.max_failure_rate * total:
        raise UserError(
            f"hidden: {len(failures)} of {total} sequences fail alone, more than hidden.max_failure_rate "
            f"{params.max_failure_rate} (reasons in the metadata of the shards in {store}; finished shards "
            "are kept, and a rerun tries the failed sequences again)"
        )
    if rt.is_main:
        _publish(store, out, used, index, failures)
    rt.barrier()  # no rank ends before the output is in place
    computed_tokens, seconds = sum(r[0] for r in ranks), max(r[1] for r in ranks)
    total_bytes = sum((store / f).stat().st_size for f in used)
    tokens = sum(index[split]["tokens"] for split in seqs)
    stored = sum(shards.tokens_held(store / f) for f in used)  # with the rows a reused shard holds for other data
    H = cfg.hidden_size
    return {
        "layers": layers,
        "hidden_size": H,
        "samples": sum(index[s]["samples"] for s in seqs),
        "tokens": tokens,
        "train_tokens": index.get("train", {}).get("tokens", 0),
        "valid_tokens": index.get("valid", {}).get("tokens", 0),
        "hidden_bytes_per_token": features.bytes_per_token(H, params.dtype),
        "stored_tokens": stored,
        "bytes_per_token": round(total_bytes / max(stored, 1), 2),
        "bytes": total_bytes,
        "left_out": len(failures),
        "run": {
            "fingerprint": store.name,
            "world": rt.world,
            "computed_tokens": computed_tokens,
            "computed_shards": len(missing),
            "reused_shards": len([f for f in used if f in before]),
            "reused_sequences": reused_sequences,
            "computed_sequences": total - len(failures) - reused_sequences,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(computed_tokens / seconds, 1) if seconds else None,
            **model.report,
        },
    }


def _plan(store: Path, seq_folder: Path, seqs: dict, shard_tokens: int, rt: runtime.Runtime) -> tuple[list, set]:
    """(the plan then ``retry_plan``'s, each shard a list of keys; the names of the shards already held). Rank 0
    first deletes what a stopped run left half-written (the lock: no other run is writing) and the shards of
    failures alone, so they are computed again, and writes the plan."""
    plan_path = store / "plans" / f"{shards.dataset_hash(seq_folder)[:32]}-{shard_tokens}.json"
    if rt.is_main:
        for stale in store.glob("**/*.tmp*"):
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
        for path in store.glob("shard-*.safetensors"):
            if not content(path)["keys"]:
                path.unlink()
        make_plan(store, plan_path, seqs, shard_tokens)
    rt.barrier()  # the plan is written before any rank reads it
    plan = json.loads(plan_path.read_text()) + retry_plan(store, seqs, shard_tokens)
    before = {p.name for p in store.glob("shard-*.safetensors")}
    rt.barrier()  # every rank has listed the finished shards before any is written
    return plan, before


def _compute(store: Path, missing: list, seqs: dict, model, layers: list, params, rt: runtime.Runtime) -> list:
    """Write this rank's share of the ``missing`` shards; return every rank's (tokens, seconds)."""
    by_key = {key: (ids, mask) for split in seqs.values() for _rid, ids, mask, key in split}
    computed_tokens, elapsed = 0, 0.0
    for keys in missing[rt.rank :: rt.world]:
        start = time.perf_counter()
        tensors, left_out = extract_shard(
            model, [(k, *by_key[k]) for k in keys], layers, params.batch_tokens, params.dtype
        )
        gone = {f["id"] for f in left_out}
        meta = {
            "content": json.dumps(
                {  # one key: safetensors writes several in no fixed order
                    "keys": [k for k in keys if k not in gone],
                    "failed": [{"key": f["id"], "tokens": f["tokens"], "reason": f["reason"]} for f in left_out],
                }
            )
        }
        shards.write(store / shard_name(keys), tensors, meta)
        elapsed += time.perf_counter() - start
        computed_tokens += int(tensors["offsets"][-1])
        log.info(
            "hidden %s: %d samples, %d tokens (%.0f tokens/s so far%s)",
            shard_name(keys),
            len(keys),
            int(tensors["offsets"][-1]),
            computed_tokens / max(elapsed, 1e-9),
            f", rank {rt.rank} of {rt.world}" if rt.world > 1 else "",
        )
    return rt.gather((computed_tokens, elapsed))


def _index(store: Path, seqs: dict, before: set, index: dict) -> tuple[list, list, int]:
    """Fill ``index`` with each split's entries (each sequence's shard and row, in order); return (the failed
    sequences, the shard files used in order, how many sequences came from shards held before)."""
    held, failed = scan(store)
    failures, used, reused_sequences = [], [], 0
    for split, items in seqs.items():
        entries = []
        for rid, ids, _mask, key in items:
            if key in failed:
                failures.append(
                    {"id": rid, "shard": failed[key]["shard"], "tokens": len(ids), "reason": failed[key]["reason"]}
                )
                continue
            file, row = held[key]
            reused_sequences += file in before
            if not entries or entries[-1]["file"] != file:
                entries.append({"file": file, "samples": 0, "tokens": 0, "ids": [], "rows": []})
                used.append(file)
            e = entries[-1]
            e["samples"], e["tokens"] = e["samples"] + 1, e["tokens"] + len(ids)
            e["ids"].append(rid)
            e["rows"].append(row)
        index[split] = {
            "shards": entries,
            "samples": sum(e["samples"] for e in entries),
            "tokens": sum(e["tokens"] for e in entries),
        }
    return failures, list(dict.fromkeys(used)), reused_sequences


def _publish(store: Path, out: Path, used: list, index: dict, failures: list) -> None:
    """``out`` = links to the ``used`` shards, the index and the failures, built aside and renamed into place."""

    work = store / f"publish.tmp{os.getpid()}"
    work.mkdir()
    for f in used:
        try:
            os.link(store / f, work / f)
        except OSError:  # a filesystem without hard links, or a file linked too often
            shutil.copy2(store / f, work / f)
    if failures:
        write_jsonl(work / "failures.jsonl", failures)
    write_json(work / "index.json", index)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(work), str(out))  # a rename on the same filesystem
