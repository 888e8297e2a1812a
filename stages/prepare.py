"""Stage prepare: mix the prompt sources of params.yaml into one prompts file, plus a report."""
import logging
import sys
from pathlib import Path

import click
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eaglepipe import prepare as lib  # noqa: E402
from eaglepipe.records import write_json, write_jsonl  # noqa: E402


@click.command()
@click.option("--params", default="params.yaml", show_default=True, type=click.Path(exists=True, dir_okay=False),
              help="YAML file whose 'prepare' section lists the sources {name, path, format, n}, seed and on_error.")
@click.option("--out", default="data/prompts/prompts.jsonl", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the selected prompts (JSON Lines, one Prompt a line).")
@click.option("--report", default="metrics/prepare.json", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the counts per source: read, valid, skipped by reason, duplicates, selected.")
def main(params, out, report):
    """Read each source, drop broken records (on_error: skip) or stop at the first (fail), remove duplicates,
    sample n prompts per source with a per-source seed, and write the prompts and the report."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = yaml.safe_load(Path(params).read_text(encoding="utf-8"))["prepare"]
    try:
        prompts, counts = lib.prepare(cfg)
    except ValueError as e:  # RecordError included: a bad record (on_error: fail) or a bad params section
        raise click.ClickException(str(e)) from e
    write_jsonl(out, prompts)
    write_json(report, counts)
    logging.getLogger("prepare").info("wrote %d prompts to %s\n%s", len(prompts), out, lib.summary(counts))


if __name__ == "__main__":
    main()
