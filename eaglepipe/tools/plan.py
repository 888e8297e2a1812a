"""``make plan``: what a run costs before it runs: tokens to generate and to train, the disk the hidden states take,
and the time at given or measured speeds. Reads a config.json and the params; loads no model, writes nothing.

Target: ``--target`` a bare ``config.json``, a model folder, ``embedded`` or a ``.gguf`` file (default: the params'
``target.model``); its config's ``text_config`` (else the file itself) must hold ``hidden_size``,
``num_hidden_layers`` and ``vocab_size``.

Counts: samples (the sequences trained on) = ``--samples``, else sum(prepare.sources n) x infer.samples; prompts =
samples / infer.samples. Per sample, prompt and answer tokens are ``--prompt-tokens`` / ``--answer-tokens``, else the
measured run's means (metrics/infer.json) when the target is the params' own and metrics/hidden.json has its width,
else the bounds: ``infer.max_new_tokens`` for an answer, ``merge.max_length`` less the answer for a prompt. Answers
are capped at ``infer.max_new_tokens``, sequences at ``merge.max_length``; train runs ``train.epochs`` times over
``1 - merge.valid_fraction`` of the tokens.

Bytes per token stored by hidden (eaglepipe/hidden/layout.py): ``aux`` 3·H and ``final`` H in ``hidden.dtype``
(float8_e4m3fn: 1 byte each plus a float32 scale per token and state), plus 13 bytes of ``input_ids``,
``loss_mask``, ``top`` and ``target_logprob``; not shard headers and offsets (hidden's measured ``bytes_per_token``
counts them). Online training stores nothing; streamed training at most ``train.spool_bytes``, its engine running
once when all the states fit in it, else every epoch (eaglepipe/drafter/spool.py).

Time: tokens / (tokens/s) per stage, from the ``--*-tokens-per-s`` options, else this machine's last run of the
params' own target (metrics/timings/*.json, same condition as the means); each figure says where it came from.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml

from eaglepipe.core import config
from eaglepipe.drafter import spool
from eaglepipe.hidden import layout
from eaglepipe.target.model import resolve

PER_TOKEN_COLUMNS = 4 + 1 + 4 + 4  # input_ids int32, loss_mask uint8, top int32, target_logprob float32: bytes/token
TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size")


def text_config(path) -> dict:
    """The language model's fields of a config.json: its ``text_config`` if it has one, else the file itself."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise click.ClickException(f"{path}: no config to read ({e})") from None
    text, where = (raw["text_config"], "text_config.") if isinstance(raw.get("text_config"), dict) else (raw, "")
    for field in TEXT_FIELDS:
        if not isinstance(text.get(field), int):
            raise click.ClickException(f"{path}: no integer {where}{field}, which the plan reads")
    return {field: text[field] for field in TEXT_FIELDS} | {"composite": bool(where)}


def bytes_per_token(hidden_size: int, dtype: str) -> float:
    """Bytes hidden stores per token for a target of width ``hidden_size`` in ``dtype``."""
    return layout.bytes_per_token(hidden_size, dtype) + PER_TOKEN_COLUMNS


