"""docs/benchmarks.md and the README's figures are what ``make results-page`` (eaglepipe/tools/benchmarks_page.py)
writes from the committed results/, so they cannot drift; the page stays within its size; a malformed record stops
the page with the file, the line and the field."""

import datetime
import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from eaglepipe.tools import benchmarks_page, recipes_table, results
from eaglepipe.tools.results import Machine, Record, Value

ROOT = Path(__file__).resolve().parents[2]
README_COPY = (
    "# a README\n<!-- results: headline -->\nold\n<!-- /results -->\n<!-- results: cost -->\n<!-- /results -->\n"
)


def written_to(folder: Path) -> list[str]:
    """make results-page's options for reading results from ``folder`` and writing its page and README there."""
    (folder / "README.md").write_text(README_COPY)
    return ["--results", str(folder), "--page", str(folder / "page.md"), "--readme", str(folder / "README.md")]


def committed() -> list[Record]:
    return results.load(ROOT / "results")


def test_the_committed_page_is_what_the_committed_results_make():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == benchmarks_page.page(committed()), "docs/benchmarks.md differs from results/: make results-page"


def test_the_page_is_at_most_12_kb():
    assert len((ROOT / "docs" / "benchmarks.md").read_bytes()) <= 14 * 1024 == benchmarks_page.LIMIT


def test_the_readmes_figures_are_what_the_committed_results_make():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = benchmarks_page.readme_blocks(committed())
    assert benchmarks_page.fill_blocks(readme, blocks) == readme, "README.md's figures differ: make results-page"
    headline = " ".join(blocks["headline"].split())
    assert "| HumanEval |" in headline and "x plain decoding's tokens/s" in headline


def test_the_experiments_pages_recipes_table_is_what_the_committed_results_make():
    text = (ROOT / "docs" / "experiments.md").read_text(encoding="utf-8")
    table = recipes_table.table(committed())
    assert benchmarks_page.fill_blocks(text, {"recipes": table}) == text, "docs/experiments.md: make results-page"
    newest = results.named(committed(), benchmarks_page.RECIPES)
    assert not newest or f"`{newest[-1].command}`" in " ".join(table.split())


def test_the_page_names_every_current_record_and_its_command():
    page = benchmarks_page.page(committed())
    words = " ".join(page.split())  # a command may be wrapped over two lines
    records = committed()
    for name in dict.fromkeys(record.name for record in records if record.name != benchmarks_page.RECIPES):
        for record in benchmarks_page.latest(records, name):  # each machine's newest; older runs stay in results/
            assert f"`{record.command}`" in words, record.name
    for anchor in ("## The result: `make bench`", "## Acceptance against trained tokens", "### hidden (`bench/"):
        assert anchor in page  # other pages link to these headings


def bench_record(diffs: dict[str, tuple[float, float]], machine: Machine, day="2026-12-05") -> Record:
    values = {f"diff.{name} - ngram": Value(value=d, se=se) for name, (d, se) in diffs.items()}
    values |= {"speedup.heldout.eagle3": Value(value=0.6), "speedup.heldout.ngram": Value(value=1.2)}
    return Record(
        name="make bench",
        values=values,
        machine=machine,
        commit="abcdef1",
        params_hash=None,
        command="make bench",
        date=datetime.date.fromisoformat(day),
    )


def test_the_headline_says_where_the_drafter_stands_plainly():
    epyc = Machine(cpu="AMD EPYC", flags=("avx2", "avx512f"), cores=2)
    diffs = {"heldout.eagle3": (0.2, 0.05), "mtbench.eagle3": (-0.05, 0.05), "humaneval.eagle3": (-0.3, 0.05)}
    text = benchmarks_page.standing(bench_record(diffs, epyc).values)
    assert text.startswith(
        "The drafter beats prompt lookup beyond twice the error on held-out, trails it within twice the error on "
        "MT-bench, and loses to it beyond twice the error on HumanEval."
    )
    assert "0.60x to 0.60x plain decoding's tokens/s, prompt lookup at 1.20x to 1.20x." in text


def test_the_headline_takes_the_machine_whose_repro_made_the_metrics_in_git():
    epyc = Machine(cpu="AMD EPYC", flags=("avx2", "avx512f"), cores=2)
    xeon = Machine(cpu="Intel Xeon", flags=("avx2", "avx512f", "amx_tile"), cores=2)
    here, newer = bench_record({}, epyc), bench_record({}, xeon, day="2026-12-07")
    evaluation = here.model_copy(update={"name": "evaluate"})
    assert benchmarks_page.committed_bench([here, newer, evaluation]) == here
    assert benchmarks_page.committed_bench([here, newer]) == newer


def test_a_malformed_record_stops_the_page_naming_file_line_and_field(tmp_path):
    lines = (ROOT / "results" / "repro.jsonl").read_text().splitlines()
    broken = json.loads(lines[1])
    broken["values"]["seconds.wall"]["value"] = "twenty minutes"
    (tmp_path / "repro.jsonl").write_text("\n".join([lines[0], json.dumps(broken)]) + "\n")
    out = CliRunner().invoke(benchmarks_page.main, written_to(tmp_path))
    assert out.exit_code == 1
    assert f"{tmp_path / 'repro.jsonl'}:2: values.seconds.wall.value: Input should be a valid number" in out.output


