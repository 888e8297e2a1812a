"""The target's hidden states into ``data/hidden`` (layout, layer ids and readers: layout.py).

Run (``run``; rank 0 holds the lock of the store, store.py): the sequences no shard of the store holds are planned
into shards (``store.plan``), dealt round-robin to the ranks (torchrun, core/runtime.py). A shard runs its samples
sorted by length in right-padded batches of at most ``hidden.batch_tokens`` tokens (rows x longest; causal attention
never reads the padding) through a states source (``source_of``: hf_source.py in this process, or vllm_source.py),
and is written whole (``extract_shard``, ``store.write_shard``). Each sequence computed is checked against the
engine's figures as it comes (agreement.py, ``hidden.agreement``): a disagreement stops the run, publishing nothing.

Publish (rank 0, once every shard is written and every published sequence checked, ``agreement.final``; publish.py):
``data/hidden`` = hard links to (or copies of) the shards its sequences use and an index naming, in
``data/sequences`` order, each sample's shard row; no fingerprint. A reused
sequence keeps the states of the batch it was computed in (another batch shape can round a few values differently),
so a fresh or resumed run at any number of processes publishes the same bytes. A sequence that fails alone is left
out, its key and reason kept in its shard's metadata and ``failures.jsonl``; the next run retries it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglepipe.core import runtime
from eaglepipe.core.errors import UserError
from eaglepipe.core.fingerprint import code_key
from eaglepipe.dataset import sequences, shards
from eaglepipe.hidden import agreement, hf_source, layout, publish, store
from eaglepipe.hidden.comparison import Context
from eaglepipe.target import families

log = logging.getLogger(__name__)
# The code that decides the states of a sequence (core/fingerprint.py): their computation, layout and storage, what
# is published of them, and how the target is loaded. A source's own code (the vLLM source) is added by the source.
RESULT_CODE = (
    "hidden.extract",
    "hidden.hf_source",
    "hidden.store",
    "hidden.publish",
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


def source_of(model):
    """A states source for ``model``: a transformers model is wrapped (``hf_source.Forward``), a source such as
    ``vllm_source.VLLMStates`` is itself."""
    return hf_source.Forward(model) if isinstance(model, torch.nn.Module) else model


@dataclass(frozen=True)
class StoredStates:
    """One sequence's states as its shard stores them (layout.py), on the CPU: ``aux`` [n, 3H] and ``final`` [n, H]
    in ``hidden.dtype``, their float32 scales under FP8 (else None), ``top`` [n], the greedy next tokens, and
    ``target_logprob`` [n] float32, the target's log-probability of each id."""

    aux: torch.Tensor
    aux_scale: torch.Tensor | None
    final: torch.Tensor
    final_scale: torch.Tensor | None
    top: torch.Tensor
    target_logprob: torch.Tensor

    @classmethod
    def encode(cls, aux, final, top, target_logprob, dtype: str) -> StoredStates:
        """What a source gives (``aux``, ``final``, ``top``, ``target_logprob``), the states stored in ``dtype``."""
        aux_values, aux_scale = layout.encode(aux, dtype, 3)
        final_values, final_scale = layout.encode(final, dtype, 1)
        return cls(
            aux=aux_values.cpu(),
            aux_scale=None if aux_scale is None else aux_scale.cpu(),
            final=final_values.cpu(),
            final_scale=None if final_scale is None else final_scale.cpu(),
            top=top.cpu(),
            target_logprob=target_logprob.float().cpu(),
        )