def load_params(path, sets: tuple[str, ...]) -> config.Params:
    """``config.parse`` of the params file with each ``KEY.PATH=VALUE`` of ``sets`` applied (VALUE read as YAML)."""
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) if Path(path).exists() else None
    if raw is None:
        raise click.ClickException(f"{path}: no params there")
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.ClickException(f"--set {item!r}: should be KEY=VALUE, e.g. infer.max_new_tokens=4096")
        *parents, leaf = key.split(".")
        node = raw
        for name in parents:
            node = node.setdefault(name, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise click.ClickException(f"--set {item!r}: {key.rpartition('.')[0]} is not a section of {path}")
        node[leaf] = yaml.safe_load(value)
    try:
        return config.parse(raw, str(path))
    except config.ConfigError as e:
        raise click.ClickException(str(e)) from None


def measured(metrics: Path, hidden_size: int) -> dict:
    """The measured run's figures when it was of a target this wide, else {}: mean prompt and answer tokens,
    and tokens/s of infer (generated), hidden (computed) and train (trained, all epochs)."""

    def read(name):
        path = metrics / name
        return json.loads(path.read_text()) if path.exists() else {}

    if read("hidden.json").get("hidden_size") != hidden_size:
        return {}
    infer, found = read("infer.json"), {}
    if infer.get("completions"):
        found["prompt"] = (infer["tokens_in"] / infer["completions"], f"mean of {metrics}/infer.json")
        found["answer"] = (infer["tokens_out"] / infer["completions"], f"mean of {metrics}/infer.json")
    for stage in ("infer", "hidden", "train"):
        tps = read(f"timings/{stage}.json").get("tokens_per_s")
        if tps:
            found[stage] = (tps, f"{metrics}/timings/{stage}.json, this machine's last run")
    return found


def lengths(params, prompt, answer, known: dict) -> tuple:
    """(prompt tokens, where from), (answer tokens, where from), sequence tokens: per sample."""
    cap = params.infer.max_new_tokens
    a = (answer, "given") if answer is not None else known.get("answer") or (cap, "bound: infer.max_new_tokens")
    if a[0] > cap:
        a = (cap, f"{a[1]}, capped at infer.max_new_tokens")
    room = max(params.merge.max_length - a[0], 0)
    p = (prompt, "given") if prompt is not None else known.get("prompt") or (room, "bound: merge.max_length - answer")
    return p, a, min(p[0] + a[0], params.merge.max_length)


def size(n: float) -> str:
    """Bytes in decimal units: 12.6 TB, 368.6 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def duration(tokens: float, figure) -> str:
    """``tokens`` at a (tokens/s, where from) figure: the time and the figure, or which option gives one."""
    tps, source = figure
    if not tps:
        return f"{'-':>18}  {source}"
    seconds = tokens / tps
    time = f"{seconds / 60:,.1f} min" if seconds < 3600 else f"{seconds / 3600:,.1f} h"
    return f"{time:>18}  at {tps:,.1f} tokens/s ({source})"


def count(x: float) -> str:
    """A count or a mean: 1,234 or 121.3."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def report(cfg: dict, params, samples: int, p, a, seq, speeds: dict) -> list[str]:
    """The plan's lines."""
    prompts = -(-samples // params.infer.samples)
    generate, tokens = samples * a[0], samples * seq
    per_epoch = tokens * (1 - params.merge.valid_fraction)
    bf = bytes_per_token(cfg["hidden_size"], params.hidden.dtype)
    fp8 = bytes_per_token(cfg["hidden_size"], "float8_e4m3fn")
    row = "{:<34}{:>18,.0f}  {}".format
    served = "float32" if params.hidden.compute_dtype == "auto" else params.hidden.compute_dtype  # auto: the widest
    spooled = tokens * spool.bytes_per_token(cfg["hidden_size"], params.hidden.dtype, served)
    spool_line, engine = streamed(params, tokens * bf, spooled, tokens, speeds)
    return [
        f"target   {cfg['path']}: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, vocab "
        f"{cfg['vocab_size']}{' (read from text_config)' if cfg['composite'] else ''}",
        f"per sample: prompt {count(p[0])} tokens ({p[1]}), answer {count(a[0])} ({a[1]}); sequence {count(seq)} "
        f"(merge.max_length {params.merge.max_length})",
        "",
        row("prompts", prompts, f"each answered infer.samples = {params.infer.samples} times"),
        row("samples (answers)", samples, "the sequences trained on"),
        row("tokens to generate", generate, "infer"),
        row("tokens of the sequences", tokens, "what hidden runs the target on"),
        row("tokens to train, per epoch", per_epoch, "train split, 1 - merge.valid_fraction"),
        row(f"tokens to train, {params.train.epochs} epochs", per_epoch * params.train.epochs, "train.epochs"),
        "",
        f"{'offline states, ' + params.hidden.dtype:<34}{size(tokens * bf):>18}  {bf:,.0f} bytes/token",
        f"{'offline states, float8_e4m3fn':<34}{size(tokens * fp8):>18}  {fp8:,.0f} bytes/token, x{fp8 / bf:.2f} "
        "(hidden.dtype: float8_e4m3fn)",
        f"{'online (train.features: online)':<34}{'0 B':>18}  the target runs inside the trainer instead",
        spool_line,
        "",
        f"{'time: infer':<34}{duration(generate, speeds['infer'])}",
        f"{'time: hidden (offline only)':<34}{duration(tokens, speeds['hidden'])}",
        engine,
        f"{'time: train':<34}{duration(per_epoch * params.train.epochs, speeds['train'])}",
    ]


def streamed(params, states_bytes: float, spooled: float, tokens: float, speeds: dict) -> tuple[str, str]:
    """The two lines of ``train.features: streamed``: its spool's bytes, and the engine's time (hidden's speed: the same
    server and connector), once when every state fits in ``train.spool_bytes`` with the engine's files (``spooled``:
    drafter/spool.py's rule), else every epoch."""
    budget = params.train.spool_bytes
    kept = spooled <= budget
    asked = 1 if kept else params.train.epochs
    how = "all kept, the engine runs once" if kept else f"the engine runs every epoch ({asked} times hidden's tokens)"
    spool = (
        f"{'streamed (train.features)':<34}{size(min(budget, states_bytes)):>18}  at most train.spool_bytes "
        f"({size(budget)}): {how}"
    )
    return spool, f"{'time: streamed engine':<34}{duration(tokens * asked, speeds['hidden'])}"


@click.command(help=__doc__)
@click.option(
    "--target",
    "target_arg",
    default=None,
    help="A config.json, a model folder, 'embedded' or a .gguf [default: the params' target.model].",
)
@click.option("--params", "params_path", default="params.yaml", show_default=True, help="The pipeline's params.")
@click.option(
    "--set",
    "-S",
    "sets",
    multiple=True,
    help="KEY=VALUE over the params, e.g. -S infer.max_new_tokens=4096 (as dvc exp run -S).",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=None,
    help="Sequences to train on [default: sum(prepare.sources n) x infer.samples].",
)
@click.option("--prompt-tokens", type=click.FloatRange(min=0), default=None, help="Mean prompt tokens per sample.")
@click.option("--answer-tokens", type=click.FloatRange(min=0), default=None, help="Mean answer tokens per sample.")
@click.option(
    "--generate-tokens-per-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Infer speed: generated tokens/s over the whole run.",
)
@click.option(
    "--hidden-tokens-per-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Hidden speed: sequence tokens/s.",
)
@click.option(
    "--train-tokens-per-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Train speed: trained tokens/s, epochs included.",
)
@click.option(
    "--metrics",
    default="metrics",
    show_default=True,
    type=click.Path(path_type=Path),
    help="The measured run's metrics folder (infer.json, hidden.json, timings/).",
)
def main(  # noqa: PLR0913  click passes one argument per option: the signature is the command line
    target_arg,
    params_path,
    sets,
    samples,
    prompt_tokens,
    answer_tokens,
    generate_tokens_per_s,
    hidden_tokens_per_s,
    train_tokens_per_s,
    metrics,
):
    params = load_params(params_path, sets)
    if target_arg and target_arg.endswith(".json"):
        path = Path(target_arg)
    else:
        try:
            path = resolve(target_arg or params.target.model, params.target.trust_remote_code) / "config.json"
        except FileNotFoundError as e:
            raise click.ClickException(str(e)) from None
    cfg = text_config(path) | {"path": target_arg or f"{params.target.model} ({path})"}
    own = target_arg in (None, params.target.model)
    known = measured(metrics, cfg["hidden_size"]) if own else {}
    samples = samples or sum(s.n for s in params.prepare.sources) * params.infer.samples
    p, a, seq = lengths(params, prompt_tokens, answer_tokens, known)
    speeds = {
        stage: (value, "given") if value else known.get(stage) or (None, f"no figure: {option}")
        for stage, value, option in (
            ("infer", generate_tokens_per_s, "--generate-tokens-per-s"),
            ("hidden", hidden_tokens_per_s, "--hidden-tokens-per-s"),
            ("train", train_tokens_per_s, "--train-tokens-per-s"),
        )
    }
    click.echo("\n".join(report(cfg, params, samples, p, a, seq, speeds)))


if __name__ == "__main__":
    main()
