"""Benchmark: the infer stage's tokens/s against a bare ``model.generate`` loop, same prompts, same batch size.

    python bench/bench_infer.py [--prompts data/prompts/prompts.jsonl] [--n 64] [--batch-size 16]

Both sides decode greedily with the same stop ids and max_new_tokens; both count the tokens up to and including
the first stop token of each row. Prints both throughputs and their ratio (the goal is >= 0.9).
"""

import tempfile
import time
from pathlib import Path

import click
import torch

from eaglepipe.core import config
from eaglepipe.core.records import read_prompts
from eaglepipe.engines import Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import Gates
from eaglepipe.infer.run import InferRun, Plan
from eaglepipe.target import chat
from eaglepipe.target import model as target
from eaglepipe.text import derive


def bare_loop(model, tokenizer, ids, batch_size, max_new_tokens, stops) -> tuple[int, float]:
    tokens, start = 0, time.perf_counter()
    for b in range(0, len(ids), batch_size):
        batch = ids[b : b + batch_size]
        enc = tokenizer.pad({"input_ids": batch}, padding_side="left", return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
            )
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            tokens += next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
    return tokens, time.perf_counter() - start


@click.command(help=__doc__)
@click.option("--prompts", default="data/prompts/prompts.jsonl", show_default=True)
@click.option("--n", default=64, show_default=True, help="Number of prompts.")
@click.option("--batch-size", default=16, show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True)
def main(prompts, n, batch_size, max_new_tokens):
    folder = target.resolve("embedded")
    tokenizer, model = target.load_tokenizer(folder), target.load_model(folder)
    ps = read_prompts(prompts)[:n]
    stops = target.stop_ids(folder, tokenizer)
    ids = [chat.prompt_ids(tokenizer, p.messages, p.tools) for p in ps]
    bare_tokens, bare_s = bare_loop(model, tokenizer, ids, batch_size, max_new_tokens, stops)

    sampling = Sampling(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stops))
    gates = Gates(config.Gates(warmup=1, every=1, min_reasoning=0, max_truncated=1, max_empty=1), False)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        responses, _ = InferRun(
            HFEngine(model, tokenizer.pad_token_id, batch_size),
            tokenizer,
            sampling,
            derive.spec_from_params("none"),
            gates,
            Cache(Path(cache)),
            Plan({}),
        ).run(ps)
        stage_s = time.perf_counter() - start
    stage_tokens = sum(len(r.output_ids) for r in responses)
    print(f"prompts {len(ps)}, batch size {batch_size}, max_new_tokens {max_new_tokens}")
    print(f"bare model.generate: {bare_tokens} tokens in {bare_s:.1f} s = {bare_tokens / bare_s:.1f} tokens/s")
    print(f"infer stage:         {stage_tokens} tokens in {stage_s:.1f} s = {stage_tokens / stage_s:.1f} tokens/s")
    print(f"ratio (stage / bare): {(stage_tokens / stage_s) / (bare_tokens / bare_s):.2f}")


if __name__ == "__main__":
    main()
