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
from pathlib import Path

import click
import torch
from harness import acceptances, decoded_sets, ngram, print_table

from eaglepipe.core import config, runtime
from eaglepipe.drafter import train
from eaglepipe.evaluate import decode as speculative
from eaglepipe.hidden import extract as hidden
from eaglepipe.hidden import layout as features
from eaglepipe.target import model as target


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True)
@click.option("--sequences", default="data/sequences", show_default=True, help="merge's sequences.")
@click.option("--decoded", default="data/decoded", show_default=True, help="What evaluate decoded, per benchmark.")
@click.option("--epochs", type=int, default=None, help="train.epochs for both runs [default: params.yaml's].")
def main(params, sequences, decoded, epochs):
    cfg = config.load(params)
    p = cfg.train.model_copy(update={"epochs": epochs or cfg.train.epochs})
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    rt = runtime.Runtime()
    states_model = target.load_states_target(folder, cfg.hidden.compute_dtype, rt)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        hidden.run(sequences, tmp / "hidden", states_model, cfg.hidden, target.fingerprint(folder), tmp / "cache")
        hidden_s = time.perf_counter() - start
        print(f"hidden: {hidden_s:.0f} s", flush=True)
        for name, feats in (
            ("offline", features.Stored(tmp / "hidden")),
            ("online", train.Online(sequences, states_model, cfg.hidden)),
        ):
            start = time.perf_counter()
            drafter, report, _ = train.run(feats, folder, p, tmp / f"ckpt-{name}")
            runs[name] = (drafter, report, time.perf_counter() - start)
            print(f"train {name}: {runs[name][2]:.0f} s, valid {report['valid']}", flush=True)

    e = cfg.evaluate
    torch.set_num_threads(e.threads or torch.get_num_threads())
    model, tokenizer = target.load_model(folder), target.load_tokenizer(folder)
    sets, stops = decoded_sets(decoded), target.stop_ids(folder, tokenizer)
    lengths = {
        name: acceptances(model, speculative.EagleDrafter(drafter), sets, stops, e)
        for name, (drafter, _, _) in runs.items()
    }

    tokens = runs["offline"][1]["train_tokens"] * p.epochs
    seconds = {"offline": hidden_s + runs["offline"][2], "online": runs["online"][2]}
    print(f"\n{runs['offline'][1]['train_tokens']} trained tokens x {p.epochs} epochs")
    print_table(
        sets,
        ["features", "seconds", "trained tokens/s"],
        [],
        [
            (
                [
                    name,
                    f"{seconds[name]:.0f}"
                    + (f" (hidden {hidden_s:.0f} + train {runs[name][2]:.0f})" if name == "offline" else ""),
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


if __name__ == "__main__":
    main()
