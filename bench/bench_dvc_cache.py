"""Benchmark: what DVC adds, in time and disk, to a multi-GB ``data/hidden``, for each cache link type. For each type
it makes a fresh git + DVC repository (next to ``--where``, on that filesystem), writes ``--gb`` GB of incompressible
shard-sized files into ``data/hidden``, then times ``dvc add data/hidden`` (hashing every byte, then moving it into
the cache and linking it back) and ``dvc checkout`` of the folder after it is deleted (what switching dataset
versions costs), and measures the disk the repository takes (``du``: workspace and cache together, a hard-linked
file counted once). A type the filesystem cannot do fails, and is reported so.

    python bench/bench_dvc_cache.py [--gb 2] [--where .cache]
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

TYPES = ("copy", "hardlink", "symlink", "reflink")
FILE_MB = 128


def dvc(repo: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True)


def disk_mb(folder: Path) -> float:
    return int(subprocess.run(["du", "-sk", str(folder)], capture_output=True, text=True).stdout.split()[0]) / 1024


def measure(root: Path, link: str, gb: float) -> dict:
    repo = root / link
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    dvc(repo, "init", "-q")
    dvc(repo, "config", "cache.type", link)
    data = repo / "data" / "hidden"
    data.mkdir(parents=True)
    for i in range(int(gb * 1024 / FILE_MB)):
        with open(data / f"train-{i:05d}.safetensors", "wb") as f:
            for _ in range(FILE_MB):
                f.write(os.urandom(2**20))
    written = disk_mb(repo)
    start = time.perf_counter()
    added = dvc(repo, "add", "data/hidden")
    add_s = time.perf_counter() - start
    if added.returncode:
        return {"type": link, "works": False, "error": (added.stderr or added.stdout).strip().splitlines()[-1][:200]}
    after = disk_mb(repo)
    shutil.rmtree(data)
    start = time.perf_counter()
    out = dvc(repo, "checkout", "data/hidden")
    checkout_s = time.perf_counter() - start
    if out.returncode or not (data / "train-00000.safetensors").exists():
        return {
            "type": link,
            "works": False,
            "error": (out.stderr or out.stdout or "checkout restored nothing").strip().splitlines()[-1][:200],
        }
    kind = (
        "symlink"
        if (data / "train-00000.safetensors").is_symlink()
        else "hardlink"
        if os.stat(data / "train-00000.safetensors").st_nlink > 1
        else "copy or reflink"
    )
    return {
        "type": link,
        "works": out.returncode == 0,
        "workspace_files": kind,
        "data_mb": round(written),
        "disk_mb_after_add": round(after),
        "disk_ratio": round(after / written, 2),
        "add_s": round(add_s, 1),
        "add_mb_per_s": round(written / add_s),
        "checkout_s": round(checkout_s, 1),
    }


@click.command(help=__doc__)
@click.option("--gb", default=2.0, show_default=True, help="Size of the data/hidden written for each type.")
@click.option(
    "--where",
    default=".cache",
    show_default=True,
    type=click.Path(file_okay=False),
    help="The repositories go in a temporary folder here (the filesystem DVC's cache would be on).",
)
def main(gb, where):
    Path(where).mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        for link in TYPES:
            results.append(measure(Path(tmp), link, gb))
            shutil.rmtree(Path(tmp) / link)
            print(json.dumps(results[-1]), flush=True)
    for r in results:
        if r.get("works"):
            print(
                f"{r['type']:>8}: {r['data_mb']} MB of states take {r['disk_mb_after_add']} MB with DVC's cache "
                f"(x{r['disk_ratio']}); dvc add {r['add_s']} s ({r['add_mb_per_s']} MB/s), checkout "
                f"{r['checkout_s']} s; workspace files: {r['workspace_files']}"
            )
        else:
            print(f"{r['type']:>8}: does not work here ({r.get('error', 'checkout failed')})")


if __name__ == "__main__":
    main()
