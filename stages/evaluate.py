"""evaluate: speculative decoding with the trained drafter on held-out prompts, against plain greedy decoding and a
prompt-lookup (n-gram) drafter, with the real target (definitions: eaglepipe/speculative.py). Fails when any
speculative output differs from plain greedy. Runs as one process or under torchrun, whose ranks share the prompts
(eaglepipe/runtime.py)."""
import logging

import click
import torch

from eaglepipe import cli, compat, evaluate, runtime, target
from eaglepipe.errors import UserError
from eaglepipe.records import write_json, write_jsonl


@click.command(help=__doc__)
@click.option("--params", required=True, type=click.Path(dir_okay=False), help="params.yaml (target, evaluate, runtime).")
@click.option("--prompts", required=True, type=click.Path(dir_okay=False),
              help="Held-out prompts (JSON Lines of OpenAI messages, optional tools and category).")
@click.option("--draft", "draft_folder", required=True, type=click.Path(file_okay=False), help="Trained drafter.")
@click.option("--report", required=True, type=click.Path(dir_okay=False), help="Metrics (DVC metrics).")
@click.option("--positions", required=True, type=click.Path(dir_okay=False),
              help="Acceptance rate per draft position, EAGLE and n-gram (DVC plots).")
@click.option("--decoded", required=True, type=click.Path(dir_okay=False),
              help="Per prompt: its ids, the plain greedy output and the EAGLE counts (JSON Lines, for the serve check).")
@cli.timings
@cli.stage
def main(params, prompts, draft_folder, report, positions, decoded, timings):
    cfg = cli.params(params)
    p = cfg.evaluate
    if p.threads:
        torch.set_num_threads(p.threads)
    folder = target.resolve(cfg.target.model)
    compat.check(folder)  # a target the pipeline cannot serve stops here, before anything is loaded
    tokenizer = target.load_tokenizer(folder)
    prompt_list = evaluate.load_prompts(prompts, tokenizer, cfg.target.chat_template_kwargs)[:p.limit]
    with runtime.start(cfg.runtime.device) as rt:
        model = runtime.load_target(folder, "float32", rt, cfg.runtime.device_map)
        drafter = evaluate.load_drafter(draft_folder, model)
        metrics = evaluate.run(prompt_list, model, drafter, target.stop_ids(folder, tokenizer), p, rt)
    if rt.is_main:
        write_json(positions, metrics.pop("positions"))
        write_jsonl(decoded, metrics.pop("decoded"))
        cli.publish(metrics, report, timings)
        logging.info("acceptance length %.3f (n-gram %.3f), lossless %s", metrics["acceptance_length"],
                     metrics["baseline_acceptance_length"], metrics["lossless"])
    if not metrics["lossless"]:
        raise UserError(f"speculative decoding changed the output of {len(metrics['mismatches'])} prompt(s): "
                        f"{metrics['mismatches'][:5]} (see {report})")


if __name__ == "__main__":
    main()
