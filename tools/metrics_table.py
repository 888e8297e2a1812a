"""`dvc metrics show --json` (read from standard input) as one line per figure: file, key, value.

DVC's own table puts every key of every metrics file in one row per file, thousands of characters wide; this prints
the same numbers one under the other, lists included, so they read in a terminal: ``make metrics``.
"""

import json
import sys

import click


def rows(value, key=""):
    """(dotted key, value) for every leaf of a metrics file."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from rows(v, f"{key}.{k}" if key else str(k))
    else:
        yield key, value


@click.command(help=__doc__)
def main():
    shown = json.load(sys.stdin)
    for files in shown.values():
        for path, body in files.get("data", {}).items():
            if "error" in body:
                click.echo(f"{path}  (not readable: {body['error']})")
                continue
            for key, value in rows(body.get("data", {})):
                click.echo(f"{path:<24} {key:<56} {json.dumps(value)}")


if __name__ == "__main__":
    main()
