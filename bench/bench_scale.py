"""Benchmark: how the drafter's acceptance length grows with its training data, all sizes in one run.

    python bench/bench_scale.py [--answers 1,2,3] [--half-prompts]

Trains the drafter with the train params of params.yaml on part of data/hidden -- the first k answers to every
prompt, for each k of --answers (and, with --half-prompts, one answer to half of the prompts) -- and measures each
drafter's acceptance length (the evaluate params, EAGLE only) on every turn evaluate decoded, per benchmark
(data/decoded/<benchmark>.jsonl: each turn's prompt ids as evaluate built them, MT-bench's second turns after the
target's own greedy first answer), then the n-gram baseline's once. The validation split is the same for every
size. Prints one row per size and the baseline.
"""

import tempfile
import time

import click
import torch
from harness import acceptances, decoded_sets, ngram, print_table

from eaglepipe.core import config
from eaglepipe.core.records import prompt_of, sample_of
from eaglepipe.drafter import train
from eaglepipe.evaluate import decode as speculative
from eaglepipe.target import model as target


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True)
@click.option("--hidden", "hidden_folder", default="data/hidden", show_default=True)
@click.option("--decoded", default="data/decoded", show_default=True, help="What evaluate decoded, per benchmark.")
@click.option("--answers", default="1,2,3", show_default=True, help="Answers per prompt to train on, one size each.")
@click.option("--half-prompts", is_flag=True, help="Add a size: one answer to half of the prompts.")
def main(params, hidden_folder, decoded, answers, half_prompts):
    cfg = config.load(params)
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    tokenizer, model = target.load_tokenizer(folder), target.load_model(folder)
    p = cfg.evaluate
    sets = decoded_sets(decoded)
    stops = target.stop_ids(folder, tokenizer)
    sizes = (
        [("1 answer, half the prompts", lambda rid: sample_of(rid) == 0 and int(prompt_of(rid), 16) % 2 == 0)]
        if half_prompts
        else []
    )
    sizes += [
        (f"{k} answer{'s' if k > 1 else ''} per prompt", lambda rid, k=k: sample_of(rid) < k)
        for k in map(int, answers.split(","))
    ]
    rows = []
    for name, keep in sizes:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as ckpt:
            drafter, report, _ = train.run(hidden_folder, folder, cfg.train, ckpt, keep=keep)
        seconds = time.perf_counter() - start
        torch.set_num_threads(p.threads or torch.get_num_threads())
        lengths = acceptances(model, speculative.EagleDrafter(drafter), sets, stops, p)
        rows.append((name, report["train_samples"], report["train_tokens"], report["valid"]["acc_0"], lengths, seconds))
        print(
            f"{name}: {rows[-1][1]} samples, {rows[-1][2]} tokens, valid acc_0 {rows[-1][3]}, acceptance length "
            f"{ {b: str(v) for b, v in lengths.items()} }, trained in {seconds:.0f} s",
            flush=True,
        )
    print_table(
        sets,
        ["training data", "samples", "tokens", "valid acc_0"],
        ["train s"],
        [
            ([name, samples, tokens, f"{acc:.3f}"], lengths, [f"{seconds:.0f}"])
            for name, samples, tokens, acc, lengths, seconds in rows
        ],
        ngram(sets, stops, p),
    )


if __name__ == "__main__":
    main()
