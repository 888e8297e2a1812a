"""bench/gpu_check.py (`make gpu-check`), run here on the CPU with tiny params: the same script a GPU machine runs."""

import json
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, tiny_params

STAGES = ("prepare", "infer", "merge", "hidden", "train", "evaluate")


def check(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.e2e
def test_gpu_check_e2e_runs_the_pipeline_in_a_folder_of_its_own_and_prints_each_stage(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(yaml.safe_load((ROOT / "params.yaml").read_text()))))
    timings_before = {p: p.read_bytes() for p in (ROOT / "metrics" / "timings").glob("*.json")}
    out = check("--params", str(params), "--device", "cpu", "--keep", str(tmp_path / "work"))
    assert out.returncode == 0, out.stderr[-3000:]
    work = tmp_path / "work"
    for stage in STAGES:
        row = next(line for line in out.stdout.splitlines() if line.startswith(f"| {stage} |"))
        timing = json.loads((work / "metrics" / "timings" / f"{stage}.json").read_text())
        assert row.endswith(f"| {timing['peak_rss_mb']} |")
    ran = yaml.safe_load((work / "params.yaml").read_text())
    assert ran["runtime"]["device"] == "cpu" and ran["infer"]["engine"] == "hf"
    assert json.loads((work / "data" / "responses" / "engine.json").read_text())["engine"] == "hf"
    assert (work / "models" / "draft" / "model.safetensors").exists()
    assert any((work / "cache" / "infer").iterdir()) and any((work / "cache" / "hidden").iterdir())
    assert "acceptance length, EAGLE vs n-gram: heldout" in out.stdout
    assert {p: p.read_bytes() for p in (ROOT / "metrics" / "timings").glob("*.json")} == timings_before


def test_gpu_check_without_a_gpu_says_so():
    out = check("--device", "cuda")
    assert out.returncode != 0 and "sees no CUDA device" in out.stderr
