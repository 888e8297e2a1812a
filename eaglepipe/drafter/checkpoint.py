"""train's checkpoint, ``<checkpoints>/state.pt`` (written atomically, every ``checkpoint_every`` steps and at each
epoch's end): model, optimizer, schedule, RNG and the run's ``Progress`` (position: epoch and batch; history; the
running sums over every rank). Nothing in it depends on the world size, so a run resumes at another (bit for bit at
the same one). Tensors and plain data only, loaded with ``weights_only=True``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglepipe.core import runtime
from eaglepipe.drafter.eagle3.model import Eagle3Draft
from eaglepipe.drafter.eagle3.ttt import StepStats

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """How far a run has got, besides its weights, optimizer and schedule."""

    running: StepStats  # this epoch's summed stats (rank 0: every rank's up to a resume)
    epoch: int = 0
    batch: int = 0  # batches of ``epoch`` done
    history: list = field(default_factory=list)  # the rows of the epochs done (train.run's history)


def save(
    path: Path,
    model: Eagle3Draft,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    progress: Progress,
    rt: runtime.Runtime,
) -> None:
    """Save the run's state (every rank's sums added up) for ``resume``."""
    rt.save(
        path,
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "schedule": sched.state_dict(),
            "rng": runtime.rng_state(),
            "epoch": progress.epoch,
            "batch": progress.batch,
            "history": progress.history,
            "running": rt.all_sum(progress.running.table()),
        },
    )


def resume(
    path: Path,
    model: Eagle3Draft,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    progress: Progress,
    rt: runtime.Runtime,
) -> None:
    """Restore the checkpoint at ``path``, if any: weights, optimizer, schedule, RNG and ``progress``."""
    state = rt.load(path)
    if state is None:
        return
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["schedule"])
    runtime.set_rng_state(state["rng"])
    progress.epoch, progress.batch, progress.history = state["epoch"], state["batch"], state["history"]
    if rt.is_main:  # the sums of every rank so far; the other ranks add theirs from here
        progress.running = StepStats.from_table(state["running"])
    log.info("resuming from %s: epoch %d, batch %d", path, progress.epoch, progress.batch)
