"""Tests of the prepare stage script: end to end without heavy imports, its help, peak memory on big source files,
the shipped sources and held-out eval, and the benchmark prompts kept out of training."""

import gzip
import json
import subprocess
import sys
from collections import Counter

import pytest
import yaml
from dataset_helpers import FIXTURES, STAGE, alpaca_file, fixture_records, params_file, read_ok, source, write_jsonl
from helpers import ROOT

from eaglepipe.core import config
from eaglepipe.core.records import read_jsonl, read_prompts
from eaglepipe.dataset import benchmarks, prepare
from eaglepipe.dataset.sources import raw_records

# ------------------------------------------------------------------------------------------------------ stage script


@pytest.mark.e2e
def test_stage_runs_end_to_end_without_heavy_imports(tmp_path):
    a = alpaca_file(tmp_path / "a.jsonl", [f"Question {i}?" for i in range(8)])
    params = params_file(tmp_path, [source("chat", FIXTURES / "sharegpt.jsonl", 3, "sharegpt"), source("a", a, 5)])
    out, report = tmp_path / "out" / "prompts.jsonl", tmp_path / "metrics" / "prepare.json"
    run = (
        "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'prepare imported a model library'\n"
    )
    args = [
        str(STAGE),
        "--params",
        str(params),
        "--out",
        str(out),
        "--report",
        str(report),
        "--timings",
        str(tmp_path / "timings.json"),
    ]
    outputs = []
    for _ in range(2):
        subprocess.run([sys.executable, "-c", run, *args], cwd=tmp_path, check=True, capture_output=True)
        outputs.append((out.read_bytes(), report.read_bytes()))
    assert outputs[0] == outputs[1]  # deterministic
    prompts, counts = read_prompts(out), json.loads(report.read_text())
    assert [p.source for p in prompts] == ["chat"] * 3 + ["a"] * 5
    assert counts["totals"]["selected"] == len(prompts) == 8
    assert counts["sources"]["chat"]["read"] == len(fixture_records("sharegpt"))


def test_stage_help_explains_the_options():
    result = subprocess.run([sys.executable, str(STAGE), "--help"], capture_output=True, text=True, check=True)
    for option in ("--params", "--out", "--report"):
        assert option in result.stdout


# -------------------------------------------------------------------------------------------------------- big files

PEAK_RSS = (
    "import resource, runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
)


def repeated_source(path, records, size: int) -> int:
    """A JSON array (``.json``) or JSON Lines file (gzipped for a ``.gz`` name) holding ``records`` over and over
    until it has ``size`` bytes (before compression); returns how many records it holds."""
    array = path.suffixes[0] == ".json"
    block = "".join((json.dumps(r) + (",\n" if array else "\n")) for r in records).encode()
    copies = max(1, size // len(block))
    with (gzip.open if path.suffix == ".gz" else open)(path, "wb") as f:
        f.write(b"[\n" if array else b"")
        for _ in range(copies):
            f.write(block)
        f.write(b'{"instruction": "last"}\n]\n' if array else b'{"instruction": "last"}\n')
    return copies * len(records) + 1


def stage_peak_rss(tmp_path, path, n: int) -> tuple[int, dict]:
    """Peak resident memory (KiB) of the prepare stage run on one source, and its report."""
    params = params_file(tmp_path, [source("s", path, n)])
    out, report = tmp_path / f"{path.name}.prompts.jsonl", tmp_path / f"{path.name}.report.json"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            PEAK_RSS,
            str(STAGE),
            "--params",
            str(params),
            "--out",
            str(out),
            "--report",
            str(report),
            "--timings",
            str(tmp_path / "timings.json"),
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    )
    return int(run.stdout.split()[-1]), json.loads(report.read_text())["sources"]["s"]


@pytest.mark.e2e
@pytest.mark.parametrize("container", ["json", "jsonl", "jsonl.gz"])
def test_peak_memory_does_not_grow_with_the_source_file(tmp_path, container):
    """Bound: prepare on a 128 MiB file (gzipped: 128 MiB once decompressed) peaks at less than 1/32 of that size
    (4 MiB) above prepare on a file holding the same distinct records once."""
    records = [{"instruction": f"Prompt {i}: " + "lorem ipsum " * 60, "input": "", "output": "ok"} for i in range(400)]
    tiny, big = tmp_path / f"tiny.{container}", tmp_path / f"big.{container}"
    repeated_source(tiny, records, 0)
    held = repeated_source(big, records, 128 << 20)
    size = 128 << 20
    tiny_peak, tiny_counts = stage_peak_rss(tmp_path, tiny, 50)
    big_peak, big_counts = stage_peak_rss(tmp_path, big, 50)
    big.unlink()
    assert (big_counts["read"], big_counts["duplicates"], big_counts["selected"]) == (held, held - 401, 50)
    assert (tiny_counts["read"], tiny_counts["duplicates"]) == (401, 0)
    assert (big_peak - tiny_peak) * 1024 < size / 32, (tiny_peak, big_peak, size)


# ------------------------------------------------------------------------------------------------------ shipped data


