"""hidden: the target's hidden states on the merged sequences, for training the drafter (format and layer
convention: eaglepipe/hidden/layout.py), from an in-process forward (hidden.engine: hf) or a vLLM server (vllm:
eaglepipe/hidden/vllm_source.py). Finished shards are kept in the cache as they are written, so a rerun resumes.
Every sequence's answer is checked against the engine's own log-probabilities (eaglepipe/hidden/agreement.py): a
disagreement stops the stage before it publishes anything; the figures go into the report.
The hf engine runs as one process or under torchrun, whose ranks share the shards (eaglepipe/core/runtime.py). With
train.features online or streamed it extracts nothing (train has them computed as it goes) and publishes an index
saying so."""

import logging

import click

from eaglepipe.core import cli, runtime
from eaglepipe.core.errors import UserError
from eaglepipe.hidden import extract, publish, vllm_source
from eaglepipe.target import model as target


@click.command(help=__doc__)
@click.option(
    "--params",
    required=True,
    type=click.Path(dir_okay=False),
    help="params.yaml (target.model, hidden, train.features, runtime).",
)
@click.option("--sequences", "seq_folder", required=True, type=click.Path(file_okay=False), help="merge's output.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder of the shards.")
@click.option("--report", required=True, type=click.Path(dir_okay=False), help="Run report (DVC metrics).")
@cli.timings
@cli.cache("hidden")
@cli.stage
def main(params, seq_folder, out, report, timings, cache):
    cfg = cli.params(params)
    folder = target.checked(cfg.target.model, cfg.target.trust_remote_code)
    with runtime.start(cfg.runtime.device) as rt:
        if cfg.train.features != "offline":
            if rt.is_main:
                cli.publish(publish.skip(out), report, timings)
                logging.info("hidden: %s", publish.SKIPPED)
            return
        if cfg.hidden.engine == "vllm":
            if rt.world > 1:
                raise UserError(
                    "hidden.engine vllm runs as one process: the server spreads the target itself "
                    "(hidden.vllm.launch tp, dp, extra_args)"
                )
            dtype = runtime.states_dtype(cfg.hidden.compute_dtype, rt.device)
            with vllm_source.VLLMStates(folder, cfg.hidden, dtype, cache) as source:
                rep = extract.run(seq_folder, out, source, cfg.hidden, target.fingerprint(folder), cache, rt)
        else:
            model = target.load_states_target(folder, cfg.hidden.compute_dtype, rt, cfg.runtime.device_map)
            rep = extract.run(seq_folder, out, model, cfg.hidden, target.fingerprint(folder), cache, rt)
    if rt.is_main:
        cli.publish(rep, report, timings)
        logging.info(
            "hidden: %d tokens (%d stored in the published shards), %s bytes per stored token, layers %s",
            rep["tokens"],
            rep["stored_tokens"],
            rep["bytes_per_token"],
            rep["layers"],
        )


if __name__ == "__main__":
    main()
