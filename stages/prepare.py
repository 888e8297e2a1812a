"""prepare: mix the prompt sources of `prepare.sources` into one prompts file (quotas, de-duplication, seeded
sampling; the rules are in eaglepipe/prepare.py), and count every record read, skipped or chosen."""
import logging

import click

from eaglepipe import cli
from eaglepipe import prepare as lib
from eaglepipe.records import write_jsonl


@click.command(help=__doc__)
@click.option("--params", required=True, type=click.Path(dir_okay=False), help="params.yaml (section prepare).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Prompt records (JSON Lines).")
@click.option("--report", required=True, type=click.Path(dir_okay=False),
              help="Counts per source: read, valid, skipped by reason, left out and changed by each conversation "
                   "rule, duplicates, selected (DVC metrics).")
@cli.timings
@cli.stage
def main(params, out, report, timings):
    cfg = cli.params(params)
    prompts, counts = lib.prepare(cfg.prepare)
    write_jsonl(out, prompts)
    cli.publish(counts, report, timings)
    logging.getLogger("prepare").info("wrote %d prompts to %s\n%s", len(prompts), out, lib.summary(counts))


if __name__ == "__main__":
    main()
