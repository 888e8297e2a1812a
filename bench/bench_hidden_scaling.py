"""Benchmark: how the hidden stage scales with processes. It runs the stage as dvc.yaml does
(``python -m eaglepipe.core.runtime stages/hidden.py``) on the same sequences at 1 process and at ``--nproc`` processes
(torchrun, gloo on CPU), each with ``--threads`` torch threads, and prints the scaling efficiency:

    efficiency = (tokens/s at N processes) / (N x tokens/s at 1 process)

tokens/s is the stage's own figure (metrics/timings: tokens computed over the longest rank's extraction time, model
loading and process start left out); the wall time of each whole run is printed too. Both runs must publish the same
bytes (checked). Run it on an otherwise idle machine: on 2 cores, 2 processes x 1 thread against 1 x 1.

    python bench/bench_hidden_scaling.py [--sequences data/sequences] [--samples 128] [--shard-tokens 2048]
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import yaml

from eaglepipe.dataset import sequences

ROOT = Path(__file__).resolve().parent.parent


def run_stage(work: Path, nproc: int, threads: int) -> dict:
    name = f"nproc{nproc}"
    cmd = [
        sys.executable,
        "-m",
        "eaglepipe.core.runtime",
        "stages/hidden.py",
        "--params",
        str(work / "params.yaml"),
        "--sequences",
        str(work / "seq"),
        "--out",
        str(work / name),
        "--report",
        str(work / f"{name}.json"),
        "--timings",
        str(work / f"{name}-timings.json"),
        "--cache",
        str(work / f"{name}-cache"),
    ]
    env = dict(os.environ, EAGLEPIPE_NPROC=str(nproc), OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"hidden at {nproc} processes failed:\n{out.stderr[-3000:]}")
    timings = json.loads((work / f"{name}-timings.json").read_text())
    return {
        **timings,
        "wall_s": round(time.perf_counter() - start, 2),
        "files": {p.name: p.read_bytes() for p in sorted((work / name).iterdir())},
    }


@click.command(help=__doc__)
@click.option("--sequences", "seq_folder", default="data/sequences", show_default=True, help="Merged sequences.")
@click.option("--samples", default=128, show_default=True, help="The first N train sequences are extracted.")
@click.option("--shard-tokens", default=2048, show_default=True, help="hidden.shard_tokens (ranks share shards).")
@click.option("--nproc", default=2, show_default=True, help="Processes of the parallel run.")
@click.option("--threads", default=1, show_default=True, help="Torch threads per process.")
@click.option("--device", default="cpu", show_default=True, help="runtime.device.")
def main(seq_folder, samples, shard_tokens, nproc, threads, device):
    items = list(sequences.read(seq_folder, "train"))[:samples]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sequences.write(work / "seq", {"train": items}, shard_tokens=10**9, policy={})
        params = yaml.safe_load((ROOT / "params.yaml").read_text())
        params["hidden"]["shard_tokens"] = shard_tokens
        params["runtime"] = {"device": device}
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        one, many = run_stage(work, 1, threads), run_stage(work, nproc, threads)
    efficiency = many["tokens_per_s"] / (nproc * one["tokens_per_s"])
    result = {
        "data": f"{seq_folder} (train, first {len(items)})",
        "tokens": one["computed_tokens"],
        "shards": one["computed_shards"],
        "threads_per_process": threads,
        "device": device,
        "tokens_per_s": {"1": one["tokens_per_s"], str(nproc): many["tokens_per_s"]},
        "wall_s": {"1": one["wall_s"], str(nproc): many["wall_s"]},
        "same_bytes": one["files"] == many["files"],
        "scaling_efficiency": round(efficiency, 3),
    }
    print(json.dumps(result, indent=2))
    print(
        f"hidden: {one['tokens_per_s']:.0f} tokens/s at 1 process, {many['tokens_per_s']:.0f} at {nproc} "
        f"(x {threads} thread{'s' * (threads > 1)}): scaling efficiency {efficiency:.3f} "
        f"({'>=' if efficiency >= 0.8 else '<'} 0.8)"
    )


if __name__ == "__main__":
    main()
