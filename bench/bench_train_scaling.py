"""Benchmark: how the train stage scales with processes. It runs the stage as dvc.yaml does
(``python -m eaglepipe.core.runtime stages/train.py``) on the same hidden states at 1 process and at ``--nproc``
processes (torchrun, DDP, gloo on CPU), each with ``--threads`` torch threads, and prints the scaling efficiency:

    efficiency = (tokens/s at N processes) / (N x tokens/s at 1 process)

tokens/s is the stage's own figure (metrics/timings: tokens trained over the run's seconds, set-up and validation
included, process start left out). Both runs train the same global batches, so their drafters agree within float
tolerance: the largest weight difference and both runs' validation figures are printed (under bf16 autocast the
ranks' smaller matmuls round differently from one process's, and the difference grows over the steps). Run it on
an otherwise idle machine: on 2 cores, 2 processes x 1 thread against 1 x 1.

    python bench/bench_train_scaling.py [--hidden data/hidden] [--epochs 1]
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
import yaml
from harness import train_command
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent


def run_stage(work: Path, hidden: Path, nproc: int, threads: int) -> dict:
    name = f"nproc{nproc}"
    cmd = [sys.executable, "-m", "eaglepipe.core.runtime", *train_command(work, hidden, name)]
    env = dict(os.environ, EAGLEPIPE_NPROC=str(nproc), OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"train at {nproc} processes failed:\n{out.stderr[-3000:]}")
    timings = json.loads((work / f"{name}-timings.json").read_text())
    return {
        **timings,
        "wall_s": round(time.perf_counter() - start, 2),
        "valid": json.loads((work / f"{name}.json").read_text())["valid"],
        "weights": load_file(str(work / name / "model.safetensors")),
    }


@click.command(help=__doc__)
@click.option(
    "--hidden", default="data/hidden", show_default=True, type=click.Path(file_okay=False), help="hidden's shards."
)
@click.option("--epochs", default=1, show_default=True, help="train.epochs of both runs.")
@click.option("--nproc", default=2, show_default=True, help="Processes of the parallel run.")
@click.option("--threads", default=1, show_default=True, help="Torch threads per process (train.threads).")
@click.option("--device", default="cpu", show_default=True, help="runtime.device.")
def main(hidden, epochs, nproc, threads, device):
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = yaml.safe_load((ROOT / "params.yaml").read_text())
        params["train"].update(epochs=epochs, threads=threads)
        params["runtime"] = {"device": device}
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        one, many = (
            run_stage(work, Path(hidden).resolve(), 1, threads),
            run_stage(work, Path(hidden).resolve(), nproc, threads),
        )
    efficiency = many["tokens_per_s"] / (nproc * one["tokens_per_s"])
    diff = max(
        (one["weights"][k] - many["weights"][k]).abs().max().item()
        for k in one["weights"]
        if one["weights"][k].is_floating_point()
    )
    result = {
        "data": f"{hidden} (train split)",
        "epochs": epochs,
        "threads_per_process": threads,
        "device": device,
        "autocast": params["train"]["autocast"],
        "tokens_per_s": {"1": one["tokens_per_s"], str(nproc): many["tokens_per_s"]},
        "seconds": {"1": one["seconds"], str(nproc): many["seconds"]},
        "wall_s": {"1": one["wall_s"], str(nproc): many["wall_s"]},
        "largest_weight_difference": diff,
        "valid": {"1": one["valid"], str(nproc): many["valid"]},
        "scaling_efficiency": round(efficiency, 3),
    }
    print(json.dumps(result, indent=2))
    print(
        f"train: {one['tokens_per_s']:.0f} tokens/s at 1 process, {many['tokens_per_s']:.0f} at {nproc} "
        f"(x {threads} thread{'s' * (threads > 1)}): scaling efficiency {efficiency:.3f} "
        f"({'>=' if efficiency >= 0.8 else '<'} 0.8)"
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
