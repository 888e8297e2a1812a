"""Every param of the pipeline, defined once: names, types, defaults, allowed values and meaning.

``load`` validates all of ``params.yaml`` before a stage loads anything: an unknown key, a wrong type or a value out of
range is a ``ConfigError`` naming the key (with the closest known key for a typo), the value and what is allowed.
``python -m eaglepipe.core.config`` prints every key with its default and meaning.

The root (``Params``) and its loading are here; the sections are declared in data_sections.py (target, prepare,
infer, merge) and model_sections.py (hidden, train, evaluate, serve, runtime), on section.py's ``Section``, and are
importable from here, as every other module imports them. A ``speed(...)`` field changes how fast a stage runs, never
what it writes: dvc.yaml tracks exactly the other keys (``tracked_keys``) and resume fingerprints leave it out. The
implementing modules key their tables by the value names listed there (``TOOL_CALLS``, ``FORMATS``,
``infer.engine``). Imports no stage code (it is a dep of every stage).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError, model_validator

from eaglepipe.core import explain
from eaglepipe.core.data_sections import (
    FORMATS,
    PACKAGE_PATH,
    TOOL_CALLS,
    Gates,
    Infer,
    Launch,
    Markers,
    Merge,
    Prepare,
    Servers,
    Source,
    Target,
    servers_for_the_engine,
)
from eaglepipe.core.model_sections import BENCHMARKS, Benchmark, Evaluate, Hidden, Ngram, Runtime, Serve, Train
from eaglepipe.core.section import ConfigError, Section, speed

__all__ = [
    "BENCHMARKS",
    "CACHE",
    "DIGESTS",
    "FORMATS",
    "PACKAGE_PATH",
    "TOOL_CALLS",
    "Benchmark",
    "ConfigError",
    "Evaluate",
    "Gates",
    "Hidden",
    "Infer",
    "Launch",
    "Markers",
    "Merge",
    "Ngram",
    "Params",
    "Prepare",
    "Runtime",
    "Section",
    "Serve",
    "Servers",
    "Source",
    "Target",
    "Train",
    "describe",
    "load",
    "parse",
    "servers_for_the_engine",
    "speed",
]

CACHE = Path(os.environ.get("EAGLEPIPE_CACHE", Path(__file__).resolve().parents[2] / ".cache"))
"""Root of the resumable work folders (``.cache/<stage>/<fingerprint>/``); ``EAGLEPIPE_CACHE`` moves it."""
DIGESTS = CACHE / "digests"  # each large file's sha256, read once (hashing.file_digest)


class Params(Section):
    target: Target = Target()
    prepare: Prepare
    infer: Infer = Infer()
    merge: Merge = Merge()
    hidden: Hidden = Hidden()
    train: Train = Train()
    evaluate: Evaluate = Evaluate()
    serve: Serve = Serve()
    runtime: Runtime = Runtime()

    @model_validator(mode="after")
    def _streamed_has_servers(self):
        vllm = self.hidden.vllm
        if self.train.features == "streamed" and not vllm.urls and vllm.launch is None:
            raise ValueError(
                "train.features streamed needs hidden.vllm.urls (running servers) or hidden.vllm.launch (a server "
                "to start)"
            )
        return self


def parse(raw: dict, where: str = "params") -> Params:
    """Validate a params mapping; raises ConfigError with one line per problem, joined by '; '."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: should be a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{where}: " + "; ".join(explain.problems(e, Params))) from None


def load(path="params.yaml") -> Params:
    """Read and validate ``path``; every problem is a ConfigError naming the file and the key."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such params file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse(raw, str(path))


def describe(model=Params, prefix: str = "") -> list[str]:
    """Every key with its type, default and meaning, one line each (``python -m eaglepipe.core.config``)."""
    lines = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{name}"
        speed_only = "  [speed only]" if (f.json_schema_extra or {}).get("speed") else ""
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            lines += [f"{key}:{speed_only}", *describe(f.annotation, key + ".")]
            continue
        default = "required" if f.is_required() else repr(f.default)
        lines.append(f"{key} = {default}  {f.description or ''}{speed_only}")
    return lines


if __name__ == "__main__":
    print("\n".join(describe()))
