"""docs/experiments.md's table of training recipes and drafter methods, written by ``make results-page`` from the
``bench/bench_recipes.py`` records (``benchmarks_page.RECIPES``, in results/components.jsonl), between the markers
``<!-- results: recipes -->`` and ``<!-- /results -->``: each point's acceptance length per benchmark ± its standard
error over turns, its difference from the first point's (paired, * beyond twice its error), its validation accuracy
per TTT step, and prompt lookup's lengths on the same turns; each point from the newest record that ran it beside
the same first point, trained to the same figures (``chosen``)."""

from __future__ import annotations

from pathlib import Path

import click

from eaglepipe.core.codedeps import ROOT
from eaglepipe.tools import results
from eaglepipe.tools.benchmarks_page import RECIPES, SET_NAMES, fill_blocks, paragraph, source, tau
from eaglepipe.tools.results import Record

PAGE = Path("docs/experiments.md")
BASELINE = "n-gram"


def points(record: Record) -> list[str]:
    """The points the record measured, in the order it ran them, prompt lookup's last."""
    names = dict.fromkeys(key.split(": ")[0] for key in record.values)
    return [name for name in names if name != BASELINE] + [BASELINE]


def row(record: Record, point: str, benchmarks: list[str]) -> str:
    values = record.values
    cells = [f"`{point}`" if point != BASELINE else "prompt lookup (n-gram)"]
    for benchmark in benchmarks:
        cell = tau(values.get(f"{point}: τ {benchmark}"))
        difference = values.get(f"{point}: Δ τ {benchmark}")
        cells.append(cell + (f" ({tau(difference, signed=True)})" if difference else ""))
    steps = sorted(key for key in values if key.startswith(f"{point}: valid acc "))
    cells.append(" / ".join(f"{values[key].value:.3f}" for key in steps) or "")
    return "| " + " | ".join(cells) + " |"


def baseline(record: Record) -> tuple:
    """What makes two records' rows comparable: the machine, the first point, and its acceptance lengths as the table
    shows them (the same drafter, retrained, reads the same)."""
    first = points(record)[0]
    lengths = {key: round(value.value, 3) for key, value in record.values.items() if key.startswith(f"{first}: τ ")}
    return record.machine, first, lengths


def chosen(found: list[Record]) -> dict[str, Record]:
    """Each row's record, by point: the newest that measured the point, among the records with the newest one's
    ``baseline`` (so every difference is against the same drafter); prompt lookup's row from the newest. Points in
    the order they were first run."""
    newest = found[-1]
    rows = {}
    for record in found:
        if baseline(record) == baseline(newest):
            rows.update({point: record for point in points(record) if point != BASELINE})
    return {**rows, BASELINE: newest}


def table(records: list[Record]) -> str:
    """The recipes records as a markdown table (``chosen``) and the source of each row, or a line saying there is
    none."""
    found = results.named(records, RECIPES)
    if not found:
        return "No `bench/bench_recipes.py` figures yet."
    rows = chosen(found)
    first = found[-1]
    benchmarks = [name for name in SET_NAMES if f"{points(first)[0]}: τ {name}" in first.values]
    heading = ["point", *(f"τ {SET_NAMES[name]}" for name in benchmarks), "valid acc per TTT step"]
    lines = ["| " + " | ".join(heading) + " |", "|---|" + "---:|" * (len(heading) - 1)]
    lines += [row(record, point, benchmarks) for point, record in rows.items()]
    for paragraph_text in sources(rows):
        lines += ["", paragraph_text]
    return "\n".join(lines)


def sources(rows: dict[str, Record]) -> list[str]:
    """A paragraph per record the rows come from: the rows it gives, then its source."""
    records = []
    for record in rows.values():
        if not any(record is seen for seen in records):
            records.append(record)
    out = []
    for record in records:
        names = ", ".join(
            f"`{point}`" if point != BASELINE else "prompt lookup" for point, r in rows.items() if r is record
        )
        out.append(paragraph(f"{names}: {source(record, with_machine=True)}"))
    return out


@click.command(help=__doc__)
@click.option("--results", "folder", default=str(ROOT / "results"), show_default=True, type=click.Path(file_okay=False))
@click.option("--page", "page_path", default=str(ROOT / PAGE), show_default=True, type=click.Path(dir_okay=False))
def main(folder, page_path):
    records = results.load(Path(folder))
    text = Path(page_path).read_text(encoding="utf-8")
    Path(page_path).write_text(fill_blocks(text, {"recipes": table(records)}, Path(page_path)), encoding="utf-8")
    click.echo(f"wrote the recipes table of {page_path} from {folder}")


if __name__ == "__main__":
    main()
