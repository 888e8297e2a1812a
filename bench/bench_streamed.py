"""Benchmark: the drafter trained on streamed states against the one trained on stored states, on the default data.

    python bench/bench_streamed.py [--spool-bytes N] [--results FILE | --no-results]

Trains the default params' drafter twice in this process: offline on ``data/hidden`` (what hidden stored), then with
``train.features: streamed`` on ``data/sequences``, a vLLM server (``hidden.vllm``: launched from .venv-vllm by
default) computing the states ahead of the trainer within ``train.spool_bytes`` (drafter/spool.py). Prints and
records (results/components.jsonl) each one's validation accuracy per TTT step (± its standard error over samples)
and acceptance length on the turns evaluate decoded (data/decoded; the streamed one's paired difference), the
trainer's tokens/s of each and their ratio, the spool's peak bytes, and the engine's seconds per token against the
spool's reading seconds per token (what keeping the states across epochs saves). The engine and the trainer share
this machine's cores; on GPUs they would not.
"""

import sys
import tempfile
from pathlib import Path

import click
import torch
from harness import acceptances, decoded_sets

from eaglepipe.core import config, runtime
from eaglepipe.drafter import spool, train
from eaglepipe.evaluate import decode as speculative
from eaglepipe.target import model as target
from eaglepipe.tools import provenance, results
from eaglepipe.tools.results import Value

ROOT = Path(__file__).resolve().parent.parent
NAME = "streamed states against stored ones (`bench/bench_streamed.py`)"


def trained(feats, folder, p) -> tuple:
    """(drafter, report) of ``p`` on ``feats``, its checkpoints in a temporary folder."""
    with tempfile.TemporaryDirectory() as checkpoints:
        drafter, report, _ = train.run(feats, folder, p, checkpoints)
    return drafter, report


def accuracies(report: dict, steps: int) -> list[Value]:
    valid = report["valid"]
    return [Value(value=round(valid[f"acc_{k}"], 4), se=valid.get(f"acc_se_{k}")) for k in range(steps)]


def figures(offline: tuple, streamed: tuple, steps: int) -> dict[str, Value]:
    """The record's values from (report, acceptances) of each run."""
    values = {}
    for name, (report, lengths) in {"offline": offline, "streamed": streamed}.items():
        for benchmark, turns in lengths.items():
            values[f"{name}: τ {benchmark}"] = Value(value=round(turns.length, 4), se=turns.se)
        for k, acc in enumerate(accuracies(report, steps)):
            values[f"{name}: valid acc {k}"] = acc
        values[f"{name}: trainer tokens/s"] = Value(value=report["run"]["tokens_per_s"])
    for benchmark, turns in streamed[1].items():
        d, se = turns.difference(offline[1][benchmark])
        values[f"streamed: Δ τ {benchmark}"] = Value(value=round(d, 4), se=None if se is None else round(se, 4))
    ratio = streamed[0]["run"]["tokens_per_s"] / offline[0]["run"]["tokens_per_s"]
    values["trainer tokens/s, streamed over offline"] = Value(value=round(ratio, 3))
    spooled = streamed[0]["run"]["spool"]
    values["spool peak bytes"] = Value(value=spooled["peak_bytes"])
    values["spool budget bytes"] = Value(value=spooled["budget_bytes"])
    values["engine seconds per 1k tokens"] = Value(
        value=round(1000 * spooled["engine_seconds"] / spooled["engine_tokens"], 3)
    )
    read = spooled["read_seconds"] / (streamed[0]["train_tokens"] * streamed[0]["epochs"])
    values["spool read seconds per 1k tokens"] = Value(value=round(1000 * read, 4))
    values["trainer waited for the engine, s"] = Value(value=spooled["wait_seconds"])
    return values


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True)
@click.option("--hidden", "hidden_folder", default="data/hidden", show_default=True)
@click.option("--sequences", "seq_folder", default="data/sequences", show_default=True)
@click.option("--decoded", default="data/decoded", show_default=True, help="What evaluate decoded, per benchmark.")
@click.option(
    "--spool-bytes", type=click.IntRange(min=1), default=None, help="train.spool_bytes [default: the params']."
)
@click.option("--results", "results_file", default=str(ROOT / "results" / "components.jsonl"), show_default=True)
@click.option("--no-results", is_flag=True, help="Print only.")
def main(params, hidden_folder, seq_folder, decoded, spool_bytes, results_file, no_results):
    cfg = config.load(params)
    if spool_bytes:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"spool_bytes": spool_bytes})})
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    model = target.load_model(folder)
    sets, stops, p = decoded_sets(decoded), target.stop_ids(folder, target.load_tokenizer(folder)), cfg.evaluate
    runs = {}
    for name in ("offline", "streamed"):
        recipe = cfg.train.model_copy(update={"features": name})
        with tempfile.TemporaryDirectory() as cache:
            if name == "offline":
                drafter, report = trained(hidden_folder, folder, recipe)
            else:
                with spool.streamed(seq_folder, folder, cfg, Path(cache), runtime.Runtime()) as feats:
                    drafter, report = trained(feats, folder, recipe)
        torch.set_num_threads(p.threads or torch.get_num_threads())
        runs[name] = (report, acceptances(model, speculative.drafter_for(drafter, p.num_steps), sets, stops, p))
        print(f"{name}: valid {report['valid']}, τ {runs[name][1]}, run {report['run']}", flush=True)
    values = figures(runs["offline"], runs["streamed"], cfg.train.ttt_steps)
    for key, value in values.items():
        print(f"{key}: {value.value}" + (f" ± {value.se}" if value.se is not None else ""))
    if not no_results:
        command = " ".join(["python bench/bench_streamed.py", *sys.argv[1:]])
        results.append(provenance.stamp(NAME, values, command, Path(params)), Path(results_file))


if __name__ == "__main__":
    main()
