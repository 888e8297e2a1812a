"""``make results-page``: docs/benchmarks.md and the README's figures, written from the records in ``results/``
(eaglepipe/tools/results.py), so that the page, the README and the data cannot drift apart
(tests/tools/test_benchmarks_page.py checks the committed ones against what this writes).

The page: the newest ``make bench`` of each machine, evaluate's figures in ``make repro``, what ``make repro`` and
every test cost per machine class, acceptance against the trained tokens (the newest ``make bench`` with crossings),
and the components' figures (every other record, by name). Each figure names its command, commit, machine and date.
The README: its headline (the committed drafter's ``make bench``) and its cost paragraph, each between the markers
``<!-- results: NAME -->`` and ``<!-- /results -->``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import click

from eaglepipe.core.codedeps import ROOT
from eaglepipe.tools import results
from eaglepipe.tools.results import KINDS, Record, Value

PAGE, README = Path("docs/benchmarks.md"), Path("README.md")
LIMIT = 14 * 1024  # bytes the page may take
SET_NAMES = {
    "heldout": "held-out",
    "mtbench": "MT-bench",
    "mtbench-turn1": "MT-bench turn 1",
    "mtbench-turn2": "MT-bench turn 2",
    "humaneval": "HumanEval",
}
STAGES = ("prepare", "infer", "merge", "hidden", "train", "evaluate", "serve")
INTRO = """# Benchmarks

