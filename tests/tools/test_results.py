"""The results records (eaglepipe/tools/results.py): the schema, its errors naming file, line and field, the newest
record per machine and per class, the figures of make bench and evaluate as values; where a record comes from
(eaglepipe/tools/provenance.py)."""

import copy
import datetime
import json
from pathlib import Path

import pytest

from eaglepipe.core import config
from eaglepipe.tools import provenance, results
from eaglepipe.tools.results import Machine, Record, Value

ROOT = Path(__file__).resolve().parents[2]
EPYC = Machine(cpu="AMD EPYC", flags=("avx2", "avx512f", "avx512_bf16"), cores=2, memory_gib=24.0)


def record(name="make repro", machine=EPYC, day="2026-12-05", **values) -> Record:
    return Record(
        name=name,
        values={key: Value(value=v) for key, v in (values or {"seconds.wall": 60.0}).items()},
        machine=machine,
        commit="b74a4a8",
        params_hash="8b29970ec2393ba1",
        command="make repro",
        date=datetime.date.fromisoformat(day),
    )


def test_the_committed_results_follow_the_schema():
    records = results.load(ROOT / "results")
    assert records and all(isinstance(r, Record) for r in records)
    assert [r.date for r in records] == sorted(r.date for r in records)


def test_a_record_written_reads_back_equal(tmp_path):
    written = record(**{"tau.heldout.eagle3": 1.45}).model_copy(update={"note": "a note"})
    results.append(written, tmp_path / "sub" / "a.jsonl")
    results.append(record(), tmp_path / "sub" / "a.jsonl")
    assert results.read(tmp_path / "sub" / "a.jsonl") == [written, record()]
    assert '"se"' not in results.line(record()) and '"note"' not in results.line(record())


@pytest.mark.parametrize(
    "change,problem",
    [
        (lambda r: r["machine"].update(cores="two"), "machine.cores: Input should be a valid integer"),
        (lambda r: r["values"]["seconds.wall"].update(se=-1), "values.seconds.wall.se: Input should be greater"),
        (lambda r: r["machine"].update(flags=["sse4"]), "machine.flags.0: Input should be 'avx2'"),
        (lambda r: r.pop("commit"), "commit: Field required"),
        (lambda r: r.update(date="yesterday"), "date: Input should be a valid date"),
        (lambda r: r.update(speed=1), "speed: Extra inputs are not permitted"),
        (lambda r: r.update(values={}), "values: Dictionary should have at least 1 item"),
    ],
)
def test_a_malformed_record_names_the_file_the_line_and_the_field(tmp_path, change, problem):
    good = json.loads(results.line(record()))
    bad = copy.deepcopy(good)
    change(bad)
    path = tmp_path / "repro.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(results.ResultsError, match="^" + str(path) + ":3: ") as raised:
        results.load(tmp_path)
    assert problem in str(raised.value)


def test_a_line_that_is_not_json_names_its_line(tmp_path):
    (tmp_path / "a.jsonl").write_text("{not json\n")
    with pytest.raises(results.ResultsError, match=r"a\.jsonl:1: Invalid JSON"):
        results.load(tmp_path)


def test_machine_classes_and_the_newest_record_of_each():
    amx = Machine(cpu="Intel Xeon", flags=("avx2", "avx512f", "amx_bf16"), cores=2)
    avx2 = Machine(cpu="AMD EPYC", flags=("avx2",), cores=2)
    gpu = Machine(cpu="x", flags=("avx2", "avx512f"), cores=16, gpu="NVIDIA H200 x1")
    assert [m.kind for m in (EPYC, amx, avx2, gpu)] == ["avx512", "avx512-amx", "avx2", "gpu"]
    assert gpu.label == "NVIDIA H200 x1, 16 CPU cores" and EPYC.label == "AMD EPYC, 2 cores"
    older, other, newer = record(day="2026-12-01"), record(machine=avx2), record(day="2026-12-06")
    same_but_memory = record(machine=EPYC.model_copy(update={"memory_gib": 23.5}), day="2026-12-07")
    assert results.latest_per_machine([older, other, newer]) == [newer, other]
    assert results.latest_per_machine([older, same_but_memory]) == [same_but_memory]
    assert results.latest_of_kind([older, other, newer], "avx512") == newer
    assert results.latest_of_kind([older], "gpu") is None


def test_evaluates_figures_per_set_and_turn():
    group = {"acceptance_length": 1.42, "acceptance_length_se": 0.05, "baseline_acceptance_length": 1.65}
    group |= {"baseline_acceptance_length_se": 0.18, "difference_se": 0.2, "turns": 8}
    values = results.from_eval({"benchmarks": {"mtbench": group | {"per_turn": {"1": group, "2": group}}}})
    assert values["tau.mtbench.eagle3"] == Value(value=1.42, se=0.05)
    assert values["tau.mtbench-turn2.ngram"] == Value(value=1.65, se=0.18)
    assert values["diff.mtbench-turn1.eagle3 - ngram"] == Value(value=-0.23, se=0.2)
    assert values["turns.mtbench"] == Value(value=8)


def test_make_bench_figures_per_set_method_pair_and_crossing():
    group = {"turns": 4, "equal_to_plain": 3, "acceptance_length": 1.5, "acceptance_length_se": 0.1}
    method = {**group, "tokens_per_s": 8.0, "speedup": 0.8, "per_turn": {"1": group, "2": group}}
    plain = {"tokens_per_s": 10.0, "speedup": 1.0, "seconds": 1.0, "tokens": 10}
    difference = {"difference": -0.25, "se": 0.1, "beyond_2se": True}
    crossing = {"slope": 0.1, "slope_se": 0.01, "gap": 0.2, "gap_se": 0.05, "beyond": None, "beyond_se": None}
    values = results.from_bench(
        {
            "benchmarks": {"mtbench": {"plain": plain, "eagle3": method}},
            "paired": {"eagle3 - ngram": {"mtbench": {**difference, "per_turn": {"1": difference}}}},
            "crossing": {"big": {"mtbench": crossing}},
        }
    )
    assert values["tau.mtbench.eagle3"] == Value(value=1.5, se=0.1) and "tau.mtbench.plain" not in values
    assert values["tau.mtbench-turn2.eagle3"] == Value(value=1.5, se=0.1)
    assert values["speedup.mtbench.eagle3"] == Value(value=0.8) and values["tokens_per_s.mtbench.plain"].value == 10
    assert values["equal.mtbench.eagle3"].value == 3 and values["turns.mtbench-turn1"].value == 4
    assert values["diff.mtbench-turn1.eagle3 - ngram"] == Value(value=-0.25, se=0.1)
    assert values["slope.mtbench.eagle3:big"] == Value(value=0.1, se=0.01) and "beyond.mtbench.eagle3:big" not in values


def test_the_cpu_its_flags_and_this_machine():
    cpuinfo = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu avx2 avx512f amx_tile\n\nprocessor\t: 1\n"
    assert provenance.cpu_fields(cpuinfo) == ("Intel Xeon", ("avx2", "avx512f", "amx_tile"))
    here = provenance.this_machine()
    assert here.cores >= 1 and here.kind in results.KINDS


def test_the_params_hash_follows_result_keys_only():
    params = config.load(ROOT / "params.yaml")
    before = provenance.params_hash(params)
    faster = params.model_copy(update={"train": params.train.model_copy(update={"threads": 7})})
    changed = params.model_copy(update={"train": params.train.model_copy(update={"lr": 0.5})})
    assert len(before) == 16 and provenance.params_hash(faster) == before
    assert provenance.params_hash(changed) != before
