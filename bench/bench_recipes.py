"""Benchmark: training recipes on the same data, each drafter's acceptance length on every benchmark.

    python bench/bench_recipes.py [--point NAME ...] [--list]

Each point is the train params of params.yaml with a few keys changed (POINTS below). For each point the drafter
is trained on data/hidden in this process (what the train stage computes for those params) and its acceptance length
(the evaluate params, EAGLE only) measured on every turn evaluate decoded (data/decoded/<benchmark>.jsonl); the
n-gram baseline's once. Prints one row per point: validation acc per TTT step, acceptance per benchmark, train seconds.
"""

import tempfile
import time

import click
import torch
from harness import acceptances, decoded_sets, ngram, print_table

from eaglepipe.core import config
from eaglepipe.drafter import train
from eaglepipe.evaluate import decode as speculative
from eaglepipe.target import model as target

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
def main(params, hidden_folder, decoded, points, list_points):
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
        with tempfile.TemporaryDirectory() as ckpt:
            drafter, report, _ = train.run(hidden_folder, folder, cfg.train.model_copy(update=POINTS[name]), ckpt)
        seconds = time.perf_counter() - start
        torch.set_num_threads(p.threads or torch.get_num_threads())
        valid = [report["valid"][f"acc_{k}"] for k in range(cfg.train.ttt_steps)]
        rows.append((name, valid, acceptances(model, speculative.EagleDrafter(drafter), sets, stops, p), seconds))
        print(f"{name}: valid acc {valid}, acceptance length {rows[-1][2]}, trained in {seconds:.0f} s", flush=True)
    print_table(
        sets,
        ["recipe", "valid acc per step"],
        ["train s"],
        [
            ([f"{name} {POINTS[name]}", ", ".join(f"{a:.3f}" for a in valid)], lengths, [f"{seconds:.0f}"])
            for name, valid, lengths, seconds in rows
        ],
        ngram(sets, stops, p),
    )


if __name__ == "__main__":
    main()
