"""merge: responses -> training sequences (prompt_ids + output_ids, loss mask on the output), never re-tokenised,
split per prompt and shuffled (eaglepipe/dataset/sequences.py); every record is re-validated against its own ids
first."""

from pathlib import Path

import click

from eaglepipe.core import cli
from eaglepipe.dataset import merge
from eaglepipe.target import model as target
from eaglepipe.text import derive


@click.command(help=__doc__)
@click.option("--params", required=True, type=click.Path(dir_okay=False), help="params.yaml (target, merge).")
@click.option("--responses", required=True, type=click.Path(dir_okay=False), help="infer's responses.jsonl.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder of the sequences.")
@click.option("--report", required=True, type=click.Path(dir_okay=False), help="Dataset statistics (DVC metrics).")
@cli.timings
@cli.stage
def main(params, responses, out, report, timings):
    cfg = cli.params(params)
    spec = derive.spec_from_params(cfg.target.reasoning, cfg.target.tool_calls)
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    tokenizer = target.load_tokenizer(folder)
    end_of_turn = target.end_of_turn_id(folder, tokenizer)
    cli.publish(merge.run(Path(responses), Path(out), tokenizer, spec, end_of_turn, cfg.merge), report, timings)


if __name__ == "__main__":
    main()
