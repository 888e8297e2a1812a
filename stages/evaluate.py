"""evaluate: speculative decoding with the trained drafter on the held-out prompts, against plain greedy decoding and a
prompt-lookup (n-gram) drafter, with the real target.

Reads params.yaml (target, evaluate), the held-out prompts (evaluate.prompts) and models/draft; writes
metrics/eval.json: acceptance_length (SGLang's: accepted draft tokens + 1 per verification step, averaged over
steps), acceptance rate per draft position, tokens/s of speculative and plain greedy decoding and their ratio,
baseline_acceptance_length (n-gram), and lossless. Fails when any speculative output differs from plain greedy.
"""
import logging
import sys
from pathlib import Path

import click
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eaglepipe import evaluate, target  # noqa: E402
from eaglepipe.records import write_json  # noqa: E402


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True, help="Parameters file.")
@click.option("--prompts", default=None, help="Held-out prompts (JSONL, OpenAI messages) [default: evaluate.prompts].")
@click.option("--draft", "draft_folder", default="models/draft", show_default=True, help="Trained drafter.")
@click.option("--report", default="metrics/eval.json", show_default=True, help="Metrics (DVC metrics).")
def main(params, prompts, draft_folder, report):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = yaml.safe_load(Path(params).read_text())
    p = cfg["evaluate"]
    if int(p.get("threads", 0)) > 0:
        torch.set_num_threads(int(p["threads"]))
    folder = target.resolve(cfg["target"]["model"])
    tokenizer = target.load_tokenizer(folder)
    model = target.load_model(folder)
    prompt_list = evaluate.load_prompts(prompts or p["prompts"], tokenizer, cfg["target"].get("chat_template_kwargs"))
    if p.get("limit"):
        prompt_list = prompt_list[:int(p["limit"])]
    drafter = evaluate.load_drafter(draft_folder, model)
    metrics = evaluate.run(prompt_list, model, drafter, target.stop_ids(folder, tokenizer), p)
    write_json(report, {"model": cfg["target"]["model"], **metrics})
    logging.info("acceptance length %.3f (n-gram %.3f), %.1f vs %.1f tokens/s plain (x%.2f), lossless %s",
                 metrics["acceptance_length"], metrics["baseline_acceptance_length"],
                 metrics["speculative_tokens_per_s"], metrics["plain_tokens_per_s"], metrics["speedup"] or 0,
                 metrics["lossless"])
    if not metrics["lossless"]:
        raise click.ClickException(f"speculative decoding changed the output of {len(metrics['mismatches'])} "
                                   f"prompt(s): {metrics['mismatches'][:5]} (see {report})")


if __name__ == "__main__":
    main()