def test_shipped_sources_and_heldout_eval_are_clean_and_disjoint():
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())["prepare"]
    train = []
    for src in (s for s in cfg["sources"] if not s["path"].startswith("pkg:")):  # packaged sources: prepare's check
        prompts = read_ok(ROOT / src["path"], src["format"], src["name"])
        assert len(prompts) >= 40, src["name"]
        train += prompts
    eval_path = ROOT / "data" / "eval" / "heldout.jsonl"
    held = read_ok(eval_path, "openai", "heldout")
    assert len(held) >= 40
    assert all([m["role"] for m in p.messages] == ["user"] for p in held)
    categories = Counter(rec["category"] for _, _, rec in raw_records(eval_path))
    assert set(categories) == {"writing", "reasoning", "math", "coding", "extraction"}
    assert min(categories.values()) >= 8
    assert len({p.id for p in held}) == len(held)
    assert not {p.id for p in held} & {p.id for p in train}
    train_texts = {m["content"].strip().lower() for p in train for m in p.messages if m["role"] == "user"}
    assert not {p.messages[0]["content"].strip().lower() for p in held} & train_texts


# ------------------------------------------------------------------------------------------------ benchmarks kept out


def test_a_benchmark_prompt_is_kept_out_of_training_whitespace_aside_and_counted(tmp_path):
    question, problem = benchmarks.mtbench_questions()[3], benchmarks.humaneval_problems()[9]
    held = next(read_prompts_of(ROOT / "data/eval/heldout.jsonl"))
    chats = write_jsonl(
        tmp_path / "chats.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "  " + question.turns[1].replace(" ", "\n  ", 3)},
                    {"from": "gpt", "value": "ok"},
                ]
            },
            {
                "conversations": [
                    {"from": "human", "value": "Hello"},
                    {"from": "gpt", "value": "Hi"},
                    {"from": "human", "value": problem.prompt + "\n"},
                ]
            },
            {"conversations": [{"from": "human", "value": held}]},
            {
                "conversations": [{"from": "human", "value": "Hi."}, {"from": "human", "value": question.turns[0]}]
            },  # merged
            {"conversations": [{"from": "human", "value": question.turns[1] + " Answer briefly."}]},  # not the prompt
        ],
    )
    section = {"sources": [source("chats", chats, 10, "sharegpt")]}
    excluded = benchmarks.excluded_texts(ROOT / "data/eval/heldout.jsonl")
    prompts, report = prepare.prepare(config.parse({"prepare": section}, "params.yaml").prepare, excluded)
    assert [p.messages[-1]["content"] for p in prompts] == [question.turns[1] + " Answer briefly."]
    assert report["sources"]["chats"]["benchmark"] == 4 == report["totals"]["benchmark"]
    assert report["sources"]["chats"]["rules"]["consecutive_turns_merged"] == 1
    assert " 4 " in prepare.summary(report).splitlines()[1]
    kept, report = prepare.prepare(config.parse({"prepare": section}, "params.yaml").prepare)  # nothing excluded
    assert len(kept) == 5 and report["totals"]["benchmark"] == 0


def read_prompts_of(path):
    return (m["content"] for _, rec in read_jsonl(path) for m in rec["messages"] if m["role"] == "user")


@pytest.mark.e2e
def test_e2e_the_stage_keeps_every_benchmark_prompt_out_of_the_projects_training_prompts(tmp_path):
    """The prepare stage as dvc.yaml runs it, on the project's sources with MT-bench and HumanEval added as sources
    (formats mtbench and opencodeinstruct): none of their prompts, nor any held-out one, is selected."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    project = params["prepare"]["sources"]  # paths relative to the repository, where the stage runs
    params["prepare"]["sources"] = project + [
        {"name": "mtbench", "path": benchmarks.MTBENCH, "format": "mtbench", "n": 80},
        {
            "name": "humaneval",
            "path": benchmarks.HUMANEVAL,
            "format": "opencodeinstruct",
            "n": 164,
            "columns": {"input": "prompt"},
        },
    ]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out, report = tmp_path / "prompts.jsonl", tmp_path / "prepare.json"
    ran = subprocess.run(
        [
            sys.executable,
            "stages/prepare.py",
            "--params",
            str(tmp_path / "params.yaml"),
            "--out",
            str(out),
            "--report",
            str(report),
            "--heldout",
            "data/eval/heldout.jsonl",
            "--timings",
            str(tmp_path / "t.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    texts = {benchmarks.normalise(t) for p in read_prompts(out) for t in benchmarks.user_texts(p.messages)}
    assert texts and not texts & benchmarks.excluded_texts(ROOT / "data/eval/heldout.jsonl")
    counts = json.loads(report.read_text())["sources"]
    assert (counts["mtbench"]["benchmark"], counts["mtbench"]["selected"]) == (80, 0)
    assert (counts["humaneval"]["benchmark"], counts["humaneval"]["selected"]) == (164, 0)
    assert sum(c["selected"] for c in counts.values()) == sum(s["n"] for s in project)
