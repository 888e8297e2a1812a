"""Benchmark: train's memory does not grow with its data. It runs the train stage (``stages/train.py``, one process)
on ``--hidden`` and on a folder holding it ``--times`` over (the same shard files linked under new names, every
sample id made new, so the index lists ``--times`` as many samples and tokens), stops each run once it has
checkpointed ``--steps`` optimizer steps, and prints each run's peak resident memory (``VmHWM``) and their ratio.

The stage keeps every sample's ids and loss mask in memory (5 bytes a token) and reads a batch's hidden states from
the shards when it trains on it, so the peaks should agree within 15% while the data differ ``--times`` over.

    python bench/bench_train_memory.py [--hidden data/hidden] [--times 8] [--steps 20]
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import yaml
from harness import train_command

from eaglepipe.dataset import shards

ROOT = Path(__file__).resolve().parent.parent


def replicate(hidden: Path, out: Path, times: int) -> int:
    """``out``: ``hidden``'s index with each split's shards listed ``times`` over, copy c's files linked as
    ``c<c>-<file>`` and its ids' prompt part suffixed ``x<c>``. Returns the bytes the index now lists."""
    out.mkdir()
    index = shards.load_index(hidden)
    size = 0
    for split in shards.SPLITS:
        if split not in index:
            continue
        entries = []
        for c in range(times):
            for entry in index[split]["shards"]:
                name = f"c{c}-{entry['file']}"  # an entry may name a file another entry names too (dataset/shards.py)
                if not (out / name).exists():
                    os.symlink(hidden.resolve() / entry["file"], out / name)
                    size += (hidden / entry["file"]).stat().st_size
                ids = [
                    rid if c == 0 else rid.replace(".", f"x{c}.", 1) if "." in rid else f"{rid}x{c}"
                    for rid in entry["ids"]
                ]
                entries.append({**entry, "file": name, "ids": ids})
        index[split] = {
            **index[split],
            "shards": entries,
            "samples": index[split]["samples"] * times,
            "tokens": index[split]["tokens"] * times,
        }
    (out / "index.json").write_text(json.dumps(index))
    return size


def peak_rss_mb(work: Path, hidden: Path, name: str, steps: int) -> float:
    """Run the stage on ``hidden`` until its first checkpoint (after ``steps`` steps); its peak RSS in MB."""
    cmd = [sys.executable, *train_command(work, hidden, name)]
    with open(work / f"{name}.log", "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log, env=dict(os.environ, OMP_NUM_THREADS="1"))
    while not (work / f"{name}-checkpoints" / "state.pt").exists():
        if proc.poll() is not None:
            raise SystemExit(f"train on {hidden} ended first:\n{(work / f'{name}.log').read_text()[-3000:]}")
        time.sleep(0.1)
    status = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return int(status["VmHWM"].split()[0]) / 1024


@click.command(help=__doc__)
@click.option(
    "--hidden",
    default="data/hidden",
    show_default=True,
    type=click.Path(file_okay=False),
    help="hidden's shards (the 1x data).",
)
@click.option("--times", default=8, show_default=True, help="How many times over the larger data holds it.")
@click.option("--steps", default=20, show_default=True, help="Optimizer steps each run trains before it is stopped.")
def main(hidden, times, steps):
    hidden = Path(hidden)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = yaml.safe_load((ROOT / "params.yaml").read_text())
        params["train"].update(checkpoint_every=steps, threads=1)
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        small = replicate(hidden, work / "x1", 1)
        large = replicate(hidden, work / "many", times)
        one, many = peak_rss_mb(work, work / "x1", "x1", steps), peak_rss_mb(work, work / "many", "many", steps)
    ratio = many / one
    print(
        json.dumps(
            {
                "data": str(hidden),
                "times": times,
                "steps": steps,
                "hidden_mb": {"1": round(small / 2**20), str(times): round(large / 2**20)},
                "peak_rss_mb": {"1": round(one, 1), str(times): round(many, 1)},
                "ratio": round(ratio, 3),
            },
            indent=2,
        )
    )
    print(
        f"train's peak RSS: {one:.0f} MB on {small / 2**20:.0f} MB of hidden states, {many:.0f} MB on "
        f"{large / 2**20:.0f} MB ({times}x): ratio {ratio:.3f} ({'within' if abs(ratio - 1) <= 0.15 else 'beyond'} "
        "15%)"
    )


if __name__ == "__main__":
    main()
