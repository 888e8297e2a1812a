"""Benchmark: online training (the frozen target inside the trainer) against hidden plus offline training.

    python bench/bench_online.py [--params params.yaml] [--sequences data/sequences] [--decoded data/decoded]

On the sequences merge wrote (the default data), in one process with the train params' threads: the hidden pass
from an empty store into a temporary folder (what offline training pays first), offline training on its shards,
and online training on the sequences themselves (train.features: online, the states computed per batch as hidden
computes them); each timed. Then both drafters' acceptance length (the evaluate params) on every turn evaluate
decoded (data/decoded/<benchmark>.jsonl). Prints seconds and trained tokens/s of each way, validation acc_0, and the
acceptance per benchmark with the largest difference between the two drafters.
"""
import tempfile
import time
from pathlib import Path

import click
import torch

from eaglepipe import config, hidden, runtime, speculative, target, train
from harness import acceptances, decoded_sets


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
@click.option("--sequences", default="data/sequences", show_default=True, type=click.Path(file_okay=False))
@click.option("--decoded", default="data/decoded", show_default=True, help="What evaluate decoded, per benchmark.")
def main(params, sequences, decoded):
    cfg = config.load(params)
    folder = target.resolve(cfg.target.model)
    tokenizer = target.load_tokenizer(folder)
    rt = runtime.Runtime()
    model = runtime.load_target(folder, runtime.compute_dtype(cfg.hidden.compute_dtype, rt.device), rt)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seconds, drafters, reports = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        hidden.run(sequences, tmp / "hidden", model, cfg.hidden, target.fingerprint(folder), tmp / "store", rt)
        seconds["hidden"] = time.perf_counter() - start
        for way, feats in (("offline", train.Stored(tmp / "hidden")),
                           ("online", train.Online(sequences, model, cfg.hidden))):
            start = time.perf_counter()
            drafters[way], reports[way], _ = train.run(feats, folder, cfg.train, tmp / f"checkpoints-{way}", rt=rt)
            seconds[way] = time.perf_counter() - start
            print(f"{way}: {seconds[way]:.0f} s, valid {reports[way]['valid']}", flush=True)
    sets, stops = decoded_sets(decoded), target.stop_ids(folder, tokenizer)
    lengths = {way: acceptances(model, speculative.EagleDrafter(d), sets, stops, cfg.evaluate)
               for way, d in drafters.items()}
    tokens = reports["offline"]["train_tokens"] * cfg.train.epochs
    total = {"offline": seconds["hidden"] + seconds["offline"], "online": seconds["online"]}
    print(f"\n{reports['offline']['train_tokens']} trained tokens x {cfg.train.epochs} epochs; acceptance length on "
          f"the turns evaluate decoded ({', '.join(f'{b} {len(v)}' for b, v in sets.items())})")
    print("| training | seconds | trained tokens/s | valid acc_0 | " + " | ".join(sets) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(sets))
    for way, what in (("offline", f"hidden ({seconds['hidden']:.0f} s) + offline train ({seconds['offline']:.0f} s)"),
                      ("online", "online train")):
        print(f"| {what} | {total[way]:.0f} | {tokens / total[way]:.1f} | {reports[way]['valid']['acc_0']:.4f} | "
              + " | ".join(f"{v:.4f}" for v in lengths[way].values()) + " |")
    diff = max(abs(lengths["online"][b] - lengths["offline"][b]) for b in sets)
    print(f"online / (hidden + offline) tokens/s: {total['offline'] / total['online']:.3f}; largest acceptance "
          f"difference {diff:.4f}")


if __name__ == "__main__":
    main()
