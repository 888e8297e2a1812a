"""Benchmark: building the two environments of `make` (requirements.txt, then requirements-vllm.txt) with pip
against uv (tools/install.sh, EAGLEPIPE_PIP=1 for pip), in fresh venvs in a temporary folder, in one run; prints
each install's seconds, the ratio and whether the two ways installed the same versions. The package caches are
cleared first, so each way downloads what it installs (``--warm`` keeps them)."""

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
INSTALLS = [("main", ["-r", "requirements.txt"]), ("vllm", ["-r", "requirements-vllm.txt"])]


def build(folder: Path, pip: bool) -> tuple[dict[str, float], list[str]]:
    """Both venvs under ``folder``; seconds per install and the packages of each (``pip list --format=freeze``)."""
    env = {**os.environ, "EAGLEPIPE_PIP": "1"} if pip else {k: v for k, v in os.environ.items() if k != "EAGLEPIPE_PIP"}
    seconds, frozen = {}, []
    for name, args in INSTALLS:
        venv = folder / name
        start = time.perf_counter()
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(ROOT / "tools/install.sh"), str(venv), *args], cwd=ROOT, env=env, check=True, stderr=subprocess.DEVNULL
        )
        seconds[name] = time.perf_counter() - start
        frozen += [
            f"{name} {line}"
            for line in subprocess.run(
                [str(venv / "bin/python"), "-m", "pip", "list", "--format=freeze"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.splitlines()
            if not line.startswith("uv==")
        ]
    return seconds, frozen


@click.command(help=__doc__)
@click.option("--warm", is_flag=True, help="Keep pip's and uv's download caches.")
def main(warm):
    results = {}
    for way in ("pip", "uv"):
        if not warm:
            for cache in (Path.home() / ".cache/pip", Path.home() / ".cache/uv"):
                shutil.rmtree(cache, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            results[way] = build(Path(tmp), way == "pip")
        print(f"{way}: " + ", ".join(f"{n} {s:.1f} s" for n, s in results[way][0].items()), flush=True)
    (pip_s, pip_pkgs), (uv_s, uv_pkgs) = results["pip"], results["uv"]
    print("| environment | pip s | uv s | pip / uv |\n|---|---:|---:|---:|")
    for name, _ in INSTALLS + [("both", None)]:
        p = sum(pip_s.values()) if name == "both" else pip_s[name]
        u = sum(uv_s.values()) if name == "both" else uv_s[name]
        print(f"| {name} | {p:.1f} | {u:.1f} | {p / u:.2f} |")
    same = pip_pkgs == uv_pkgs
    print(f"the same packages and versions: {same} ({len(uv_pkgs)} packages)")
    if not same:
        print("\n".join(sorted(set(pip_pkgs) ^ set(uv_pkgs))))


if __name__ == "__main__":
    main()