<!-- Written by `make results-page` (eaglepipe/tools/benchmarks_page.py) from results/*.jsonl: edit those, not this. -->

The project's current figures, each with its command, commit, machine and date: the records of
[results/](../results) (schema: `eaglepipe/tools/results.py`), which `make repro` and `make bench` extend; git keeps
the figures they replaced. τ is the acceptance length: tokens emitted per target forward in greedy chain speculative
decoding, 3 draft tokens, ± one standard error over conversations; a difference is paired over the same
conversations, * where it exceeds twice its error. The target is the embedded SmolLM2-135M-Instruct, the params the
defaults (`params`: the hash of their result keys), unless a note says otherwise."""


def tau(value: Value | None, signed: bool = False) -> str:
    """An acceptance figure with its error (``-`` where there is none); a signed one starred beyond twice it."""
    if value is None:
        return "-"
    text = f"{value.value:+.3f}" if signed else f"{value.value:.3f}"
    if value.se is None:
        return text
    star = "*" if signed and abs(value.value) > 2 * value.se else ""
    return f"{text} ± {value.se:.3f}{star}"


def number(value: Value | None) -> str:
    """A plain figure: whole numbers with thousands separators, others as they are stored."""
    if value is None:
        return "-"
    text = f"{value.value:,.0f}" if value.value == int(value.value) else f"{value.value:g}"
    return text + (f" ± {value.se:g}" if value.se is not None else "")


def minutes(value: Value | None) -> str:
    return "-" if value is None else f"{value.value / 60:.1f} min"


def machine(record: Record) -> str:
    return f"{record.machine.label} ({KINDS[record.machine.kind]})"


def source(record: Record, with_machine: bool = False, with_params: bool = True) -> str:
    """Where a record's figures come from: (its machine,) command, commit, date, (params hash,) then its note."""
    parts = [machine(record)] if with_machine else []
    parts += [f"`{record.command}`", f"commit {record.commit or 'not recorded'}", str(record.date)]
    parts += [f"params {record.params_hash}"] if with_params and record.params_hash else []
    return "; ".join(parts) + "." + (f" {record.note}." if record.note else "")


def speed(record: Record, name: str, method: str) -> str:
    """A method's tokens/s and its ratio to plain decoding's, as far as the record holds them."""
    ratio = record.values.get(f"speedup.{name}.{method}")
    tokens = record.values.get(f"tokens_per_s.{name}.{method}")
    shown = number(tokens) if tokens else ""
    if ratio and method != "plain":
        shown += f" ({ratio.value:.2f}x)" if shown else f"{ratio.value:.2f}x"
    return shown or "-"


def bench_table(record: Record) -> list[str]:
    """One ``make bench`` record: per set the drafter's and prompt lookup's τ, their difference and the speeds."""
    lines = [
        "| benchmark | drafter τ | prompt lookup τ | drafter − prompt lookup | "
        "tokens/s: plain, drafter, prompt lookup |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, label in SET_NAMES.items():
        values = record.values
        timed = f"speedup.{name}.eagle3" in values
        speeds = ", ".join(speed(record, name, method) for method in ("plain", "eagle3", "ngram")) if timed else ""
        lines.append(
            f"| {label} | {tau(values.get(f'tau.{name}.eagle3'))} | {tau(values.get(f'tau.{name}.ngram'))} | "
            f"{tau(values.get(f'diff.{name}.eagle3 - ngram'), signed=True)} | {speeds} |"
        )
    return lines


def has_crossings(record: Record) -> bool:
    return any(key.startswith("slope.") for key in record.values)


def paragraph(text: str, indent: str = "") -> str:
    """Prose wrapped at 120 columns (``indent`` before every line but the first)."""
    return textwrap.fill(text, width=120, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def bench_section(records: list[Record]) -> list[str]:
    lines = [
        "## The result: `make bench`",
        "",
        paragraph(
            "All 45 held-out prompts, MT-bench's 80 questions (both turns) and HumanEval's 164 problems, each decoded "
            "in vLLM as the serve check runs it (float32, eager), 64 new tokens per turn, by plain decoding, the "
            "trained drafter and prompt lookup (vLLM's n-gram), 16 requests in flight unless the command says "
            "otherwise; the newest run of each machine. Speeds: tokens/s and their ratio to plain decoding's."
        ),
    ]
    for record in latest(records, "make bench"):
        lines += ["", f"### {machine(record)}", "", *bench_table(record), "", paragraph(source(record))]
    return lines


def evaluate_table(record: Record) -> list[str]:
    lines = ["| benchmark | drafter τ | prompt lookup τ | drafter − prompt lookup | turns |"]
    lines += ["| --- | ---: | ---: | ---: | ---: |"]
    for name, label in SET_NAMES.items():
        values = record.values
        lines.append(
            f"| {label} | {tau(values.get(f'tau.{name}.eagle3'))} | {tau(values.get(f'tau.{name}.ngram'))} | "
            f"{tau(values.get(f'diff.{name}.eagle3 - ngram'), signed=True)} | {number(values.get(f'turns.{name}'))} |"
        )
    return lines


def evaluate_section(records: list[Record]) -> list[str]:
    lines = [
        "## evaluate in `make repro`",
        "",
        paragraph(
            "The sample `make repro` decodes in-process (`metrics/eval.json`), lossless checked: small sets, so wide "
            "errors (the whole sets: `make bench` above)."
        ),
    ]
    for record in latest(records, "evaluate"):
        lines += ["", *evaluate_table(record), "", paragraph(source(record, with_machine=True))]
    return lines


def cost_section(records: list[Record]) -> list[str]:
    """``make repro`` (and ``make gpu-check``) per machine: the wall time and each stage's; every test's time."""
    runs = results.latest_per_machine(results.named(records, "make repro") + results.named(records, "make gpu-check"))
    lines = [
        "## The cost of `make repro` and of the tests",
        "",
        "The newest run of each machine: wall minutes, the environments' set-up included, and each stage's seconds.",
        "",
        "| machine | command | wall | " + " | ".join(STAGES) + " |",
        "| --- | --- | ---: |" + " ---: |" * len(STAGES),
    ]
    for record in runs:
        stages = " | ".join(number(record.values.get(f"seconds.{stage}")) for stage in STAGES)
        lines.append(f"| {machine(record)} | {record.name} | {minutes(record.values['seconds.wall'])} | {stages} |")
    lines += [""] + [paragraph(f"- {record.machine.label}: {source(record)}", "  ") for record in runs]
    tests = test_runs(records)
    lines += ["", "The tests (`.ci/run`: every test, both environments built first; `make test`):", ""]
    lines += ["| machine | wall | tests passed | command; commit; date |", "| --- | ---: | ---: | --- |"]
    lines += [
        f"| {machine(record)} | {minutes(record.values['seconds.wall'])} | "
        f"{number(record.values.get('tests.passed'))} | {source(record, with_params=False)} |"
        for record in tests
    ]
    return lines


def drafters(record: Record) -> list[str]:
    """The drafters of a ``make bench`` record with crossings: the drafter, then the others by trained tokens."""
    others = [key.removeprefix("ratio.") for key in record.values if key.startswith("ratio.")]
    return ["eagle3", *sorted(others, key=lambda method: record.values[f"ratio.{method}"].value)]


def ratio(record: Record, method: str) -> str:
    """A drafter's trained tokens over the first drafter's, as ``4.3x``."""
    times = record.values[f"ratio.{method}"].value if method != "eagle3" else 1.0
    return f"{times:.1f}".removesuffix(".0") + "x"


def scaling_rows(record: Record) -> list[str]:
    """Per drafter: trained tokens, validation acc_0, τ per set, minutes beyond the first; prompt lookup last."""
    lines = []
    for method in [*drafters(record), "ngram"]:
        values = record.values
        taus = " | ".join(tau(values.get(f"tau.{name}.{method}")) for name in SET_NAMES)
        label = ratio(record, method) if method != "ngram" else "prompt lookup"
        lines.append(
            f"| {label} | {number(values.get(f'trained_tokens.{method}'))} | {tau(values.get(f'acc_0.{method}'))} | "
            f"{taus} | {number(values.get(f'cost_minutes.{method}'))} |"
        )
    return lines


def scaling_section(records: list[Record]) -> list[str]:
    """The newest ``make bench`` with crossings: τ per drafter, then where the largest one's line meets n-gram."""
    found = [record for record in results.named(records, "make bench") if has_crossings(record)]
    if not found:
        return []
    record = found[-1]
    largest = drafters(record)[-1]
    lines = [
        "## Acceptance against trained tokens",
        "",
        paragraph(
            f"One `make bench` run of drafters trained on more data, on {machine(record)}; minutes: infer, hidden "
            "and train beyond the first drafter's. Then, per set, the largest drafter against prompt lookup, and a "
            "straight line in log2(trained tokens) through it and the first: τ per doubling, and the doublings beyond "
            "it to prompt lookup (negative: crossed before it; `-`: crossed)."
        ),
        "",
        "| drafter | trained tokens | valid acc_0 | " + " | ".join(SET_NAMES.values()) + " | minutes |",
        "| --- | ---: | ---: |" + " ---: |" * (len(SET_NAMES) + 1),
        *scaling_rows(record),
        "",
        f"| set | {ratio(record, largest)} − prompt lookup | τ per doubling | doublings beyond |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, label in SET_NAMES.items():
        values = record.values
        gap = tau(values.get(f"diff.{name}.{largest} - ngram"), signed=True)
        slope = tau(values.get(f"slope.{name}.{largest}"), signed=True)
        lines.append(f"| {label} | {gap} | {slope} | {number(values.get(f'beyond.{name}.{largest}'))} |")
    return lines + ["", paragraph(source(record))]


RECIPES = "training recipes and drafter methods on the same data (`bench/bench_recipes.py`)"
"""The name of bench/bench_recipes.py's records, whose table is docs/experiments.md's (tools/recipes_table.py)."""
MAIN = {"make bench", "evaluate", "make repro", "make gpu-check", ".ci/run", "make test", RECIPES}


def components_section(records: list[Record]) -> list[str]:
    """Every other record's newest of each machine, grouped by name, each a line of its figures and its source."""
    lines = ["## Components", "", "Single stages and tools, each measured by its script (older runs: results/)."]
    others = [record for record in records if record.name not in MAIN]
    for name in dict.fromkeys(record.name for record in others):
        lines += ["", f"### {name}", ""]
        for record in latest(others, name):
            figures = "; ".join(f"{key}: {number(value)}" for key, value in record.values.items())
            lines.append(paragraph(f"- {figures}. {source(record, with_machine=True, with_params=False)}", "  "))
    return lines


def page(records: list[Record]) -> str:
    sections = [bench_section, evaluate_section, cost_section, scaling_section, components_section]
    parts = [INTRO] + ["\n".join(section(records)) for section in sections]
    return "\n\n".join(part for part in parts if part) + "\n"


VERDICTS = {
    "beats": "beats prompt lookup beyond twice the error on",
    "leads": "leads it within twice the error on",
    "trails": "trails it within twice the error on",
    "loses": "loses to it beyond twice the error on",
}


def verdict(difference: Value) -> str:
    """How the drafter stands against prompt lookup by a paired difference: a key of VERDICTS."""
    clear = difference.se is None or abs(difference.value) > 2 * difference.se
    if difference.value > 0:
        return "beats" if clear else "leads"
    return "loses" if clear else "trails"


def committed_bench(records: list[Record]) -> Record | None:
    """The newest ``make bench`` of the machine whose ``make repro`` made the figures in git (the newest evaluate
    record's), else the newest ``make bench``; runs with crossings (other drafters) left out."""
    benches = [record for record in results.named(records, "make bench") if not has_crossings(record)]
    evaluations = results.named(records, "evaluate")
    if evaluations:
        here = evaluations[-1].machine.identity
        benches = [record for record in benches if record.machine.identity == here] or benches
    return benches[-1] if benches else None


def standing(values: dict[str, Value]) -> str:
    """The drafter against prompt lookup in words, the sets grouped by verdict, and its speed against plain."""
    by_verdict = {}
    for name, label in SET_NAMES.items():
        if f"diff.{name}.eagle3 - ngram" in values:
            by_verdict.setdefault(verdict(values[f"diff.{name}.eagle3 - ngram"]), []).append(label)
    clauses = [f"{VERDICTS[v]} {' and '.join(by_verdict[v])}" for v in VERDICTS if v in by_verdict]
    listed = ", ".join(clauses[:-1]) + ", and " + clauses[-1] if len(clauses) > 1 else "".join(clauses)
    text = f"The drafter {listed}."
    drafter = [values[f"speedup.{n}.eagle3"].value for n in SET_NAMES if f"speedup.{n}.eagle3" in values]
    ngram = [values[f"speedup.{n}.ngram"].value for n in SET_NAMES if f"speedup.{n}.ngram" in values]
    if drafter and ngram:
        text += (
            f" It decodes at {min(drafter):.2f}x to {max(drafter):.2f}x plain decoding's tokens/s, prompt lookup at "
            f"{min(ngram):.2f}x to {max(ngram):.2f}x"
            + (": both are slower than plain decoding there." if max(drafter + ngram) < 1 else ".")
        )
    return text


def headline(records: list[Record]) -> str:
    """The README's result: the committed drafter's make bench table and its standing in words."""
    record = committed_bench(records)
    if record is None:
        return "No `make bench` figures yet."
    intro = (
        f"**Result** (`make bench`: every held-out prompt, MT-bench question and HumanEval problem, decoded in vLLM; "
        f"{machine(record)}, commit {record.commit}): the default drafter's acceptance length τ against prompt "
        "lookup's (n-gram), ± one standard error over conversations, the difference paired, * beyond twice its error."
    )
    return "\n".join([paragraph(intro), "", *bench_table(record), "", paragraph(standing(record.values))])


def latest(records: list[Record], name: str) -> list[Record]:
    """The newest record named ``name`` of each machine."""
    return results.latest_per_machine(results.named(records, name))


def test_runs(records: list[Record]) -> list[Record]:
    """The newest ``.ci/run`` (every test) and ``make test`` of each machine."""
    return latest(records, ".ci/run") + latest(records, "make test")


def timed(records: list[Record]) -> str:
    """``records``' wall times, each with its machine."""
    return ", ".join(f"{minutes(r.values['seconds.wall'])} on {machine(r)}" for r in records)


def cost(records: list[Record]) -> str:
    """The README's cost paragraph: the newest ``make repro``, ``.ci/run`` and ``make test`` on each machine."""
    runs = latest(records, "make repro")
    every = latest(records, ".ci/run")
    quick = latest(records, "make test")
    text = (
        "How long `make repro` takes from a fresh clone with nothing installed, the environments' set-up included: "
        + ", ".join(f"**{minutes(r.values['seconds.wall'])}** on {machine(r)}" for r in runs)
        + f". Every test (`.ci/run`): {timed(every)}."
        + (f" `make test` (the unit tier and one smoke run of every stage): {timed(quick)}." if quick else "")
    )
    return paragraph(text)


def fill_blocks(readme: str, blocks: dict[str, str], path: Path = README) -> str:
    """``readme`` (the text of ``path``) with the text between ``<!-- results: NAME -->`` and ``<!-- /results -->``
    replaced by ``blocks[NAME]``; a missing marker is an error."""
    for name, text in blocks.items():
        pattern = re.compile(rf"(<!-- results: {name} -->\n).*?(<!-- /results -->)", re.S)
        found = pattern.search(readme)
        if not found:
            raise click.ClickException(f"{path}: no <!-- results: {name} --> ... <!-- /results --> block")
        readme = readme[: found.start()] + found.group(1) + text + "\n" + found.group(2) + readme[found.end() :]
    return readme


def readme_blocks(records: list[Record]) -> dict[str, str]:
    return {"headline": headline(records), "cost": cost(records)}


@click.command(help=__doc__)
@click.option("--results", "folder", default=str(ROOT / "results"), show_default=True, type=click.Path(file_okay=False))
@click.option("--page", "page_path", default=str(ROOT / PAGE), show_default=True, type=click.Path(dir_okay=False))
@click.option("--readme", "readme_path", default=str(ROOT / README), show_default=True, type=click.Path(dir_okay=False))
def main(folder, page_path, readme_path):
    try:
        records = results.load(Path(folder))
    except results.ResultsError as e:
        raise click.ClickException(str(e)) from None
    text = page(records)
    if len(text.encode()) > LIMIT:
        raise click.ClickException(f"{PAGE}: {len(text.encode()):,} bytes, over its {LIMIT:,}: fewer records or words")
    readme = Path(readme_path).read_text(encoding="utf-8")
    Path(readme_path).write_text(fill_blocks(readme, readme_blocks(records)), encoding="utf-8")
    Path(page_path).write_text(text, encoding="utf-8")
    click.echo(f"wrote {page_path} ({len(text.encode()):,} bytes) and the figures of {readme_path} from {folder}")


if __name__ == "__main__":
    main()
