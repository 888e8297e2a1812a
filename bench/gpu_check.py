"""The GPU check (`make gpu-check`): the default pipeline end to end on CUDA, each stage's tokens/s and peak memory.

    python bench/gpu_check.py [--params params.yaml] [--device cuda] [--nproc N] [--keep DIR]

Runs the stages prepare, infer, merge, hidden, train and evaluate as dvc.yaml runs them, on params.yaml with
``runtime.device`` set to --device and ``infer.engine`` to hf (the in-process engine: a GPU machine needs no vLLM or
SGLang for it), into a work folder with empty caches of its own (a first run, nothing reused; the project's data,
models and .cache are not touched). hidden, train and evaluate run under torchrun with
--nproc processes, one GPU each (default: every GPU torch sees). The serve stage is left out: it needs a vLLM
built for CUDA (`.venv-vllm` holds the CPU build). At the end it prints one row per stage: seconds, tokens/s, peak
GPU memory (torch's peak allocation on the stage's busiest GPU, rank 0's) and peak resident memory, from the stages'
timings files, and evaluate's acceptance lengths. ``--device cpu`` runs the same check on the CPU (the tests do, with
tiny params), without the GPU column.
"""

import json
import subprocess
import tempfile
import time
from pathlib import Path

import click
import torch
import yaml
from harness import STAGES, distributed, env, params_for, stage_commands


def speed(timing: dict) -> str:
    """A stage's tokens/s as its timings file reports it (evaluate: EAGLE decoding's, per benchmark)."""
    if "benchmarks" in timing:
        return "; ".join(f"{name} {b['eagle_tokens_per_s']}" for name, b in timing["benchmarks"].items())
    value = timing.get("tokens_per_s")
    return "" if value is None else str(value)


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
@click.option("--device", default="cuda", show_default=True, help="runtime.device of every stage.")
@click.option(
    "--nproc",
    default=None,
    type=int,
    help="Processes for hidden, train and evaluate [default: every GPU torch sees; 1 on the CPU].",
)
@click.option(
    "--keep",
    default=None,
    type=click.Path(file_okay=False),
    help="Work folder to keep (outputs, caches, timings) [default: a temporary one, removed].",
)
def main(params, device, nproc, keep):
    if device != "cpu" and not torch.cuda.is_available():
        raise click.ClickException(
            f"--device {device}: torch {torch.__version__} sees no CUDA device (this check is "
            "for a GPU machine; --device cpu runs it on the CPU)"
        )
    nproc = nproc or (torch.cuda.device_count() if device != "cpu" else 1)
    base = yaml.safe_load(Path(params).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "params.yaml").write_text(
            yaml.safe_dump(params_for(base, {"runtime.device": device, "infer.engine": "hf"}), sort_keys=False)
        )
        rows, commands = [], stage_commands(work, STAGES)
        for stage, cmd in commands.items():  # EAGLEPIPE_NPROC: torchrun for the stages started through runtime
            click.echo(f"== {stage}: {' '.join(cmd)}", err=True)
            start = time.perf_counter()
            if subprocess.run(cmd, env=env(cache=work / "cache", EAGLEPIPE_NPROC=str(nproc))).returncode:
                raise click.ClickException(f"stage {stage} failed (its log is above)")
            seconds = time.perf_counter() - start
            timing_file = work / "metrics" / "timings" / f"{stage}.json"
            timing = json.loads(timing_file.read_text()) if timing_file.exists() else {}
            rows.append((stage, seconds, timing))
        acceptance = {
            name: (b["acceptance_length"], b["baseline_acceptance_length"])
            for name, b in json.loads((work / "metrics" / "eval.json").read_text())["benchmarks"].items()
        }
    gpu = device != "cpu"
    click.echo(
        f"\ndevice {torch.cuda.get_device_name(0) if gpu else 'cpu'}, {nproc} process(es) for "
        f"{', '.join(distributed(commands))}; torch {torch.__version__}"
    )
    click.echo("| stage | seconds | tokens/s |" + (" peak GPU MB |" if gpu else "") + " peak RSS MB |")
    click.echo("|---|---:|---|" + ("---:|" if gpu else "") + "---:|")
    for stage, seconds, timing in rows:
        click.echo(
            f"| {stage} | {seconds:.1f} | {speed(timing)} |"
            + (f" {timing.get('peak_gpu_mb', '')} |" if gpu else "")
            + f" {timing.get('peak_rss_mb', '')} |"
        )
    click.echo(
        "acceptance length, EAGLE vs n-gram: "
        + ", ".join(f"{name} {a:.3f} vs {b:.3f}" for name, (a, b) in acceptance.items())
    )
    click.echo(f"total {sum(s for _, s, _ in rows) / 60:.1f} min")


if __name__ == "__main__":
    main()