def _joined(parts: list[torch.Tensor], empty_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``parts`` concatenated, or an empty tensor of ``empty_shape`` when there are none."""
    return torch.cat(parts) if parts else torch.empty(empty_shape, dtype=dtype)


def state_columns(kept: list[StoredStates], hidden_size: int, dtype: str) -> dict[str, torch.Tensor]:
    """A shard's state tensors (layout.py) of the ``kept`` sequences, in order, stored in ``dtype``."""
    kind = layout.DTYPES[dtype]
    tensors = {
        "aux": _joined([s.aux for s in kept], (0, 3 * hidden_size), kind),
        "final": _joined([s.final for s in kept], (0, hidden_size), kind),
        "top": _joined([s.top for s in kept], (0,), torch.int32).to(torch.int32),
        layout.TARGET_LOGPROB: _joined([s.target_logprob for s in kept], (0,), torch.float32),
    }
    if dtype in layout.SCALED:
        tensors["aux_scale"] = _joined([s.aux_scale for s in kept], (0, 3), torch.float32)
        tensors["final_scale"] = _joined([s.final_scale for s in kept], (0, 1), torch.float32)
    return tensors


def extract_shard(
    model, samples: list, layers: list[int], batch_tokens: int, dtype: str, check=None
) -> tuple[dict, list[dict]]:
    """(one shard's tensors (layout.py, states in ``dtype``, a ``hidden.dtype``) for ``samples`` = [(id,
    input_ids, loss_mask)] in order, the samples that failed alone [{id, tokens, reason}]); ``model``: see
    ``source_of``. ``check(i, top, target_logprob, logits_at)`` is called for each sample computed (the agreement
    check: ``agreement.Live.bound``)."""
    source = source_of(model)
    stored, failed = {}, []
    for i, got in source.states(samples, layers, batch_tokens):
        sample_id, ids = samples[i][0], samples[i][1]
        if isinstance(got, str):
            log.warning("hidden: sequence %s (%d tokens) fails alone, left out: %s", sample_id, len(ids), got)
            failed.append({"id": sample_id, "tokens": len(ids), "reason": got})
            continue
        aux, final, top, target_logprob = got
        stored[i] = StoredStates.encode(aux, final, top, target_logprob, dtype)
        if check is not None:
            check(i, top, target_logprob, _head_over(source, final))
    kept = [i for i in range(len(samples)) if i in stored]
    packed = sequences.pack([(samples[i][1], samples[i][2]) for i in kept])
    hidden_size = families.text_config(source.config).hidden_size
    return {**packed, **state_columns([stored[i] for i in kept], hidden_size, dtype)}, failed


def _head_over(source, final: torch.Tensor):
    """``logits_at(rows)``: the source's float32 logits over the ``final`` states at the positions ``rows``."""
    return lambda rows: source.logits(final[rows])


@dataclass(frozen=True)
class Computed:
    """What one rank computed: the tokens of the shards it wrote, the seconds it took, and the agreement fallback's
    figures of its sequences, by id (agreement.Live.tallies)."""

    tokens: int
    seconds: float
    tallies: dict


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
    run report (the same on every rank). ``model``: see ``source_of``; ``params``: config.Hidden. The agreement
    check takes the answers' engine and its dtype from ``seq_folder``'s policy (comparison.Context)."""
    source = source_of(model)
    num_layers = families.text_config(source.config).num_hidden_layers
    layers = layout.layer_ids(params.layers, num_layers)
    store_dir = Path(cache_root) / fingerprint(params.tracked(), layers, model_fp, source.dtype, source.code)
    policy = shards.load_index(seq_folder).get("policy")
    ctx = Context.of(params.agreement, policy, source.compute_dtype)
    with rt.locked(store_dir):  # another run waits instead of deleting this one's files in flight
        return _run(Path(seq_folder), Path(out), source, params, layers, store_dir, rt, ctx)


def _run(seq_folder: Path, out: Path, source, params, layers: list, store_dir: Path, rt: runtime.Runtime, ctx) -> dict:
    """``run`` under the lock of the store ``store_dir``, checking agreement in ``ctx`` (comparison.Context)."""
    seqs = store.read_sequences(seq_folder)
    plan = store.plan(store_dir, seq_folder, seqs, params.shard_tokens, rt)
    mine = plan.missing[rt.rank :: rt.world]
    live = agreement.live(ctx, sum(len(keys) for keys in mine))
    computed = _compute(store_dir, mine, seqs, source, layers, params, rt, live)
    header = {
        "layers": layers,
        "layer_convention": layout.LAYER_CONVENTION,
        "hidden_size": families.text_config(source.config).hidden_size,
        "dtype": params.dtype,
    }
    published = publish.index_of(store_dir, seqs, plan.existing, header)
    total = sum(len(items) for items in seqs.values())
    if len(published.failures) > params.max_failure_rate * total:
        raise UserError(
            f"hidden: {len(published.failures)} of {total} sequences fail alone, more than hidden.max_failure_rate "
            f"{params.max_failure_rate} (reasons in the metadata of the shards in {store_dir}; finished shards "
            "are kept, and a rerun tries the failed sequences again)"
        )
    tallies = {sid: tally for rank in computed for sid, tally in rank.tallies.items()}
    checked = agreement.final(store_dir, published.index, seqs, ctx, tallies)  # may stop the stage: nothing published
    if rt.is_main:
        publish.publish(store_dir, out, published)
    rt.barrier()  # no rank ends before the output is in place
    return {**_report(store_dir, plan, published, computed, rt.world, source.report), "agreement": checked}


def _compute(store_dir: Path, mine: list, seqs: store.Splits, source, layers: list, params, rt: runtime.Runtime, live):
    """Write this rank's share ``mine`` of the missing shards into the store ``store_dir``, each sequence checked by
    ``live`` (agreement.Live, or None); return every rank's ``Computed``."""
    by_key = {seq.key: seq for split in seqs.values() for seq in split}
    tokens, seconds = 0, 0.0
    for keys in mine:
        start = time.perf_counter()
        chosen = [by_key[key] for key in keys]
        samples = [(seq.key, seq.ids, seq.mask) for seq in chosen]
        check = live.bound(chosen) if live is not None else None
        tensors, left_out = extract_shard(source, samples, layers, params.batch_tokens, params.dtype, check)
        store.write_shard(store_dir, keys, tensors, left_out)
        seconds += time.perf_counter() - start
        tokens += int(tensors["offsets"][-1])
        log.info(
            "hidden %s: %d samples, %d tokens (%.0f tokens/s so far%s)",
            store.shard_name(keys),
            len(keys),
            int(tensors["offsets"][-1]),
            tokens / max(seconds, 1e-9),
            f", rank {rt.rank} of {rt.world}" if rt.world > 1 else "",
        )
    if live is not None:
        live.finish()
    return rt.gather(Computed(tokens, seconds, live.tallies() if live is not None else {}))


def _report(
    store_dir: Path, plan: store.Plan, published: publish.Published, computed: list[Computed], world: int, extra
) -> dict:
    """The run report, from the store ``store_dir``, the ``plan``, what was ``published``, every rank's ``Computed``,
    and the source's ``extra`` figures."""
    index, files = published.index, published.files
    hidden_size = index["hidden_size"]
    tokens = sum(rank.tokens for rank in computed)
    seconds = max(rank.seconds for rank in computed)
    total_bytes = sum((store_dir / f).stat().st_size for f in files)
    stored = sum(shards.tokens_held(store_dir / f) for f in files)  # with the rows a reused shard holds for other data
    return {
        "layers": index["layers"],
        "hidden_size": hidden_size,
        "samples": published.samples,
        "tokens": published.tokens,
        "train_tokens": index.get("train", {}).get("tokens", 0),
        "valid_tokens": index.get("valid", {}).get("tokens", 0),
        "hidden_bytes_per_token": layout.bytes_per_token(hidden_size, index["dtype"]),
        "stored_tokens": stored,
        "bytes_per_token": round(total_bytes / max(stored, 1), 2),
        "bytes": total_bytes,
        "left_out": len(published.failures),
        "run": {
            "fingerprint": store_dir.name,
            "world": world,
            "computed_tokens": tokens,
            "computed_shards": len(plan.missing),
            "reused_shards": len([f for f in files if f in plan.existing]),
            "reused_sequences": published.reused_sequences,
            "computed_sequences": published.samples - published.reused_sequences,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            **extra,
        },
    }
