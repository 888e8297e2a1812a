"""Benchmark: the train stage's tokens/s against bare forward+backward steps of the drafter on the same batches.

    python bench/bench_train.py [--hidden data/hidden] [--params params.yaml] [--epochs N]

Train side: ``train.run`` from scratch, timed whole (loading the shards, setting up the drafter, batching, target
distributions, metrics, validation, checkpoints). Bare side: the same drafter (same seed and init) on the same
batches, each collated just before its step (as in train.run, so its data is as fresh in the caches) but timing only
TTT forward + loss, backward, clipping and the AdamW step. Both count the tokens of the training batches. Prints both
throughputs and their ratio (the goal is >= 0.85).
"""

import tempfile
import time

import click
import torch

from eaglepipe.core import config
from eaglepipe.dataset import sequences
from eaglepipe.drafter import train
from eaglepipe.drafter.eagle3 import ttt
from eaglepipe.hidden import layout
from eaglepipe.target import model as target


def bare_steps(hidden_folder, folder, p) -> tuple[int, float]:
    steps, p = p.ttt_steps, train.resolved(p, torch.device("cpu"))
    model, train_set, _, head_draft, _ = train.setup(hidden_folder, folder, p)
    lengths = [s.ids.shape[0] for s in train_set]
    opt = train.optimizer(model, p)
    model.train()
    tokens, seconds = 0, 0.0
    for e in range(p.epochs):
        for idx in sequences.plan_batches(lengths, p.batch_tokens, p.seed, e):
            rows = [train_set[i] for i in idx]
            batch = ttt.collate(rows, layout.read_states(rows), steps, head_draft, model.t2d)  # not timed
            start = time.perf_counter()
            with train.autocast(train.uses_bf16(p), head_draft.device):  # as train.run
                loss, _ = ttt.ttt_forward(model, batch, steps, p.step_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), p.grad_clip)
            opt.step()
            seconds += time.perf_counter() - start
            tokens += sum(lengths[i] for i in idx)
    return tokens, seconds


@click.command(help=__doc__)
@click.option("--hidden", "hidden_folder", default="data/hidden", show_default=True)
@click.option("--params", default="params.yaml", show_default=True)
@click.option("--epochs", default=None, type=int, help="Epochs on each side [default: params train.epochs].")
def main(hidden_folder, params, epochs):
    cfg = config.load(params)
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    p = cfg.train.model_copy(update={"epochs": epochs or cfg.train.epochs})
    if p.threads:  # as train.run does
        torch.set_num_threads(p.threads)
    bare_tokens, bare_s = bare_steps(hidden_folder, folder, p)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        _, report, _ = train.run(hidden_folder, folder, p, tmp)
        train_s = time.perf_counter() - start
    bare, full = bare_tokens / bare_s, bare_tokens / train_s
    print(f"tokens: {bare_tokens} in {p.epochs} epochs, {report['steps']} batches")
    print(f"bare forward+backward steps: {bare:.1f} tokens/s ({bare_s:.1f} s)")
    print(f"train stage (train.run):     {full:.1f} tokens/s ({train_s:.1f} s)")
    print(f"ratio: {full / bare:.3f}")


if __name__ == "__main__":
    main()
