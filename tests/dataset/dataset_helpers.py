"""What the prepare and sources tests share: the fixture source files of each format, source files they write,
a ``prepare`` section's source entry, prepare run on such a section, and the prepare stage script with its
params file."""

import json

import yaml
from helpers import ROOT

from eaglepipe.core import config
from eaglepipe.core.records import RecordError
from eaglepipe.dataset import prepare
from eaglepipe.dataset.sources import raw_records, read_source

FIXTURES = ROOT / "tests" / "fixtures" / "sources"
FIXTURE = {
    "sharegpt": "sharegpt.jsonl",
    "openai": "openai.json",
    "glaive": "glaive.json",
    "opencodeinstruct": "opencodeinstruct.jsonl",
    "magicoder": "magicoder.jsonl",
    "alpaca": "alpaca.json",
}
STAGE = ROOT / "stages" / "prepare.py"


def read_ok(path, fmt, source="src"):
    """All prompts of a file, failing the test on any broken record."""
    items = list(read_source(path, fmt, source))
    errors = [str(e) for e in items if isinstance(e, RecordError)]
    assert not errors, errors
    return items


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def alpaca_file(path, texts):
    return write_jsonl(path, [{"instruction": t, "input": "", "output": "ok"} for t in texts])


def source(name, path, n, fmt="alpaca"):
    return {"name": name, "path": str(path), "format": fmt, "n": n}


def fixture_records(fmt):
    return [rec for _, _, rec in raw_records(FIXTURES / FIXTURE[fmt])]


def prepare_(section: dict):
    """prepare on a ``prepare`` section as params.yaml holds it (validated as the stage validates it)."""
    return prepare.prepare(config.parse({"prepare": section}, "params.yaml").prepare)


def params_file(tmp_path, sources, on_error="fail"):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"prepare": {"seed": 1, "on_error": on_error, "sources": sources}}))
    return path
