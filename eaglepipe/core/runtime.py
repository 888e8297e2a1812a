"""Where a stage runs: its device, the target's compute dtype, its rank in a torchrun job, the seeding of torch's
generators, and what depends on the world: wrapping a model for training (``Runtime.wrap``: DDP above one process)
and saving and loading a checkpoint (``Runtime.save``, ``Runtime.load``). Only this module chooses a device; code
takes it from its inputs (``model.device``, a tensor's ``.device``).

One process is rank 0 of a world of 1. Under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment)
with more than one process, ``start`` joins the process group (gloo on CPU, nccl on CUDA) and each rank takes
``cuda:LOCAL_RANK``. Device, process count and threads are speed knobs, in no DVC entry and no fingerprint (they may
round differently); the compute dtype decides the numbers (``hidden.compute_dtype`` is a result knob).

``python -m eaglepipe.core.runtime stages/<stage>.py ARGS`` (dvc.yaml's commands) runs the script itself, or
``torchrun --standalone --nproc-per-node N`` on it when ``EAGLEPIPE_NPROC`` = N is above 1 (without ``--standalone``
when ``PET_NNODES`` is set: a job across nodes, whose rendezvous torchrun reads from its ``PET_*`` variables).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pickle
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eaglepipe.core.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """This process's place in the job: its device, rank, world size and rank on its node."""

    device: torch.device = torch.device("cpu")
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that publishes a stage's outputs and reports."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``tensor`` (same shape on every rank), on every rank, where ``tensor`` lives."""
        if self.world == 1:
            return tensor.clone()
        total = tensor.to(self.device, copy=True)
        dist.all_reduce(total)
        return total.to(tensor.device)

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` itself in a world of 1, else DistributedDataParallel (gradients averaged over the ranks,
        buffers not broadcast)."""
        if self.world == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            module, device_ids=[self.device.index] if self.device.type == "cuda" else None, broadcast_buffers=False
        )

    @contextlib.contextmanager
    def locked(self, folder: Path):
        """Rank 0 holds ``folder``'s lock file while the block runs: a second run on the same resumable work (another
        ``dvc exp run``, worktree or job) waits for it; a job of several processes raises UserError instead (its
        ranks would time out waiting in a collective)."""
        with contextlib.ExitStack() as stack:
            busy = False
            if self.is_main:
                folder.mkdir(parents=True, exist_ok=True)
                lock = stack.enter_context(open(folder / ".lock", "w"))
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    busy = self.world > 1
                    if not busy:
                        log.info("another run holds %s; waiting for it", folder / ".lock")
                        fcntl.flock(lock, fcntl.LOCK_EX)
            if self.gather(busy)[0]:  # every rank learns it, so every rank stops
                raise UserError(
                    f"another run holds {folder / '.lock'}: run this job of {self.world} processes once "
                    "it has ended (its ranks cannot wait that long in the process group)"
                )
            yield

    def save(self, path: Path, state: dict) -> None:
        """Rank 0 writes ``state`` (tensors and plain data) to ``path`` atomically (a kill leaves the last one
        whole); the other ranks write nothing."""
        if not self.is_main:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load(self, path: Path) -> dict | None:
        """What ``save`` wrote to ``path``, on the CPU (None when there is nothing); a file of another kind is a
        UserError. Rank 0 first deletes what a kill left half-written."""
        if self.is_main:
            for stale in path.parent.glob(f"{path.name}.tmp*"):
                stale.unlink()
        if not path.exists():
            return None
        try:  # tensors and plain data only: a state file from elsewhere cannot run code
            return torch.load(path, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            raise UserError(
                f"{path}: not a checkpoint this code wrote ({str(e).splitlines()[0][:120]}); delete it to start over"
            ) from None

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank; a barrier too."""
        if self.world == 1:
            return [obj]
        objs = [None] * self.world
        dist.all_gather_object(objs, obj)
        return objs


def device(name: str = "auto", local_rank: int = 0, world: int = 1) -> torch.device:
    """The device ``runtime.device`` names: ``auto`` (CUDA when torch sees a GPU, else the CPU), ``cpu``, ``cuda``
    or ``cuda:N``. Under torchrun ``auto`` and ``cuda`` are ``cuda:LOCAL_RANK``, one GPU per rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"runtime.device = {name!r}, but torch sees no CUDA device (this torch: {torch.__version__})")
    if name == "cuda":
        name = f"cuda:{local_rank}"
    elif world > 1:
        raise UserError(
            f"runtime.device = {name!r} names one GPU, but this job runs {world} processes: use cuda or "
            "auto (each rank takes cuda:LOCAL_RANK)"
        )
    index = torch.device(name).index
    if index >= torch.cuda.device_count():
        raise UserError(f"{name}: torch sees {torch.cuda.device_count()} CUDA devices")
    return torch.device(name)


def native_bf16(dev: torch.device) -> bool:
    """Whether ``dev`` multiplies bf16 matrices natively: a CUDA GPU that supports bf16, or a CPU with AVX512-BF16 or
    AMX (``avx512_bf16`` or ``amx_tile`` among ``torch.cpu.get_capabilities()``)."""
    if dev.type == "cuda":
        return torch.cuda.is_bf16_supported()
    capabilities = torch.cpu.get_capabilities()
    return capabilities.get("avx512_bf16", False) or capabilities.get("amx_tile", False)


def compute_dtype(name: str, dev: torch.device) -> str:
    """The dtype the target generates in (``infer.dtype``): ``auto`` = bfloat16 on CUDA, float32 on the CPU; or the
    one named."""
    if name == "auto":
        return "bfloat16" if dev.type == "cuda" else "float32"
    return name


def states_dtype(name: str, dev: torch.device) -> str:
    """The dtype the target computes hidden states in (``hidden.compute_dtype``): ``auto`` = bfloat16 where ``dev``
    multiplies bf16 natively (``native_bf16``), float32 elsewhere; or the one named."""
    if name == "auto":
        return "bfloat16" if native_bf16(dev) else "float32"
    return name


@contextlib.contextmanager
def start(device_name: str = "auto"):
    """This process's ``Runtime`` from torchrun's environment (a world of 1 without it); above 1 it joins the process
    group, and leaves it at the end whatever happens."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = device(device_name, local_rank, world)
    if world > 1:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    try:
        yield Runtime(dev, rank, world, local_rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def seed(value: int) -> None:
    """Seed torch's generators: the CPU's and every GPU's."""
    torch.manual_seed(value)


def rng_state() -> dict:
    """The CPU's and every GPU's generator state (for a checkpoint; ``set_rng_state`` restores it)."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state``'s states: the CPU's, and those of the GPUs this process sees (on fewer GPUs the first
    ones; on none, only the CPU's)."""
    torch.set_rng_state(state["cpu"])
    for i, cuda in enumerate(state["cuda"][: torch.cuda.device_count() if torch.cuda.is_available() else 0]):
        torch.cuda.set_rng_state(cuda, i)


def launch(argv: list[str]) -> None:
    """Run ``argv`` = [script, args...]: in this process, or under torchrun when ``EAGLEPIPE_NPROC`` is above 1."""
    nproc = os.environ.get("EAGLEPIPE_NPROC", "").strip() or "1"
    if not nproc.isdigit() or int(nproc) < 1:
        raise SystemExit(f"EAGLEPIPE_NPROC = {nproc!r}: should be a number of processes per node, 1 or more")
    if int(nproc) == 1 and "PET_NNODES" not in os.environ:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        return
    single_node = [] if "PET_NNODES" in os.environ else ["--standalone"]  # torchrun = python -m torch.distributed.run
    os.execv(
        sys.executable, [sys.executable, "-m", "torch.distributed.run", *single_node, "--nproc-per-node", nproc, *argv]
    )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m eaglepipe.core.runtime SCRIPT [ARGS...]")
    launch(sys.argv[1:])
