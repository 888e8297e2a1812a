"""Benchmark: training recipes and drafter methods on the same data, each drafter's acceptance length on every
benchmark.

    python bench/bench_recipes.py [--point NAME ...] [--list] [--results FILE | --no-results]

Each point is the train params of params.yaml with a few keys changed (POINTS below; the methods' points compare
eagle3 with eagle3.1, each of its toggles alone, parallel drafting and DFlash). For each point the drafter is trained on
data/hidden in this process (what the train stage computes for those params) and its acceptance length (the evaluate
params, EAGLE only) measured on every turn evaluate decoded (data/decoded/<benchmark>.jsonl); the n-gram baseline's
once. Prints one row per point: validation acc per TTT step, acceptance per benchmark (with its difference from the
first point's, paired), train seconds; and appends the figures to the results file (results/components.jsonl).
"""

import sys
import tempfile
import time
from pathlib import Path

import click
import torch
from harness import acceptances, decoded_sets, ngram, print_table

from eaglepipe.core import config
from eaglepipe.drafter import train
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.evaluate import decode as speculative
from eaglepipe.target import model as target
from eaglepipe.tools import provenance, results
from eaglepipe.tools.benchmarks_page import RECIPES
from eaglepipe.tools.results import Value

ROOT = Path(__file__).resolve().parent.parent

# name -> overrides of the train params
POINTS = {
    "target-init": {"init": "target", "epochs": 3, "lr": 0.001},
    "fresh": {"init": "fresh", "epochs": 3, "lr": 0.001},
    "target-init-lr3": {"init": "target", "epochs": 3, "lr": 0.003},
    "fresh-vocab8k": {"init": "fresh", "epochs": 3, "lr": 0.001, "draft_vocab_size": 8192},
    "fresh-5-epochs": {"init": "fresh", "epochs": 5, "lr": 0.001},
    "fresh-6-epochs": {"init": "fresh", "epochs": 6, "lr": 0.001},
    "fresh-6-epochs-lr3": {"init": "fresh", "epochs": 6, "lr": 0.003},
    "fresh-6-epochs-wd01": {"init": "fresh", "epochs": 6, "lr": 0.001, "weight_decay": 0.1},
    "fresh-6-epochs-wd1": {"init": "fresh", "epochs": 6, "lr": 0.001, "weight_decay": 1.0},
    "eagle3": {"method": "eagle3"},
    "eagle3.1": {"method": "eagle3.1", "eagle3_1": {"fc_norm": True, "norm_output": True}},
    "eagle3.1-fc_norm": {"method": "eagle3.1", "eagle3_1": {"fc_norm": True, "norm_output": False}},
    "eagle3.1-norm_output": {"method": "eagle3.1", "eagle3_1": {"fc_norm": False, "norm_output": True}},
    "peagle": {"method": "peagle"},
    "dflash": {"method": "dflash"},
}


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True)
@click.option("--hidden", "hidden_folder", default="data/hidden", show_default=True)
@click.option("--decoded", default="data/decoded", show_default=True, help="What evaluate decoded, per benchmark.")
@click.option(
    "--point",
    "points",
    multiple=True,
    type=click.Choice(list(POINTS)),
    help="A point to run (repeatable); all of them by default.",
)
@click.option("--list", "list_points", is_flag=True, help="List the points and exit.")
@click.option("--results", "results_file", default=str(ROOT / "results" / "components.jsonl"), show_default=True)
@click.option("--no-results", is_flag=True, help="Print only.")
@click.option("--keep", type=click.Path(file_okay=False), help="Save each point's drafter in KEEP/<point>.")
def main(params, hidden_folder, decoded, points, list_points, results_file, no_results, keep):
    if list_points:
        for name, overrides in POINTS.items():
            click.echo(f"{name}: {overrides}")
        return
    cfg = config.load(params)
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    tokenizer, model = target.load_tokenizer(folder), target.load_model(folder)
    sets, stops, p = decoded_sets(decoded), target.stop_ids(folder, tokenizer), cfg.evaluate
    rows = []
    for name in points or POINTS:
        start = time.perf_counter()
        recipe = config.Train.model_validate({**cfg.train.model_dump(), **POINTS[name]})
        with tempfile.TemporaryDirectory() as ckpt:
            drafter, report, _ = train.run(hidden_folder, folder, recipe, ckpt)
        if keep:
            draft.save(drafter, Path(keep) / name)
        seconds = time.perf_counter() - start
        torch.set_num_threads(p.threads or torch.get_num_threads())
        valid = [report["valid"][f"acc_{k}"] for k in range(cfg.train.ttt_steps)]
        rows.append(
            (name, valid, acceptances(model, speculative.drafter_for(drafter, p.num_steps), sets, stops, p), seconds)
        )
        print(f"{name}: valid acc {valid}, acceptance length {rows[-1][2]}, trained in {seconds:.0f} s", flush=True)
    baseline = ngram(sets, stops, p)
    print_table(
        sets,
        ["recipe", "valid acc per step"],
        ["train s"],
        [
            ([f"{name} {POINTS[name]}", ", ".join(f"{a:.3f}" for a in valid)], lengths, [f"{seconds:.0f}"])
            for name, valid, lengths, seconds in rows
        ],
        baseline,
    )
    if not no_results:
        record(rows, baseline, Path(params), Path(results_file))


def record(rows: list, baseline: dict, params: Path, results_file: Path) -> None:
    """Each point's acceptance length per benchmark (± its standard error over turns), its difference from the first
    point's (paired), its validation accuracy per TTT step, and the n-gram baseline's lengths, as one record of the
    results file."""
    values = {}
    first = rows[0][2]
    for name, valid, lengths, _ in rows:
        for benchmark, turns in lengths.items():
            values[f"{name}: τ {benchmark}"] = turns_value(turns)
            if lengths is not first:
                d, se = turns.difference(first[benchmark])
                values[f"{name}: Δ τ {benchmark}"] = Value(value=round(d, 4), se=None if se is None else round(se, 4))
        for k, acc in enumerate(valid):
            values[f"{name}: valid acc {k}"] = Value(value=round(acc, 4))
    for benchmark, turns in baseline.items():
        values[f"n-gram: τ {benchmark}"] = turns_value(turns)
    command = " ".join(["python bench/bench_recipes.py", *sys.argv[1:]])
    results.append(provenance.stamp(RECIPES, values, command, params), results_file)


def turns_value(turns) -> Value:
    return Value(value=round(turns.length, 4), se=turns.se)


if __name__ == "__main__":
    main()
