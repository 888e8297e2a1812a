"""train: the EAGLE-3 drafter on the target's stored hidden states, with training-time test (eaglepipe/train.py);
writes a checkpoint SGLang loads as it is (eaglepipe/draft.py). Checkpointed as it goes: a rerun resumes exactly."""
import logging
from pathlib import Path

import click

from eaglepipe import cli, compat, draft, target, train
from eaglepipe.config import CACHE
from eaglepipe.records import write_json


@click.command(help=__doc__)
@click.option("--params", required=True, type=click.Path(dir_okay=False), help="params.yaml (target.model, train).")
@click.option("--hidden", "hidden_folder", required=True, type=click.Path(file_okay=False), help="hidden's shards.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder of the drafter.")
@click.option("--metrics", required=True, type=click.Path(dir_okay=False), help="Last epoch's figures (DVC metrics).")
@click.option("--plots", required=True, type=click.Path(dir_okay=False),
              help="One row per epoch, split and TTT step (DVC plots).")
@cli.timings
@click.option("--checkpoints", default=None, type=click.Path(file_okay=False),
              help=f"Checkpoint folder [default: {CACHE / 'train'}/<fingerprint>].")
@cli.stage
def main(params, hidden_folder, out, metrics, plots, timings, checkpoints):
    cfg = cli.params(params)
    folder = target.resolve(cfg.target.model)
    compat.check(folder)  # a target the pipeline cannot serve stops here, before anything is loaded
    fp = train.fingerprint(hidden_folder, cfg.train, target.fingerprint(folder))
    model, report, history = train.run(hidden_folder, folder, cfg.train, Path(checkpoints or CACHE / "train" / fp))
    draft.save(model, out)
    cli.publish(report, metrics, timings)
    write_json(plots, history)
    logging.info("drafter in %s; valid acc %s", out, report["valid"])


if __name__ == "__main__":
    main()
