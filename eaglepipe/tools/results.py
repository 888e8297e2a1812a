"""The project's measured figures as data: ``results/*.jsonl``, one record a line, the schema below defined once and
validated with pydantic. ``make repro`` and ``make bench`` append to them; ``make results-page`` renders
docs/benchmarks.md from them (eaglepipe/tools/benchmarks_page.py). git holds the earlier figures: a record that a new
one supersedes is deleted, not kept beside it.

A record (``Record``) is one run of one command:

- ``name``: what was measured, the section of the page it belongs to: ``make bench``, ``make repro``, ``evaluate``,
  ``make gpu-check``, ``.ci/run``, or a component's name (a stage's bench script) for the page's last section.
- ``values``: each figure by key, ``{"value": 1.453, "se": 0.025}``; ``se`` (one standard error) only where there is
  one. Keys are dotted: ``<quantity>.<set>.<method>`` for acceptance figures, where a set is ``heldout``,
  ``mtbench``, ``mtbench-turn1``, ``mtbench-turn2`` or ``humaneval`` and a method ``eagle3`` (the drafter), ``ngram``
  (prompt lookup), ``plain`` or ``eagle3:<label>`` (another drafter, ``make bench --against``):

  - ``tau.<set>.<method>``: acceptance length τ (tokens emitted per target forward);
  - ``diff.<set>.<a> - <b>``: τ of a minus τ of b, paired over the same conversations;
  - ``tokens_per_s.<set>.<method>`` and ``speedup.<set>.<method>`` (tokens/s over plain decoding's);
  - ``equal.<set>.<method>`` (outputs equal to plain decoding's) and ``turns.<set>``;
  - ``slope.<set>.<method>`` (τ per doubling of the trained tokens, from the drafter to this one) and
    ``beyond.<set>.<method>`` (doublings beyond this one to prompt lookup's τ), ``make bench --crossing``;
  - ``ratio.<method>``: its trained tokens over the drafter's (``make bench --crossing``);
  - ``trained_tokens.<method>``, ``acc_0.<method>`` (validation accuracy of the first draft token) and
    ``cost_minutes.<method>`` (minutes of infer, hidden and train beyond the drafter's);
  - ``seconds.wall`` (a whole command, ``time``'s figure) and ``seconds.<stage>`` (one stage's wall time);
  - ``tests.passed``;
  - a component's figures under keys of their own words.
- ``machine``: the CPU's model, its flags among ``FLAGS``, the cores the run could use, the memory, the GPU if any;
  its ``kind`` (GPU, AVX-512 with AMX, AVX-512, AVX2) is the class ``make repro`` estimates by.
- ``commit`` (git's short hash of the code that ran), ``params_hash`` (eaglepipe/tools/provenance.py: a hash of the
  params file's result keys), ``command`` (as typed), ``date`` (the day it ran, UTC), ``note`` (what the fields above
  cannot say: whose drafter, which data).
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eaglepipe.core.errors import UserError

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
"""The CPU flags a record keeps (``/proc/cpuinfo``): those that decide which kernels torch and vLLM run."""

KINDS = {"gpu": "GPU", "avx512-amx": "AVX-512 with AMX", "avx512": "AVX-512", "avx2": "AVX2 only"}
"""The machine classes, fastest kernels first, with their names on the page."""

SETS = ("heldout", "mtbench", "mtbench-turn1", "mtbench-turn2", "humaneval")
"""The acceptance sets of the keys, in the page's order."""


