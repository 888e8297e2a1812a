"""Benchmark: online training (the frozen target computing each batch's states inside the trainer) against the
offline way (hidden stores the states, train reads them), on the same sequences and params.

    python bench/bench_online.py [--epochs N]

In one process, one after the other, with params.yaml's hidden and train params (``--epochs`` overrides
train.epochs): hidden computes the states of data/sequences into a temporary folder with an empty cache, train trains
on them (offline), then train trains with the target inside (online). Prints each run's seconds and trained tokens
per second (offline: over hidden's seconds plus train's), both drafters' acceptance length on every turn evaluate
decoded (data/decoded/<benchmark>.jsonl, evaluate's params, EAGLE only), their largest difference, and the n-gram
baseline's.
"""

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import torch
from harness import acceptances, decoded_sets, ngram, print_table

from eaglepipe.core import config, runtime
from eaglepipe.drafter import sources, train
from eaglepipe.evaluate import decode
from eaglepipe.hidden import extract, layout
from eaglepipe.target import model as target


@dataclass
class Run:
    """One training run: its drafter, train.run's report and its seconds."""

    drafter: object
    report: dict
    seconds: float


def train_both(cfg, p, folder, sequences, states_model) -> tuple[dict[str, Run], float]:
    """({"offline": Run, "online": Run}, hidden's seconds): hidden into a temporary folder with an empty cache, train
    on what it stored, then train with ``states_model`` computing the states."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        extract.run(sequences, tmp / "hidden", states_model, cfg.hidden, target.fingerprint(folder), tmp / "cache")
        hidden_s = time.perf_counter() - start
        print(f"hidden: {hidden_s:.0f} s", flush=True)
        for name, feats in (
            ("offline", layout.Stored(tmp / "hidden")),
            ("online", sources.Online(sequences, states_model, cfg.hidden)),
        ):
            start = time.perf_counter()
            drafter, report, _ = train.run(feats, folder, p, tmp / f"ckpt-{name}")
            runs[name] = Run(drafter, report, time.perf_counter() - start)
            print(f"train {name}: {runs[name].seconds:.0f} s, valid {report['valid']}", flush=True)
    return runs, hidden_s


def print_results(runs: dict[str, Run], hidden_s: float, epochs: int, sets, stops, e, lengths) -> None:
    """Each run's seconds and trained tokens per second (offline: hidden's seconds plus train's), its acceptance
    ``lengths`` per benchmark, the n-gram baseline's, and the largest difference between the two runs."""
    tokens = runs["offline"].report["train_tokens"] * epochs
    seconds = {"offline": hidden_s + runs["offline"].seconds, "online": runs["online"].seconds}
    print(f"\n{runs['offline'].report['train_tokens']} trained tokens x {epochs} epochs")
    print_table(
        sets,
        ["features", "seconds", "trained tokens/s"],
        [],
        [
            (
                [
                    name,
                    f"{seconds[name]:.0f}"
                    + (f" (hidden {hidden_s:.0f} + train {runs[name].seconds:.0f})" if name == "offline" else ""),
                    f"{tokens / seconds[name]:.0f}",
                ],
                lengths[name],
                [],
            )
            for name in runs
        ],
        ngram(sets, stops, e),
    )
    gap = max(abs(lengths["online"][b].length - lengths["offline"][b].length) for b in sets)
    print(
        f"\nonline / offline tokens/s: {seconds['offline'] / seconds['online']:.2f}; "
        f"largest acceptance difference: {gap:.3f}"
    )


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True)
@click.option("--sequences", default="data/sequences", show_default=True, help="merge's sequences.")
@click.option("--decoded", default="data/decoded", show_default=True, help="What evaluate decoded, per benchmark.")
@click.option("--epochs", type=int, default=None, help="train.epochs for both runs [default: params.yaml's].")
def main(params, sequences, decoded, epochs):
    cfg = config.load(params)
    p = cfg.train.model_copy(update={"epochs": epochs or cfg.train.epochs})
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    states_model = target.load_states_target(folder, cfg.hidden.compute_dtype, runtime.Runtime())
    runs, hidden_s = train_both(cfg, p, folder, sequences, states_model)
    e = cfg.evaluate
    torch.set_num_threads(e.threads or torch.get_num_threads())
    model, tokenizer = target.load_model(folder), target.load_tokenizer(folder)
    sets, stops = decoded_sets(decoded), target.stop_ids(folder, tokenizer)
    lengths = {name: acceptances(model, decode.EagleDrafter(r.drafter), sets, stops, e) for name, r in runs.items()}
    print_results(runs, hidden_s, p.epochs, sets, stops, e, lengths)


if __name__ == "__main__":
    main()
