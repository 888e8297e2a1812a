"""evaluate: speculative decoding with the trained drafter on the benchmarks of evaluate.benchmarks
(eaglepipe/dataset/benchmarks.py), against plain greedy decoding and a prompt-lookup (n-gram) drafter, with the real
target (definitions: eaglepipe/evaluate/decode.py). Fails when any speculative output differs from plain greedy. Runs as
one process or under torchrun, whose ranks share the conversations (eaglepipe/core/runtime.py)."""

import logging
from pathlib import Path

import click
import torch

from eaglepipe.core import cli, config, runtime
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import write_json, write_jsonl
from eaglepipe.dataset import benchmarks
from eaglepipe.evaluate import run as evaluate
from eaglepipe.target import model as target
from eaglepipe.text import derive


@click.command(help=__doc__)
@click.option(
    "--params", required=True, type=click.Path(dir_okay=False), help="params.yaml (target, evaluate, runtime)."
)
@click.option(
    "--prompts",
    type=click.Path(dir_okay=False),
    help="Held-out prompts, the heldout benchmark (JSON Lines of OpenAI messages, optional tools and category).",
)
@click.option("--draft", "draft_folder", required=True, type=click.Path(file_okay=False), help="Trained drafter.")
@click.option("--report", required=True, type=click.Path(dir_okay=False), help="Metrics (DVC metrics).")
@click.option(
    "--positions",
    required=True,
    type=click.Path(dir_okay=False),
    help="Acceptance rate per draft position, EAGLE and n-gram, per benchmark (DVC plots).",
)
@click.option(
    "--decoded",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder: per benchmark <name>.jsonl, per turn its prompt ids, the plain greedy output and the EAGLE "
    "counts (the held-out one is the serve check's input).",
)
@cli.timings
@cli.stage
def main(params, prompts, draft_folder, report, positions, decoded, timings):
    cfg = cli.params(params)
    p = cfg.evaluate
    if p.threads:
        torch.set_num_threads(p.threads)
    folder = target.checked(cfg.target.model, cfg.target.trust_remote_code)
    tokenizer = target.load_tokenizer(folder)
    conversations, selection = benchmarks.select(p.benchmarks, prompts, p.limit)
    spec = derive.spec_from_params(cfg.target.reasoning)
    chat = evaluate.Chat(tokenizer, cfg.target.chat_template_kwargs, spec, target.stop_ids(folder, tokenizer))
    with runtime.start(cfg.runtime.device) as rt:
        model = target.load_target(folder, "float32", rt, cfg.runtime.device_map)
        drafter = evaluate.load_drafter(draft_folder, model)
        metrics = evaluate.run(conversations, chat, model, drafter, p, rt)
    if rt.is_main:
        write_json(positions, metrics.pop("positions"))
        rows = metrics.pop("decoded")
        for name in config.BENCHMARKS:  # a benchmark no longer chosen leaves no file behind
            if name in rows:
                write_jsonl(Path(decoded) / f"{name}.jsonl", rows[name])
            else:
                (Path(decoded) / f"{name}.jsonl").unlink(missing_ok=True)
        for name, figures in metrics["benchmarks"].items():
            figures["selection"] = selection[name]
            logging.info(
                "%s: acceptance length %.3f (n-gram %.3f), lossless %s",
                name,
                figures["acceptance_length"],
                figures["baseline_acceptance_length"],
                figures["lossless"],
            )
        cli.publish(metrics, report, timings)
    if not metrics["lossless"]:
        raise UserError(
            f"speculative decoding changed the output of {len(metrics['mismatches'])} turn(s): "
            f"{metrics['mismatches'][:5]} (see {report})"
        )


if __name__ == "__main__":
    main()
