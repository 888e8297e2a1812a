"""docs/experiments.md's table of training recipes and drafter methods, written by ``make results-page`` from the
newest ``bench/bench_recipes.py`` record (``benchmarks_page.RECIPES``, in results/components.jsonl), between the
markers ``<!-- results: recipes -->`` and ``<!-- /results -->``: each point's acceptance length per benchmark ± its
standard error over turns, its difference from the first point's (paired, * beyond twice its error), its validation
accuracy per TTT step, and prompt lookup's lengths on the same turns."""

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


def table(records: list[Record]) -> str:
    """The newest recipes record as a markdown table and its source, or a line saying there is none."""
    found = results.named(records, RECIPES)
    if not found:
        return "No `bench/bench_recipes.py` figures yet."
    record = found[-1]
    benchmarks = [name for name in SET_NAMES if f"{points(record)[0]}: τ {name}" in record.values]
    heading = ["point", *(f"τ {SET_NAMES[name]}" for name in benchmarks), "valid acc per TTT step"]
    lines = ["| " + " | ".join(heading) + " |", "|---|" + "---:|" * (len(heading) - 1)]
    lines += [row(record, point, benchmarks) for point in points(record)]
    return "\n".join([*lines, "", paragraph(source(record, with_machine=True))])


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
