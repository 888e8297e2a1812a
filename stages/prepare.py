"""prepare: mix the prompt sources of `prepare.sources` into one prompts file (quotas, de-duplication, seeded
sampling: eaglepipe/dataset/prepare.py), benchmark prompts kept out, every record read, skipped or chosen counted."""

import logging

import click

from eaglepipe.core import cli
from eaglepipe.core.records import write_jsonl
from eaglepipe.dataset import benchmarks, prepare


@click.command(help=__doc__)
@click.option("--params", required=True, type=click.Path(dir_okay=False), help="params.yaml (section prepare).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Prompt records (JSON Lines).")
@click.option(
    "--report",
    required=True,
    type=click.Path(dir_okay=False),
    help="Counts per source: read, valid, skipped by reason, left out and changed by each conversation "
    "rule, duplicates, selected (DVC metrics).",
)
@click.option(
    "--heldout",
    type=click.Path(dir_okay=False, exists=True),
    help="The held-out prompts evaluate decodes (kept out of training with MT-bench and HumanEval).",
)
@cli.timings
@cli.stage
def main(params, out, report, heldout, timings):
    cfg = cli.params(params)
    excluded = benchmarks.excluded_texts(heldout) if cfg.prepare.exclude_benchmarks else set()
    prompts, counts = prepare.prepare(cfg.prepare, excluded)
    write_jsonl(out, prompts)
    cli.publish(counts, report, timings)
    logging.getLogger("prepare").info("wrote %d prompts to %s\n%s", len(prompts), out, prepare.summary(counts))


if __name__ == "__main__":
    main()
