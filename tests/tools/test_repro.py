"""make repro's plan and summary (eaglepipe/tools/repro.py) on hand-written files, and the figures it appends to
results/; the whole wrapper runs end to end in tests/project/test_dvc_contract.py."""

import datetime
import json
import shutil
from pathlib import Path

import pytest
import yaml

from eaglepipe.tools import repro, results
from eaglepipe.tools.results import Machine, Record, Value

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = {
    "stages": {
        "a": {"cmd": "x", "deps": ["src"], "outs": ["data/a"]},
        "b": {"cmd": "x", "deps": ["data/a/part.jsonl"], "outs": ["data/b"]},
        "c": {"cmd": "x", "deps": ["other"], "outs": [{"data/c": {"cache": False}}]},
        "d": {"cmd": "x", "deps": ["data/b", "data/c"], "outs": ["data/d"]},
    }
}
AVX2 = Machine(cpu="AMD EPYC", flags=("avx2",), cores=2)
AMX = Machine(cpu="Intel Xeon", flags=("avx2", "avx512f", "amx_tile"), cores=2)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project in its own folder, the working directory elsewhere: every path must be the project's."""
    root = tmp_path / "project"
    (root / "metrics/timings").mkdir(parents=True)
    (root / "dvc.yaml").write_text(yaml.safe_dump(PIPELINE))
    shutil.copy(ROOT / "params.yaml", root / "params.yaml")
    monkeypatch.chdir(tmp_path)
    return repro.Project(root)


def repro_record(machine: Machine, day: str, seconds: dict[str, float]) -> Record:
    values = {f"seconds.{stage}": Value(value=s) for stage, s in seconds.items()}
    return Record(
        name="make repro",
        values=values | {"seconds.wall": Value(value=sum(seconds.values()))},
        machine=machine,
        commit="abcdef1",
        params_hash=None,
        command="make repro",
        date=datetime.date.fromisoformat(day),
    )


def test_the_stages_below_follow_outputs_into_deps(project):
    order = repro.stage_order(project)
    assert order == ["a", "b", "c", "d"]
    assert repro.below(["a"], order, project) == ["b", "d"]  # b reads a file inside a's output, d reads b's
    assert repro.below(["c"], order, project) == ["d"] and repro.below(["d"], order, project) == []


def test_estimates_prefer_this_machine_then_its_class_in_results_then_the_scaled_reference(project, monkeypatch):
    project.reference.write_text(json.dumps({"probe_gflops": 50.0, "stages": {"a": 100.0, "b": 10.0, "c": 8.0}}))
    project.measured.write_text(json.dumps({"a": {"seconds": 42.0, "at": "2026-12-03T05:00:00+00:00"}}))
    results.append(repro_record(AVX2, "2026-12-01", {"b": 30.0}), project.results / "repro.jsonl")
    results.append(repro_record(AVX2, "2026-12-02", {"b": 31.0}), project.results / "repro.jsonl")
    results.append(repro_record(AMX, "2026-12-03", {"b": 5.0, "c": 2.0}), project.results / "repro.jsonl")
    monkeypatch.setattr(repro, "probe", lambda: 100.0)  # this machine twice the reference's speed
    est = repro.estimates(["a", "b", "c", "d"], project, "avx2")
    assert est["a"] == repro.Estimate(42.0, "its last run here, 2026-12-03")
    assert est["b"] == repro.Estimate(31.0, "make repro of abcdef1 on AMD EPYC (AVX2 only), 2026-12-02")  # the newest
    assert est["c"].seconds == pytest.approx(4.0) and "x 0.50 (probe)" in est["c"].source  # none of its class has c
    assert "d" not in est and "wall" not in est
    assert repro.estimates(["b"], project, "gpu")["b"].source.startswith("the reference run")  # no GPU record


def test_the_probe_measures_a_positive_speed():
    assert repro.probe(0.05) > 0


def test_a_run_of_every_stage_appends_its_times_and_evaluate_its_figures(project):
    evaluation = {"acceptance_length": 1.5, "acceptance_length_se": 0.02, "baseline_acceptance_length": 1.3}
    evaluation |= {"baseline_acceptance_length_se": 0.03, "difference_se": 0.04, "turns": 10}
    project.evaluation.write_text(json.dumps({"benchmarks": {"heldout": evaluation}}))
    repro.record_results(repro.Run(0, {"b": 2.0, "d": 3.0}), 9.0, "make b d", project)
    assert not (project.results / "repro.jsonl").exists()  # a part of the pipeline: no make repro figures
    assert not (project.results / "evaluate.jsonl").exists()  # and evaluate did not run

    every = {"a": 1.0, "b": 2.04, "c": 3.0, "d": 4.0, "evaluate": 5.0}
    project.root.joinpath("dvc.yaml").write_text(yaml.safe_dump({"stages": dict.fromkeys(every, {"cmd": "x"})}))
    repro.record_results(repro.Run(0, every), 75.55, "make repro", project)
    (timed,) = results.read(project.results / "repro.jsonl")
    assert timed.name == "make repro" and timed.command == "make repro" and len(timed.params_hash) == 16
    assert timed.values["seconds.wall"].value == 75.5 and timed.values["seconds.b"].value == 2.0
    assert timed.date == datetime.datetime.now(datetime.UTC).date() and timed.machine.cores >= 1
    (figures,) = results.read(project.results / "evaluate.jsonl")
    assert figures.values["tau.heldout.eagle3"] == Value(value=1.5, se=0.02)
    assert figures.values["diff.heldout.eagle3 - ngram"] == Value(value=0.2, se=0.04)


def test_the_command_recorded_is_the_one_typed():
    assert repro.command_of((), 1.0) == "make repro" and repro.command_of(("train",), 1.0) == "make train"
    assert repro.command_of(("train",), None) == "python -m eaglepipe.tools.repro train"


def test_summary_reads_the_metrics(project):
    project.evaluation.write_text(
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
    project.serve.write_text(
        json.dumps({"passed": True, "acceptance_length": 1.5, "evaluate_acceptance_length": 1.5, "outputs_equal": True})
    )
    project.drafter.mkdir(parents=True)
    text = repro.summary(project)
    assert "heldout    1.500 ± 0.020 vs 1.300 ± 0.030: beats n-gram by more than twice the error" in text
    assert "serve check (vLLM serving the drafter): passed" in text and "make metrics" in text
    assert "the drafter: models/draft/ (" in text
    ev = json.loads(project.evaluation.read_text())
    ev["benchmarks"]["heldout"]["difference_se"] = 0.15
    project.evaluation.write_text(json.dumps(ev))
    assert "beats n-gram, within twice the error" in repro.summary(project)
