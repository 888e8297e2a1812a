"""make repro's plan and summary (eaglepipe/tools/repro.py) on hand-written files; the whole wrapper runs end to end in
tests/project/test_dvc_contract.py."""

import json

import pytest
import yaml

from eaglepipe.tools import repro

PIPELINE = {
    "stages": {
        "a": {"cmd": "x", "deps": ["src"], "outs": ["data/a"]},
        "b": {"cmd": "x", "deps": ["data/a/part.jsonl"], "outs": ["data/b"]},
        "c": {"cmd": "x", "deps": ["other"], "outs": [{"data/c": {"cache": False}}]},
        "d": {"cmd": "x", "deps": ["data/b", "data/c"], "outs": ["data/d"]},
    }
}


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(PIPELINE))
    (tmp_path / "metrics/timings").mkdir(parents=True)
    return tmp_path


def test_the_stages_below_follow_outputs_into_deps(project):
    order = repro.stage_order()
    assert order == ["a", "b", "c", "d"]
    assert repro.below(["a"], order) == ["b", "d"]  # b reads a file inside a's output, d reads b's
    assert repro.below(["c"], order) == ["d"] and repro.below(["d"], order) == []


def test_estimates_prefer_this_machines_last_run_then_scale_the_reference(project, monkeypatch):
    (project / repro.REFERENCE).write_text(json.dumps({"probe_gflops": 50.0, "stages": {"a": 100.0, "b": 10.0}}))
    (project / repro.MEASURED).write_text(json.dumps({"a": {"seconds": 42.0, "at": "2026-12-03T05:00:00+00:00"}}))
    monkeypatch.setattr(repro, "probe", lambda: 100.0)  # this machine twice the reference's speed
    est = repro.estimates(["a", "b", "c"])
    assert est["a"] == (42.0, "its last run here, 2026-12-03")
    assert est["b"][0] == pytest.approx(5.0) and "x 0.50" in est["b"][1]
    assert "c" not in est


def test_the_probe_measures_a_positive_speed():
    assert repro.probe(0.05) > 0


def test_summary_reads_the_metrics(project):
    (project / "metrics/eval.json").write_text(
        json.dumps(
            {
                "benchmarks": {
                    "heldout": {
                        "acceptance_length": 1.5,
                        "acceptance_length_se": 0.02,
                        "baseline_acceptance_length": 1.3,
                        "baseline_acceptance_length_se": 0.03,
                        "difference_se": 0.04,
                        "prompts": 10,
                        "turns": 10,
                        "lossless": True,
                    }
                }
            }
        )
    )
    (project / "metrics/serve.json").write_text(
        json.dumps({"passed": True, "acceptance_length": 1.5, "evaluate_acceptance_length": 1.5, "outputs_equal": True})
    )
    text = repro.summary()
    assert "heldout    1.500 ± 0.020 vs 1.300 ± 0.030: beats n-gram by more than twice the error" in text
    assert "serve check (vLLM serving the drafter): passed" in text and "make metrics" in text
    ev = json.loads((project / "metrics/eval.json").read_text())
    ev["benchmarks"]["heldout"]["difference_se"] = 0.15
    (project / "metrics/eval.json").write_text(json.dumps(ev))
    assert "beats n-gram, within twice the error" in repro.summary()
