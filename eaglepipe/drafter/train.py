"""Training the EAGLE-3 drafter on the target's hidden states (layout: hidden/layout.py) with training-time test
(eagle3/ttt.py): AdamW, linear warmup then cosine decay to 0, gradient clipping, seeded.

``train.autocast: bfloat16`` runs the forward, the target's logits included, in bf16 matmuls under ``torch.autocast``
(``auto``: where the device has native bf16 matmuls, ``resolved``); weights, optimizer, softmax and loss stay float32.

``train.features``: ``offline`` reads ``data/hidden``; ``online`` runs the frozen target on ``data/sequences``
(drafter/sources.py); ``streamed`` has a vLLM server compute them ahead of the trainer, through a spool bounded in
bytes (drafter/spool.py, fed by ``schedule``). Either way ids and masks stay in memory and a batch's states are read,
or computed, when it is collated. The draft vocabulary is counted from the ids.

Batches: ``sequences.plan_batches`` per epoch, seeded by seed and epoch; global, whatever the number of processes.

Processes (torchrun, core/runtime.py): ``Runtime.wrap`` wraps ``TTT``. Rank r of W takes rows r, r + W, .. of each
global batch (a rank left without a row runs the first at weight 0); its loss is divided by the batch's global number
of loss positions per step and multiplied by W, so the ranks' mean gradient is the whole batch's. Validation batches
are dealt round-robin and their sums added. Rank 0 writes.

Checkpoints (drafter/checkpoint.py: ``<checkpoints>/state.pt``, every ``checkpoint_every`` steps and at each epoch's
end) hold the run's whole state and nothing that depends on the world size. Batches are a pure function of (seed,
epoch): a resumed run ends where an uninterrupted one does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from eaglepipe.core import runtime, uncertainty
from eaglepipe.core.errors import UserError
from eaglepipe.core.fingerprint import code_key
from eaglepipe.dataset import sequences
from eaglepipe.drafter import checkpoint, figures, methods
from eaglepipe.drafter.checkpoint import Progress
from eaglepipe.drafter.eagle3 import init
from eaglepipe.drafter.eagle3.model import DraftBase, Eagle3Draft, build_vocab
from eaglepipe.drafter.eagle3.ttt import TTT, StepStats, collate, noisy
from eaglepipe.drafter.sources import Online, features_of, load_samples, token_counts
from eaglepipe.drafter.spool import Spool
from eaglepipe.hidden import layout
from eaglepipe.target import compat, families, quant

log = logging.getLogger(__name__)
# The code that decides the trained drafter (core/fingerprint.py): the model, its start, the objective, the training
# run, its data and checkpoint, the states' reading, and the target's weights as the start reads them. The states'
# own code is in the features' identity.
RESULT_CODE = (
    "drafter.train",
    "drafter.sources",
    "drafter.checkpoint",
    "drafter.methods",
    "hidden.layout",
    "dataset.shards",
    "dataset.sequences",
    "target.compat",
    "target.families",
    "target.quant",
    "target.model",
    "core.runtime",
)


def target_tensors(folder, layer: int) -> dict:
    """From the target's safetensors files, without loading the model: float32 ``embed`` (input embedding),
    ``head`` (output head; the embedding when tied) and ``norm`` (final norm), and for eagle3/init.py's
    ``init_from_target`` ``layer`` {name: weight as stored} (decoder layer ``layer``'s weights among
    ``init.LAYER_WEIGHTS``), ``layer_names`` (all of that layer's weight names), ``layer_index`` and ``model_type``
    (its language model's). Names as compat.names finds them (a composite's under its wrapper's prefix); FP8-block
    weights with their scales are read dequantized to float32 (target/quant.py)."""
    folder = Path(folder)
    stored = compat.weights(folder)
    names = compat.names(stored)
    prefix = f"{names.layers}{layer}."
    layer_names = sorted(
        n[len(prefix) :]
        for n in stored
        if n.startswith(prefix) and not (n.endswith(quant.SCALE) and n[: -len(quant.SCALE)] in stored)
    )
    missing = [name for name in (names.embed, names.norm) if name not in stored]
    if missing or not layer_names:
        raise KeyError(
            f"{folder}: no {missing or prefix + '*'} in the safetensors files (compat.check names what a target needs)"
        )
    found = compat.read(folder, {"embed": names.embed, **{w: prefix + w for w in init.LAYER_WEIGHTS}}, stored)
    head, norm = compat.head_and_norm(folder, stored)
    return {
        "embed": found["embed"].float(),
        "head": head,
        "norm": norm,
        "layer": {w: found[w] for w in init.LAYER_WEIGHTS if w in found},
        "layer_names": layer_names,
        "layer_index": layer,
        "model_type": families.text_config(families.load_config(folder)).model_type,
    }


def summed_over_ranks(stats: StepStats, rt: runtime.Runtime) -> StepStats:
    """Every rank's ``stats`` added up, on every rank."""
    return StepStats.from_table(rt.all_sum(stats.table()))


@torch.no_grad()
def evaluate(
    model,
    feats,
    samples,
    steps,
    head_draft,
    batch_tokens,
    bf16: bool = False,
    rt: runtime.Runtime = runtime.Runtime(),  # noqa: B008  Runtime is frozen: the one-process default is a constant
) -> list[dict]:
    """Per-step loss and accuracy over ``samples`` (states from ``feats``; batches dealt round-robin to the ranks),
    each accuracy with its standard error over the samples (``acc_se``, core/uncertainty.py)."""
    model.eval()
    total = StepStats.zeros(steps)
    per_sample = {}  # sample -> (correct, positions), each per step
    for idx in valid_batches(samples, batch_tokens, rt):
        rows = [samples[i] for i in idx]
        batch = collate(rows, feats.states(rows), steps, head_draft, model.t2d)
        with autocast(bf16, head_draft.device):
            _, stats = methods.objective_of(model)(model, batch, steps, per_row=True)
        stats = stats.cpu()
        total = total + stats
        per_sample.update(zip(idx, zip(stats.row_correct.T.tolist(), stats.row_positions.T.tolist())))
    model.train()
    counts = [c for part in rt.gather(per_sample) for c in part.values()]
    summary = []
    for k, row in enumerate(summed_over_ranks(total, rt).summary()):
        se = uncertainty.ratio_se([correct[k] for correct, _ in counts], [positions[k] for _, positions in counts])
        summary.append(row | {"acc_se": None if se is None else round(se, 5)})
    return summary


def valid_batches(samples, batch_tokens: int, rt: runtime.Runtime) -> list[list[int]]:
    """This rank's validation batches (indices into ``samples``): length-sorted, dealt round-robin."""
    return sequences.plan_batches([s.ids.shape[0] for s in samples], batch_tokens)[rt.rank :: rt.world]


def rows_of(idx: list[int], rt: runtime.Runtime) -> tuple[list[int], float]:
    """(this rank's rows of the global batch ``idx``, their weight): rank r of W takes rows r, r + W, ..; a rank left
    without a row runs the first at weight 0."""
    rows = idx[rt.rank :: rt.world]
    return (rows, float(rt.world)) if rows else (idx[:1], 0.0)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def optimizer(model, p) -> torch.optim.AdamW:
    """AdamW over the drafter's trained weights (a frozen head left out: ``train.freeze_head``), as ``p`` sets it."""
    return torch.optim.AdamW(
        [w for w in model.parameters() if w.requires_grad], lr=p.lr, betas=p.betas, weight_decay=p.weight_decay
    )


def fingerprint(feats, params, target_fp: str) -> str:
    """Hash of ``feats.identity()``, the train params, the code that decides the drafter (``RESULT_CODE`` and its
    method's ``code``: drafter/methods.py), torch's version and the target's fingerprint."""
    blob = json.dumps(
        {
            "features": feats.identity(),
            "code": code_key(RESULT_CODE + methods.METHODS[params.method].code),
            "params": params.tracked(),
            "target": target_fp,
            "torch": torch.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def resolved(p, device: torch.device):
    """``p`` with ``autocast: auto`` made bfloat16 where ``device`` has native bf16 matmuls (runtime.native_bf16),
    else none."""
    if p.autocast != "auto":
        return p
    return p.model_copy(update={"autocast": "bfloat16" if runtime.native_bf16(device) else "none"})


def uses_bf16(p) -> bool:
    """Whether the ``resolved`` ``train.autocast`` asks for bf16."""
    if p.autocast == "auto":
        raise ValueError("train.autocast auto must be resolved for a device first (train.resolved)")
    return p.autocast == "bfloat16"


def autocast(bf16: bool, device: torch.device):
    """The context the drafter's forward runs in: ``torch.autocast`` to bf16 if ``bf16``."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def setup(feats, target_folder, p, keep=None):
    """(seeded drafter, train samples, valid samples, the target head's rows of the draft vocabulary (bf16 under
    ``train.autocast: bfloat16``), the train split's loss-masked token counts) for ``feats`` (``features_of``)."""
    feats = features_of(feats)
    tgt = target_tensors(target_folder, feats.layers[2])
    train_set = load_samples(feats.folder, "train", p.positions, keep)
    valid_set = load_samples(feats.folder, "valid") if "valid" in feats.splits else []  # as at inference
    if not train_set:
        raise UserError(f"{feats.folder}: no training sample has a position to train (two generated tokens)")
    runtime.seed(p.seed)
    counts = token_counts(train_set)
    config = families.load_config(target_folder)
    method = methods.METHODS[p.method]
    layer = methods.layer_of(p, families.of(config).drafter)
    cfg = method.config.from_target(config, p.draft_vocab_size, feats.layers, layer, **methods.draft_options(p))
    model = method.model(cfg, tgt["embed"])
    model.set_vocab(*build_vocab(counts, cfg.draft_vocab_size, cfg.vocab_size))
    if p.init == "target":
        if not isinstance(model, Eagle3Draft):
            raise UserError(
                f"train.init target starts EAGLE-3's layer from the target's; method {p.method}: fresh or head"
            )
        init.init_from_target(model, tgt)
    elif p.init == "head":
        init.init_head(model, tgt)
        log.info("drafter init: head: lm_head and norm from the target, the rest from the seeded default init")
    else:
        log.info("drafter init: fresh: every weight from the seeded default init (train.init)")
    if p.freeze_head:
        model.lm_head.weight.requires_grad_(False)
        model.norm.weight.requires_grad_(False)
    head_draft = tgt["head"][model.to_target(torch.arange(cfg.draft_vocab_size))]
    if uses_bf16(p):
        head_draft = head_draft.bfloat16()
    return model, train_set, valid_set, head_draft, counts


@dataclass
class Training:
    """One run: what it trains and on what (``build``), and how far it has got (what a checkpoint holds)."""

    p: object  # the train params (config.Train)
    feats: layout.Stored | Online | Spool
    model: DraftBase  # on the run's device (eagle3/model.py; dflash/model.py)
    net: nn.Module  # the TTT objective over ``model``, as the world trains it (Runtime.wrap)
    train_set: list[layout.Sample]
    valid_set: list[layout.Sample]
    head_draft: torch.Tensor  # the target head's rows of the draft vocabulary
    counts: Counter  # loss-masked token counts of the train split
    plans: list  # per epoch, its batches (lists of train_set indices)
    opt: torch.optim.AdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    progress: Progress
    trained_tokens: int = 0  # by this process, since it started


def build(feats, target_folder, p, keep, rt: runtime.Runtime) -> Training:
    """The drafter (seeded), its data, batches, optimizer and schedule, on ``rt``'s device, at epoch 0."""
    feats = features_of(feats)
    model, train_set, valid_set, head_draft, counts = setup(feats, target_folder, p, keep)
    model, head_draft = model.to(rt.device), head_draft.to(rt.device)
    net = rt.wrap(TTT(model, p.ttt_steps, p.step_weight, methods.METHODS[p.method].objective))
    lengths = [s.ids.shape[0] for s in train_set]
    plans = [sequences.plan_batches(lengths, p.batch_tokens, p.seed, e) for e in range(p.epochs)]
    total_steps = sum(len(b) for b in plans)
    opt = optimizer(model, p)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, p.warmup_steps, total_steps))
    return Training(
        p=p,
        feats=feats,
        model=model,
        net=net,
        train_set=train_set,
        valid_set=valid_set,
        head_draft=head_draft,
        counts=counts,
        plans=plans,
        opt=opt,
        sched=sched,
        progress=Progress(running=StepStats.zeros(p.ttt_steps)),
    )


def step(t: Training, idx: list[int], rt: runtime.Runtime) -> None:
    """One optimizer step on the global batch ``idx``, this rank computing its rows (module docstring)."""
    rows, weight = rows_of(idx, rt)
    mine = [t.train_set[i] for i in rows]
    batch = collate(mine, t.feats.states(mine), t.p.ttt_steps, t.head_draft, t.model.t2d)
    if t.p.feature_noise:
        keys = [(t.p.seed, t.progress.epoch, i) for i in rows]
        batch = replace(batch, aux=noisy(batch.aux, t.p.feature_noise, keys, [s.ids.shape[0] for s in mine]))
    norm = batch.kept if weight else torch.zeros_like(batch.kept)
    batch = replace(batch, norm=rt.all_sum(norm).tolist(), weight=weight)
    with autocast(uses_bf16(t.p), rt.device):
        loss, stats = t.net(batch)
    t.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(t.model.parameters(), t.p.grad_clip)
    t.opt.step()
    t.sched.step()
    if weight:
        t.progress.running = t.progress.running + stats.cpu()
    t.trained_tokens += sum(t.train_set[i].ids.shape[0] for i in idx)


def schedule(t: Training, rt: runtime.Runtime) -> list[tuple[str, list[layout.Sample]]]:
    """[(label, samples)]: the batches of samples this rank will ask states for, in order, from ``t``'s progress on:
    each epoch's rows (``rows_of``), then its validation batches; labelled ``e<epoch>-t<batch>`` and
    ``e<epoch>-v<batch>`` (a streamed run's spool, drafter/spool.py)."""
    uses = []
    for number in range(t.progress.epoch, len(t.plans)):
        first = t.progress.batch if number == t.progress.epoch else 0
        for b, idx in enumerate(t.plans[number][first:], first):
            uses.append((f"e{number}-t{b}", [t.train_set[i] for i in rows_of(idx, rt)[0]]))
        for b, idx in enumerate(valid_batches(t.valid_set, t.p.batch_tokens, rt)):
            uses.append((f"e{number}-v{b}", [t.valid_set[i] for i in idx]))
    return uses


def epoch(t: Training, path: Path, rt: runtime.Runtime) -> None:
    """The rest of the current epoch, checkpointed every ``checkpoint_every`` steps, then its history rows (train
    running means, validation) and a checkpoint at the next epoch's start."""
    progress = t.progress
    for idx in t.plans[progress.epoch][progress.batch :]:
        step(t, idx, rt)
        progress.batch += 1
        if progress.batch % t.p.checkpoint_every == 0:
            checkpoint.save(path, t.model, t.opt, t.sched, progress, rt)
    number = progress.epoch + 1
    rows = [{"epoch": number, "split": "train", **r} for r in summed_over_ranks(progress.running, rt).summary()]
    if t.valid_set:
        p = t.p
        valid = evaluate(t.model, t.feats, t.valid_set, p.ttt_steps, t.head_draft, p.batch_tokens, uses_bf16(p), rt)
        rows += [{"epoch": number, "split": "valid", **r} for r in valid]
    progress.history += rows
    log.info("epoch %d: %s", number, {r["split"]: r for r in rows if r["step"] == 0})
    progress.epoch, progress.batch, progress.running = number, 0, StepStats.zeros(t.p.ttt_steps)
    checkpoint.save(path, t.model, t.opt, t.sched, progress, rt)


def run(
    feats,
    target_folder,
    params,
    checkpoints,
    keep=None,
    rt: runtime.Runtime = runtime.Runtime(),  # noqa: B008  Runtime is frozen: the one-process default is a constant
):
    """Train the drafter on ``feats`` (``features_of``) on ``rt``'s device and rank, resuming from the checkpoint in
    ``checkpoints`` if any. Returns (model on the CPU, report, history), the same on every rank. ``keep``: training
    samples, see ``load_samples``. ``history``
    (metrics/train_curves.json's rows): ``{epoch, split, step, loss, acc}`` (valid: and ``acc_se``) per epoch, split
    (``train``: running means over the epoch; ``valid``: after it) and step."""
    if params.threads:
        torch.set_num_threads(params.threads)
    params = resolved(params, rt.device)
    start = time.perf_counter()
    t = build(feats, target_folder, params, keep, rt)
    path = Path(checkpoints) / "state.pt"
    with rt.locked(path.parent):  # another run on these checkpoints waits, then resumes from this one's end
        checkpoint.resume(path, t.model, t.opt, t.sched, t.progress, rt)
        t.model.train()
        if isinstance(t.feats, Spool):
            t.feats.start(schedule(t, rt), path.parent / f"spool-{rt.rank}")
        try:
            while t.progress.epoch < len(t.plans):
                epoch(t, path, rt)
        finally:
            if isinstance(t.feats, Spool):
                t.feats.close()
    rep = figures.report(t, time.perf_counter() - start, rt)
    t.model = t.model.cpu().eval()
    return t.model, rep, t.progress.history
