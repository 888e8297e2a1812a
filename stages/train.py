"""train: the drafter (train.method) on the target's hidden states, stored by hidden or computed as it goes
(train.features), with training-time test (eaglepipe/drafter/train.py); writes a checkpoint SGLang and vLLM load as
it is (eaglepipe/drafter/methods.py).
Checkpointed as it goes: a rerun resumes, at any number of processes (exactly at the same number). Runs as one process
or under torchrun (DDP; eaglepipe/core/runtime.py)."""

import logging
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import click

from eaglepipe.core import cli, runtime
from eaglepipe.core.config import CACHE
from eaglepipe.core.records import write_json
from eaglepipe.drafter import sources, spool, train
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.hidden import layout
from eaglepipe.target import model as target


@click.command(help=__doc__)
@click.option(
    "--params",
    required=True,
    type=click.Path(dir_okay=False),
    help="params.yaml (target.model, train, hidden (online), runtime).",
)
@click.option(
    "--hidden",
    "hidden_folder",
    required=True,
    type=click.Path(file_okay=False),
    help="hidden's shards (read with train.features: offline).",
)
@click.option(
    "--sequences",
    "seq_folder",
    required=True,
    type=click.Path(file_okay=False),
    help="merge's sequences (read with train.features online or streamed, the target computing their states).",
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder of the drafter.")
@click.option("--metrics", required=True, type=click.Path(dir_okay=False), help="Last epoch's figures (DVC metrics).")
@click.option(
    "--plots", required=True, type=click.Path(dir_okay=False), help="One row per epoch, split and TTT step (DVC plots)."
)
@cli.timings
@click.option(
    "--checkpoints",
    default=None,
    type=click.Path(file_okay=False),
    help=f"Checkpoint folder [default: {CACHE / 'train'}/<fingerprint>].",
)
@cli.stage
def main(params, hidden_folder, seq_folder, out, metrics, plots, timings, checkpoints):
    cfg = cli.params(params)
    folder = target.checked(cfg.target.model, cfg.target.trust_remote_code)
    with runtime.start(cfg.runtime.device) as rt, ExitStack() as closing:
        if cfg.train.features == "online":
            model = target.load_states_target(folder, cfg.hidden.compute_dtype, rt, cfg.runtime.device_map)
            feats = sources.Online(seq_folder, model, cfg.hidden)
        elif cfg.train.features == "streamed":
            feats = closing.enter_context(spool.streamed(seq_folder, folder, cfg, CACHE / "train", rt))
        else:
            feats = layout.Stored(hidden_folder)
        p = train.resolved(cfg.train, rt.device)
        # every rank, outside any collective: the first read of the weights and states is long (hashing.file_digest)
        fp = train.fingerprint(feats, p, target.fingerprint(folder))
        model, report, history = train.run(feats, folder, p, Path(checkpoints or CACHE / "train" / fp), rt=rt)
    if rt.is_main:  # into a new folder renamed into place: DVC's cache files (hard links) are never written into
        tmp = Path(f"{out}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        draft.save(model, tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        cli.publish(report, metrics, timings)
        write_json(plots, history)
        logging.info("drafter in %s; valid acc %s", out, report["valid"])


if __name__ == "__main__":
    main()
