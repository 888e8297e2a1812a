"""Benchmark: the prepare stage on a big JSON array source -- seconds and peak resident memory.

    python bench/bench_sources.py [--gib 1] [--distinct 1000]

Writes, in a temporary folder, a JSON array of --gib GiB that holds --distinct sharegpt conversations over and over,
and a small one that holds them once, runs stages/prepare.py on each (in a child process of its own) and prints each
run's file size, records read, seconds and peak resident memory. Sources are streamed, so the big run's peak stays
close to the small one's whatever the file's size.
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

ROOT = Path(__file__).resolve().parent.parent


def conversation(i: int) -> dict:
    """A two-turn sharegpt record, distinct for each ``i``, of a few hundred bytes to a few kilobytes."""
    question = f"Question {i}: why is the sky blue at noon and red at dusk? " * (1 + i % 40)
    return {
        "conversations": [
            {"from": "human", "value": question},
            {"from": "gpt", "value": "Rayleigh scattering favours short wavelengths. " * 8},
        ]
    }


def write_array(path: Path, distinct: int, size: int) -> None:
    """A JSON array of about ``size`` bytes (at least one copy): ``distinct`` records repeated, then a last one."""
    block = b"".join(json.dumps(conversation(i)).encode() + b",\n" for i in range(distinct))
    with open(path, "wb") as f:
        f.write(b"[\n")
        for _ in range(max(1, size // len(block))):
            f.write(block)
        f.write(json.dumps(conversation(0)).encode() + b"\n]\n")


def run_stage(folder: Path, source: Path) -> tuple[dict, float, float]:
    """The prepare stage on ``source`` alone: its report for the source, seconds, and peak resident memory (MiB)."""
    params, report, log = folder / "params.yaml", folder / "report.json", folder / "stage.log"
    params.write_text(
        yaml.safe_dump(
            {
                "prepare": {
                    "on_error": "fail",
                    "sources": [{"name": "big", "path": str(source), "format": "sharegpt", "n": 100}],
                }
            }
        )
    )
    command = [
        sys.executable,
        str(ROOT / "stages" / "prepare.py"),
        "--params",
        str(params),
        "--out",
        str(folder / "prompts.jsonl"),
        "--report",
        str(report),
        "--timings",
        str(folder / "timings.json"),
    ]
    start = time.perf_counter()
    with open(log, "wb") as err:
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)  # the usage of this child alone
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise click.ClickException(f"prepare failed on {source}:\n{log.read_text()}")
    return json.loads(report.read_text())["sources"]["big"], seconds, usage.ru_maxrss / 1024  # Linux: KiB


@click.command(help=__doc__)
@click.option("--gib", default=1.0, show_default=True, help="Size of the big source file, in GiB.")
@click.option("--distinct", default=1000, show_default=True, help="Distinct records it repeats.")
def main(gib, distinct):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print("| source | bytes | records read | distinct | seconds | peak RSS MiB |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, size in (("once", 0), ("big", int(gib * 2**30))):
            path = folder / f"{name}.json"
            write_array(path, distinct, size)
            counts, seconds, peak = run_stage(folder, path)
            print(
                f"| {name} | {path.stat().st_size} | {counts['read']} | {counts['read'] - counts['duplicates']} "
                f"| {seconds:.1f} | {peak:.1f} |",
                flush=True,
            )
            path.unlink()


if __name__ == "__main__":
    main()
