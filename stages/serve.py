"""serve: the serve check. vLLM serves the target with the trained drafter on the prompts evaluate decoded; the
engine's acceptance length must match evaluate's within serve.tolerance and every engine output must equal the plain
greedy output, unless it first differs at a near-tie of the target's two best tokens (serve.tie_margin; the target is
loaded for it, float32, on runtime.device, only where an output differs: eaglepipe/evaluate/serve.py, ties.py). Every
server it starts is stopped, on success, failure and Ctrl-C."""

import logging
from pathlib import Path

import click

from eaglepipe.core import cli, runtime
from eaglepipe.core.errors import UserError
from eaglepipe.evaluate import serve, ties
from eaglepipe.target import model as target


@click.command(help=__doc__)
@click.option("--params", required=True, type=click.Path(dir_okay=False), help="params.yaml (target, evaluate, serve).")
@click.option(
    "--decoded",
    required=True,
    type=click.Path(dir_okay=False),
    help="What evaluate decoded (JSON Lines: data/decoded/heldout.jsonl).",
)
@click.option("--draft", "draft_folder", required=True, type=click.Path(file_okay=False), help="Trained drafter.")
@click.option("--report", required=True, type=click.Path(dir_okay=False), help="Metrics (DVC metrics).")
@cli.timings
@cli.stage
def main(params, decoded, draft_folder, report, timings):
    cfg = cli.params(params)
    if not Path(decoded).is_file():
        raise UserError(
            f"{decoded} does not exist: the serve check replays what evaluate decoded, so "
            "evaluate.benchmarks must include the benchmark it names (dvc.yaml: heldout)"
        )
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    tokenizer = target.load_tokenizer(folder)
    rows = serve.load_decoded(decoded)
    with runtime.start(cfg.runtime.device) as rt:
        judge = ties.Judge(
            lambda: target.load_target(folder, "float32", rt, cfg.runtime.device_map), cfg.serve.tie_margin
        )
        metrics = serve.check(
            folder.resolve(),
            tokenizer,
            draft_folder,
            rows,
            cfg.serve,
            cfg.evaluate.num_steps,
            cfg.evaluate.max_new_tokens,
            judge,
        )
    cli.publish(metrics, report, timings)
    logging.info(
        "vLLM: acceptance length %.4f (evaluate %.4f), outputs equal %s; %.1f tokens/s with the drafter",
        metrics["acceptance_length"],
        metrics["evaluate_acceptance_length"],
        metrics["outputs_equal"],
        metrics["run"]["speculative_tokens_per_s"],
    )
    if not metrics["passed"]:
        raise UserError(serve.failure(metrics, report))


if __name__ == "__main__":
    main()
