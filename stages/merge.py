"""merge: responses -> training sequences (prompt_ids + output_ids, loss mask on the output), shuffled and split.

Reads data/responses/responses.jsonl and params.yaml (target, merge); writes data/sequences/ (safetensors shards and
index.json) and dataset statistics to metrics/merge.json. Every record is re-validated against its own ids first.
"""
import logging
import sys
from pathlib import Path

import click
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eaglepipe import merge, reasoning, target  # noqa: E402
from eaglepipe.records import write_json  # noqa: E402


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True, help="Parameters file.")
@click.option("--responses", default="data/responses/responses.jsonl", show_default=True, help="Response records.")
@click.option("--out", default="data/sequences", show_default=True, help="Output folder.")
@click.option("--report", default="metrics/merge.json", show_default=True, help="Dataset statistics (DVC metrics).")
def main(params, responses, out, report):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = yaml.safe_load(Path(params).read_text())
    folder = target.resolve(cfg["target"]["model"])
    tokenizer = target.load_tokenizer(folder)
    end_of_turn = target.end_of_turn_id(folder, tokenizer)
    spec = reasoning.spec_from_params(cfg["target"]["reasoning"], cfg["target"].get("tool_calls", "none"))
    stats = merge.run(Path(responses), Path(out), tokenizer, spec, end_of_turn, cfg["merge"])
    write_json(report, stats)


if __name__ == "__main__":
    main()
