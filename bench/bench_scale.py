"""Benchmark: how the drafter's acceptance length grows with its training data, all sizes in one run.

    python bench/bench_scale.py [--answers 1,2,3] [--half-prompts]

Trains the drafter with the train params of params.yaml on part of data/hidden -- the first k answers to every
prompt, for each k of --answers (and, with --half-prompts, one answer to half of the prompts) -- and measures each
drafter's acceptance length on the held-out prompts (the evaluate params, EAGLE only), then the n-gram baseline's
once. The validation split is the same for every size. Prints one row per size and the baseline.
"""
import tempfile
import time

import click
import torch

from eaglepipe import benchmarks, chat, config, speculative, target, train
from eaglepipe.records import prompt_of, sample_of


def acceptance(model, drafter, prompts, stops, p) -> float:
    stats = speculative.Stats()
    for ids in prompts:
        speculative.speculative(model, drafter, ids, p.max_new_tokens, stops, p.num_steps, stats)
    return stats.acceptance_length


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True)
@click.option("--hidden", "hidden_folder", default="data/hidden", show_default=True)
@click.option("--prompts", "prompts_path", default="data/eval/heldout.jsonl", show_default=True)
@click.option("--answers", default="1,2,3", show_default=True, help="Answers per prompt to train on, one size each.")
@click.option("--half-prompts", is_flag=True, help="Add a size: one answer to half of the prompts.")
def main(params, hidden_folder, prompts_path, answers, half_prompts):
    cfg = config.load(params)
    folder = target.resolve(cfg.target.model)
    tokenizer, model = target.load_tokenizer(folder), target.load_model(folder)
    p = cfg.evaluate
    prompts = [chat.prompt_ids(tokenizer, c.messages, c.tools, cfg.target.chat_template_kwargs)
               for c in benchmarks.heldout(prompts_path)]
    stops = target.stop_ids(folder, tokenizer)
    sizes = [("1 answer, half the prompts", lambda rid: sample_of(rid) == 0 and
              int(prompt_of(rid), 16) % 2 == 0)] if half_prompts else []
    sizes += [(f"{k} answer{'s' if k > 1 else ''} per prompt", lambda rid, k=k: sample_of(rid) < k)
              for k in map(int, answers.split(","))]
    rows = []
    for name, keep in sizes:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as ckpt:
            drafter, report, _ = train.run(hidden_folder, folder, cfg.train, ckpt, keep=keep)
        seconds = time.perf_counter() - start
        torch.set_num_threads(p.threads or torch.get_num_threads())
        length = acceptance(model, speculative.EagleDrafter(drafter), prompts, stops, p)
        rows.append((name, report["train_samples"], report["train_tokens"], report["valid"]["acc_0"], length,
                     seconds))
        print(f"{name}: {rows[-1][1]} samples, {rows[-1][2]} tokens, valid acc_0 {rows[-1][3]}, "
              f"acceptance length {length:.3f}, trained in {seconds:.0f} s", flush=True)
    baseline = acceptance(model, speculative.NgramDrafter(p.ngram.max, p.ngram.min), prompts, stops, p)
    print("\n| training data | samples | tokens | valid acc_0 | acceptance length | train s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, samples, tokens, acc, length, seconds in rows:
        print(f"| {name} | {samples} | {tokens} | {acc:.3f} | {length:.3f} | {seconds:.0f} |")
    print(f"| n-gram baseline (no training) | | | | {baseline:.3f} | |")


if __name__ == "__main__":
    main()
