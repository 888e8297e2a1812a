"""What every stage script shares: logging, the validated params, user errors as one line, the reports."""

from __future__ import annotations

import functools
import logging
import resource
import sys

import click

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import write_json

timings = click.option(
    "--timings",
    required=True,
    type=click.Path(dir_okay=False),
    help="This run's seconds, speed and peak memory (metrics/timings, not in git; see publish).",
)


def cache(stage_name: str):
    """The option of a stage that keeps resumable work folders, one per fingerprint, under ``config.CACHE``."""
    return click.option(
        "--cache",
        default=str(config.CACHE / stage_name),
        show_default=True,
        type=click.Path(file_okay=False),
        help="Folder of resumable work folders, one per fingerprint.",
    )


def stage(fn):
    """Decorate a stage's click command body: plain logging, and a ``UserError`` (or a missing file) ends the stage
    as one line naming its cause, with exit code 1."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            raise click.ClickException(str(e)) from None
        except FileNotFoundError as e:
            raise click.ClickException(f"{e.filename}: no such file") from None

    return run


def params(path) -> config.Params:
    """The params file, validated whole before anything is loaded."""
    return config.load(path)


def publish(report: dict, metrics, timings) -> None:
    """Write a stage's report to ``metrics`` (DVC metrics, in git), but its ``run`` part (what changes with every
    run: seconds, tokens/s, what was computed or reused), with the peak resident memory and, where CUDA was used, the
    busiest GPU's peak memory allocated by torch, to ``timings`` (not in git)."""
    report = dict(report)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    run = {**report.pop("run", {}), "peak_rss_mb": round(peak_kib / 1024, 1)}
    torch = sys.modules.get("torch")  # a stage that never imported torch (prepare does not) used no GPU
    if torch is not None and torch.cuda.is_initialized():
        run["peak_gpu_mb"] = round(
            max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) / 2**20, 1
        )
    write_json(timings, run)
    write_json(metrics, report)