class ResultsError(UserError):
    """A results file that breaks the schema; the message names the file, the line and the field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Value(Strict):
    value: float
    se: float | None = Field(None, ge=0, exclude_if=lambda se: se is None)


class Machine(Strict):
    cpu: str = Field(min_length=1)
    flags: tuple[Literal[FLAGS], ...]
    cores: int = Field(ge=1)
    memory_gib: float | None = Field(None, gt=0)
    gpu: str | None = None

    @property
    def kind(self) -> str:
        """The class ``make repro`` estimates by: a key of KINDS."""
        if self.gpu:
            return "gpu"
        if "amx_tile" in self.flags or "amx_bf16" in self.flags:
            return "avx512-amx"
        if "avx512f" in self.flags:
            return "avx512"
        return "avx2"

    @property
    def identity(self) -> tuple:
        """What tells two machines apart: all but the memory (which the kernel reports a little differently)."""
        return (self.cpu, self.flags, self.cores, self.gpu)

    @property
    def label(self) -> str:
        """The machine in a few words: its GPU or CPU, and its cores."""
        return f"{self.gpu}, {self.cores} CPU cores" if self.gpu else f"{self.cpu}, {self.cores} cores"


class Record(Strict):
    name: str = Field(min_length=1)
    values: dict[str, Value] = Field(min_length=1)
    machine: Machine
    commit: str | None = Field(pattern=r"^[0-9a-f]{7,40}$")
    params_hash: str | None = Field(pattern=r"^[0-9a-f]{16}$")
    command: str = Field(min_length=1)
    date: datetime.date
    note: str | None = Field(None, exclude_if=lambda note: note is None)


def problem(error: ValidationError) -> str:
    """The first problem pydantic found, as ``field: message`` (the field dotted from the record's top)."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    return f"{field}: {first['msg']}" if field else first["msg"]


def read(path: Path) -> list[Record]:
    """Every record of one results file, in its order; a line that breaks the schema raises ResultsError naming the
    file, the line and the field."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(Record.model_validate_json(line))
        except ValidationError as e:
            raise ResultsError(f"{path}:{number}: {problem(e)}") from None
    return records


def load(folder: Path) -> list[Record]:
    """The records of every ``*.jsonl`` in ``folder``, oldest first (by date; one day's in file order)."""
    records = [record for path in sorted(Path(folder).glob("*.jsonl")) for record in read(path)]
    return sorted(records, key=lambda record: record.date)


def line(record: Record) -> str:
    """A record as its line in a results file: the fields in the schema's order, an absent error or note left out."""
    return json.dumps(record.model_dump(mode="json"), ensure_ascii=False)


def append(record: Record, path: Path) -> None:
    """Add ``record`` as the last line of ``path`` (created with its folder where missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line(record) + "\n")


def named(records: list[Record], name: str) -> list[Record]:
    return [record for record in records if record.name == name]


def latest_per_machine(records: list[Record]) -> list[Record]:
    """The newest record of each machine (its CPU, flags, cores and GPU), in the order of each machine's first
    record."""
    newest = {}
    for record in records:
        newest[record.machine.identity] = record
    return list(newest.values())


def latest_of_kind(records: list[Record], kind: str) -> Record | None:
    """The newest of ``records`` run on a machine of class ``kind`` (KINDS), or None."""
    found = [record for record in records if record.machine.kind == kind]
    return found[-1] if found else None


def figure(value: float, se: float | None = None, digits: int = 4) -> Value:
    """A Value rounded to ``digits`` decimals (its error too)."""
    return Value(value=round(value, digits), se=None if se is None else round(se, digits))


def from_eval(evaluation: dict) -> dict[str, Value]:
    """evaluate's figures (metrics/eval.json) as values: per set the drafter's and prompt lookup's τ, their
    difference with its paired error, and the turns decoded."""
    values = {}
    for name, benchmark in evaluation["benchmarks"].items():
        groups = {name: benchmark} | {f"{name}-turn{t}": g for t, g in benchmark.get("per_turn", {}).items()}
        for key, group in groups.items():
            drafter, ngram = group["acceptance_length"], group["baseline_acceptance_length"]
            values[f"tau.{key}.eagle3"] = figure(drafter, group.get("acceptance_length_se"))
            values[f"tau.{key}.ngram"] = figure(ngram, group.get("baseline_acceptance_length_se"))
            values[f"diff.{key}.eagle3 - ngram"] = figure(drafter - ngram, group.get("difference_se"))
            values[f"turns.{key}"] = figure(group["turns"])
    return values


def bench_groups(by_group: dict, name: str) -> dict[str, dict]:
    """One benchmark's figures from make bench's JSON by set key: the whole set, then each turn."""
    return {name: by_group} | {f"{name}-turn{t}": g for t, g in by_group.get("per_turn", {}).items()}


def from_bench(result: dict, ratios: dict[str, float] | None = None) -> dict[str, Value]:
    """make bench's figures (eaglepipe/evaluate/bench.py's result) as values: per set and method τ, outputs equal
    to plain decoding's, tokens/s and speed-up; the paired differences; the crossings, with each drafter's ratio of
    trained tokens (``ratios``, by label)."""
    values = {f"ratio.eagle3:{label}": figure(ratio) for label, ratio in (ratios or {}).items()}
    for name, by_method in result["benchmarks"].items():
        for method, m in by_method.items():
            values[f"tokens_per_s.{name}.{method}"] = figure(m["tokens_per_s"], digits=2)
            values[f"speedup.{name}.{method}"] = figure(m["speedup"], digits=3)
            if method == "plain":
                continue
            for key, group in bench_groups(m, name).items():
                if group["acceptance_length"] is not None:
                    values[f"tau.{key}.{method}"] = figure(group["acceptance_length"], group["acceptance_length_se"])
                values[f"equal.{key}.{method}"] = figure(group["equal_to_plain"])
                values[f"turns.{key}"] = figure(group["turns"])
    for pair, by_name in result["paired"].items():
        for name, by_group in by_name.items():
            for key, d in bench_groups(by_group, name).items():
                if d["difference"] is not None:
                    values[f"diff.{key}.{pair}"] = figure(d["difference"], d["se"])
    for label, by_name in result.get("crossing", {}).items():
        for name, by_group in by_name.items():
            for key, c in bench_groups(by_group, name).items():
                for quantity in ("slope", "beyond"):
                    if c[quantity] is not None and math.isfinite(c[quantity]):
                        values[f"{quantity}.{key}.eagle3:{label}"] = figure(c[quantity], c[f"{quantity}_se"])
    return values
