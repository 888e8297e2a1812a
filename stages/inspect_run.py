"""inspect: print a few random records of a run, reasoning / content / tool calls apart, with token counts.

What to check by eye before trusting a run (``make inspect``): the reasoning holds the model's thinking and the
content its answer, tool calls parse, nothing is cut short unexpectedly, and every record re-derives from its ids.
Reads --responses (a run's records, or the generations a run stopped by a gate left in
.cache/infer/<fingerprint>/generations.jsonl), --params and --report if present. Writes nothing.
"""

# Not stages/inspect.py: a script there would shadow the standard library's inspect for every script in stages/.
import json
import logging
from pathlib import Path

import click

from eaglepipe.core import config
from eaglepipe.target import model as target
from eaglepipe.text import derive
from eaglepipe.tools import inspect as insp


@click.command(help=__doc__)
@click.option("--responses", default="data/responses/responses.jsonl", show_default=True, help="Response records.")
@click.option("--n", "n", default=3, show_default=True, help="How many records to show.")
@click.option("--seed", default=0, show_default=True, help="Which records: the same seed shows the same ones.")
@click.option("--source", default=None, help="Only records of this source.")
@click.option("--max-chars", default=1200, show_default=True, help="Longer fields show their start and end (0: all).")
@click.option(
    "--params",
    default="params.yaml",
    show_default=True,
    help="For the tokenizer (token counts, re-deriving each record) and target.reasoning / tool_calls.",
)
@click.option("--report", default="metrics/infer.json", show_default=True, help="Run report to summarise, if present.")
def main(responses, n, seed, source, max_chars, params, report):
    logging.basicConfig(level=logging.WARNING)
    if not Path(responses).exists():
        raise click.ClickException(f"{responses} does not exist: run `make infer` first")
    tokenizer = spec = None
    if Path(params).exists():
        cfg = config.load(params).target
        tokenizer = target.load_tokenizer(target.resolve(cfg.model, cfg.trust_remote_code))
        spec = derive.spec_from_params(cfg.reasoning, cfg.tool_calls)
    rep = json.loads(Path(report).read_text()) if report and Path(report).exists() else None
    click.echo(insp.render(Path(responses), n, seed, tokenizer, spec, max_chars, source, rep))


if __name__ == "__main__":
    main()