def test_a_page_over_its_size_is_refused(tmp_path):
    template = json.loads((ROOT / "results" / "bench.jsonl").read_text().splitlines()[0])
    for n in range(20):  # twenty machines' tables
        template["machine"]["cores"] = n + 1
        results.append(Record.model_validate_json(json.dumps(template)), tmp_path / "bench.jsonl")
    out = CliRunner().invoke(benchmarks_page.main, written_to(tmp_path))
    assert out.exit_code == 1 and "over its 14,336: fewer records or words" in out.output
    assert (tmp_path / "README.md").read_text() == README_COPY and not (tmp_path / "page.md").exists()


def test_the_page_and_the_readme_are_written_where_asked(tmp_path):
    results.append(committed()[0], tmp_path / "a.jsonl")
    out = CliRunner().invoke(benchmarks_page.main, written_to(tmp_path))
    assert out.exit_code == 0, out.output
    assert (tmp_path / "page.md").read_text().startswith("# Benchmarks")
    assert "**Result**" not in (tmp_path / "README.md").read_text()  # no make bench record: no headline yet
    assert "No `make bench` figures yet." in (tmp_path / "README.md").read_text()


def test_a_readme_without_its_markers_is_an_error():
    with pytest.raises(click.ClickException, match="no <!-- results: headline -->"):
        benchmarks_page.fill_blocks("# a page\n", {"headline": "text"})


def test_a_crossing_make_bench_appended_renders_by_its_ratio():
    """make bench --against big=... --crossing big=2.5 records the ratio, not the trained tokens."""
    epyc = Machine(cpu="AMD EPYC", flags=("avx2", "avx512f"), cores=2)
    record = bench_record({"heldout.eagle3:big": (0.3, 0.05)}, epyc)
    values = record.values | {
        "ratio.eagle3:big": Value(value=2.5),
        "tau.heldout.eagle3:big": Value(value=1.6, se=0.03),
        "slope.heldout.eagle3:big": Value(value=0.1, se=0.02),
    }
    lines = benchmarks_page.scaling_section([record.model_copy(update={"values": values})])
    assert "| 2.5x | - | - | 1.600 ± 0.030 | - | - | - | - | - |" in lines
    assert "| held-out | +0.300 ± 0.050* | +0.100 ± 0.020* | - |" in lines


def test_the_recipes_table_has_a_row_per_point_in_run_order_and_prompt_lookups_last():
    values = {
        "eagle3: τ heldout": Value(value=1.5, se=0.05),
        "eagle3: valid acc 0": Value(value=0.41),
        "eagle3: valid acc 1": Value(value=0.2),
        "eagle3.1: τ heldout": Value(value=1.6, se=0.05),
        "eagle3.1: Δ τ heldout": Value(value=0.1, se=0.02),
        "eagle3.1: valid acc 0": Value(value=0.43),
        "eagle3.1: valid acc 1": Value(value=0.22),
        "n-gram: τ heldout": Value(value=1.2, se=0.04),
    }
    epyc = Machine(cpu="AMD EPYC", flags=("avx2", "avx512f"), cores=2)
    record = Record(
        name=benchmarks_page.RECIPES,
        values=values,
        machine=epyc,
        commit="abcdef1",
        params_hash=None,
        command="python bench/bench_recipes.py --point eagle3 --point eagle3.1",
        date=datetime.date.fromisoformat("2026-12-07"),
    )
    lines = recipes_table.table([record]).splitlines()
    assert lines[0] == "| point | τ held-out | valid acc per TTT step |"
    assert lines[2] == "| `eagle3` | 1.500 ± 0.050 | 0.410 / 0.200 |"
    assert lines[3] == "| `eagle3.1` | 1.600 ± 0.050 (+0.100 ± 0.020*) | 0.430 / 0.220 |"
    assert lines[4] == "| prompt lookup (n-gram) | 1.200 ± 0.040 |  |"
    assert "`python bench/bench_recipes.py --point eagle3 --point eagle3.1`" in " ".join(lines[6:])


def test_the_recipes_table_takes_each_point_from_the_newest_record_of_the_same_baseline():
    epyc = Machine(cpu="AMD EPYC", flags=("avx2", "avx512f"), cores=2)

    def record(commit: str, figures: dict[str, float], first: str = "eagle3") -> Record:
        values = {f"{point}: τ heldout": Value(value=tau, se=0.05) for point, tau in figures.items()}
        return Record(
            name=benchmarks_page.RECIPES,
            values={**values, "n-gram: τ heldout": Value(value=1.2, se=0.04)},
            machine=epyc,
            commit=commit,
            params_hash=commit * 2 + "ab",
            command=f"python bench/bench_recipes.py --point {' --point '.join(figures)}",
            date=datetime.date.fromisoformat("2026-12-07"),
        )

    older = record("aaaaaa1", {"eagle3": 1.5, "eagle3.1": 1.6})
    other_baseline = record("bbbbbb2", {"fresh": 1.1, "eagle3.1": 1.0})
    other_figures = record("dddddd4", {"eagle3": 1.4, "peagle": 1.0})  # another eagle3: not comparable
    newer = record("cccccc3", {"eagle3": 1.5, "dflash": 1.7})
    lines = recipes_table.table([older, other_baseline, other_figures, newer]).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:6]] == [
        "| `eagle3`",
        "| `eagle3.1`",
        "| `dflash`",
        "| prompt lookup (n-gram)",
    ]
    assert lines[3].startswith("| `eagle3.1` | 1.600") and lines[4].startswith("| `dflash` | 1.700")
    text = " ".join(lines[6:])
    assert "`eagle3`, `dflash`, prompt lookup: AMD EPYC" in text and "commit cccccc3" in text
    assert "`eagle3.1`: AMD EPYC" in text and "commit aaaaaa1" in text
    assert "bbbbbb2" not in text and "dddddd4" not in text and "peagle" not in text
