"""Benchmark: the hidden stage's extraction speed against a bare forward pass of the target with
``output_hidden_states=True`` on the same sequences and the same batches (tokens/s counts real tokens, not padding).

    python bench/bench_hidden.py [--sequences data/sequences] [--samples 48] [--repeats 3] [--vllm]

Without a sequences folder it uses random sequences with lengths like the merged data (40..400 tokens). Each
measurement is repeated and the best time kept (the machine is shared); the methods alternate within a repeat.
Prints tokens/s of both and their ratio (hidden / bare; the goal is at least 0.85), and a ratio against the decoder
stack alone (no lm_head) with output_hidden_states=True: hidden runs lm_head too (on the real rows, for ``top``).
With ``--vllm``, also ``hidden.engine: vllm``'s extraction of the same sequences (a vLLM server from .venv-vllm,
started once before the timing and not timed, ``--concurrency`` requests in flight, its prefix cache off: each
repeat sends the same sequences, which it would otherwise serve from the cache) and its ratio to the hf engine's.
"""

import contextlib
import json
import time
from pathlib import Path

import click
import numpy as np
import torch

from eaglepipe.core import config
from eaglepipe.dataset import sequences
from eaglepipe.hidden import extract as hidden
from eaglepipe.hidden import hf_source
from eaglepipe.hidden import layout as features
from eaglepipe.hidden import vllm_source as states
from eaglepipe.target import model as target


def load_samples(folder, n, seed):
    if folder and (Path(folder) / "index.json").exists():
        items = [(rid, ids, mask) for rid, _s, ids, mask in sequences.read(folder, "train")]
        return items[:n], f"{folder} (train, first {min(n, len(items))})"
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        length = int(rng.integers(40, 401))
        items.append((str(i), rng.integers(3, 40000, length).astype(np.int32), np.ones(length, np.uint8)))
    return items, f"{n} random sequences, 40..400 tokens"


@torch.inference_mode()
def bare(model, samples, batch_tokens, base_only):
    """The same batches through a bare forward with all hidden states (full model, or the decoder stack only)."""
    lengths = [len(s[1]) for s in samples]
    fwd = hf_source.base_model(model) if base_only else model
    for batch in sequences.plan_batches(lengths, batch_tokens):
        width = lengths[batch[0]]
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.as_tensor(samples[i][1])
        fwd(input_ids=ids, output_hidden_states=True, use_cache=False)


@click.command(help=__doc__)
@click.option(
    "--sequences",
    default="data/sequences",
    show_default=True,
    help="Merged sequences to read (random ones when the folder has no index.json).",
)
@click.option("--samples", default=48, show_default=True, help="Sequences measured.")
@click.option("--repeats", default=3, show_default=True, help="Repeats per method; the best time is kept.")
@click.option("--batch-tokens", default=4096, show_default=True, help="As hidden.batch_tokens.")
@click.option("--model", default="embedded", show_default=True, help="As target.model.")
@click.option("--threads", default=0, show_default=True, help="torch threads (0 = torch's default).")
@click.option("--vllm", "with_vllm", is_flag=True, help="Also time hidden.engine: vllm (a launched vLLM server).")
@click.option("--concurrency", default=16, show_default=True, help="vLLM requests in flight (hidden.vllm).")
def main(sequences, samples, repeats, batch_tokens, model, threads, with_vllm, concurrency):
    if threads:
        torch.set_num_threads(threads)
    folder = target.resolve(model)
    model = target.load_model(folder)
    layers = features.layer_ids("auto", model.config.num_hidden_layers)
    items, what = load_samples(sequences, samples, 0)
    tokens = sum(len(s[1]) for s in items)
    runs = {
        "hidden": lambda: hidden.extract_shard(model, items, layers, batch_tokens, "bfloat16"),
        "bare_forward": lambda: bare(model, items, batch_tokens, base_only=False),
        "bare_decoder_stack": lambda: bare(model, items, batch_tokens, base_only=True),
    }
    with contextlib.ExitStack() as stack:
        if with_vllm:
            p = config.Hidden(
                engine="vllm",
                vllm=config.Servers(
                    concurrency=concurrency,
                    launch=config.Launch(port=30011, extra_args=["--enforce-eager", "--no-enable-prefix-caching"]),
                ),
            )
            source = stack.enter_context(
                states.VLLMStates(
                    folder,
                    p,
                    "float32",  # as the hf model above
                    config.CACHE / "bench-hidden",
                )
            )
            runs["hidden_vllm"] = lambda: hidden.extract_shard(source, items, layers, batch_tokens, "bfloat16")
        for fn in runs.values():  # warm-up (and the server's start)
            fn()
        best = {k: float("inf") for k in runs}
        for _ in range(repeats):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    speed = {k: tokens / v for k, v in best.items()}
    result = {
        "data": what,
        "tokens": tokens,
        "batch_tokens": batch_tokens,
        "threads": torch.get_num_threads(),
        "tokens_per_s": {k: round(v, 1) for k, v in speed.items()},
        "ratio_vs_bare_forward": round(speed["hidden"] / speed["bare_forward"], 3),
        "ratio_vs_bare_decoder_stack": round(speed["hidden"] / speed["bare_decoder_stack"], 3),
    }
    if with_vllm:
        result["ratio_vllm_vs_hf"] = round(speed["hidden_vllm"] / speed["hidden"], 3)
    print(json.dumps(result, indent=2))
    ok = result["ratio_vs_bare_forward"] >= 0.85
    print(
        f"hidden: {speed['hidden']:.0f} tokens/s, bare forward with output_hidden_states: "
        f"{speed['bare_forward']:.0f} tokens/s, ratio {result['ratio_vs_bare_forward']:.3f} "
        f"({'>=' if ok else '<'} 0.85)"
    )


if __name__ == "__main__":
    main()
