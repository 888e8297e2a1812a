"""make bench: the full benchmarks through vLLM, the way users compare drafters (not part of make repro).

All of evaluate's held-out prompts (``--prompts``), all 80 MT-bench questions (both turns: turn 2 asked after the
target's own greedy turn-1 answer, as evaluate asks it) and all 164 HumanEval problems, each answered greedily by vLLM
(from .venv-vllm, started as the serve check starts it: eaglepipe/evaluate/serve.py) once per method: plain decoding;
the trained drafter (eagle3, evaluate.num_steps draft tokens); prompt lookup (vLLM's ngram method with evaluate.ngram's
bounds and as many draft tokens). vLLM's suffix method is left out: it needs Arctic Inference (arctic-inference),
which PyPI ships for vLLM's CPU build only as source. GSM8K is left out: no package on PyPI ships its test split
(aviary-gsm8k loads it from the Hugging Face hub at run time).

Per benchmark, per category and, for MT-bench, per turn: acceptance length (tokens emitted over decode steps,
evaluate's definition, where a step that proposed nothing emits one token) with its standard error over conversations
(eaglepipe/core/uncertainty.py), and whether each output equals plain decoding's; the drafter's minus prompt lookup's,
paired over the same conversations, and whether it exceeds twice its error (with ``--against LABEL=PATH``, another
drafter, a lever's, decoded too and compared with both; with ``--crossing LABEL=RATIO``, where a straight line in
log2 of the trained tokens through the two drafters reaches prompt lookup); per benchmark and method, tokens/s at
``--concurrency`` requests in flight and its ratio to plain. Greedy outputs can differ from plain where batched
float rounding flips a near-tie, so equality is counted, not required; evaluate (make repro) stays the lossless
check. Writes the figures as JSON (``--out``), prints the table, and appends them to results/bench.jsonl as a
record with this machine, the commit and the params hash (eaglepipe/tools/results.py; not for a ``--limit`` smoke
run). The logic is eaglepipe/evaluate/bench.py's.
"""

import logging
import shlex
import sys
from pathlib import Path

import click

from eaglepipe.core import config
from eaglepipe.core.codedeps import ROOT
from eaglepipe.core.records import write_json
from eaglepipe.evaluate.bench import Compared, Settings, crossings, run, table
from eaglepipe.target.model import load_tokenizer, resolve
from eaglepipe.tools import provenance, results

# tests/evaluate/test_serve.py loads this script and calls its crossings: it stays an attribute of the script.
__all__ = ["crossings", "main"]


def compared_of(draft: str, against: tuple[str, ...], crossing: tuple[str, ...], only: tuple[str, ...]) -> Compared:
    """What the options say to decode beside plain decoding, checked: a problem exits with its message."""
    if bad := [a for a in against if "=" not in a]:
        sys.exit(f"--against takes LABEL=PATH, got {bad}")
    others = dict(a.split("=", 1) for a in against)
    if len(others) != len(against):
        sys.exit(f"--against: a label given twice in {list(against)}")
    try:
        ratios = {label: float(ratio) for label, ratio in (c.split("=", 1) for c in crossing)}
    except ValueError:
        sys.exit(f"--crossing takes LABEL=RATIO (a number), got {list(crossing)}")
    if bad := [label for label, r in ratios.items() if label not in others or not r > 0 or r == 1]:
        sys.exit(f"--crossing {bad}: each LABEL must be an --against drafter and RATIO a positive number other than 1")
    if ratios and only and not {"eagle3", "ngram"} <= set(only):
        sys.exit("--crossing needs the drafter and prompt lookup decoded (--methods eagle3 --methods ngram)")
    if not (Path(draft) / "config.json").exists():
        sys.exit(f"no drafter at {draft}: run make repro first (or give --draft)")
    if missing := [f"{label}={path}" for label, path in others.items() if not (Path(path) / "config.json").exists()]:
        sys.exit(f"--against: no drafter at {missing}")
    resolved = {label: Path(path).resolve() for label, path in others.items()}
    return Compared(Path(draft).resolve(), resolved, only, ratios)


def command_line(args: list[str]) -> str:
    """The command as a results record names it: ``make bench``, with its ``ARGS`` where there were any."""
    return f'make bench ARGS="{shlex.join(args)}"' if args else "make bench"


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
@click.option(
    "--draft",
    default="models/draft",
    show_default=True,
    type=click.Path(file_okay=False),
    help="The trained drafter (make repro writes it).",
)
@click.option(
    "--prompts",
    default="data/eval/heldout.jsonl",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The held-out prompts (evaluate's --prompts).",
)
@click.option("--max-new-tokens", type=int, default=None, help="Per turn [default: evaluate.max_new_tokens].")
@click.option("--concurrency", default=16, show_default=True, help="Requests in flight.")
@click.option(
    "--methods",
    "only",
    multiple=True,
    type=click.Choice(["eagle3", "ngram"]),
    help="Only these methods beside plain decoding [default: all].",
)
@click.option(
    "--against",
    multiple=True,
    metavar="LABEL=PATH",
    help="Another drafter, decoded as eagle3:LABEL and compared with --draft paired (a lever's drafter).",
)
@click.option(
    "--crossing",
    multiple=True,
    metavar="LABEL=RATIO",
    help="An --against drafter trained on RATIO times the drafter's tokens (metrics/train.json's "
    "train_tokens, at the same epochs): extrapolate, per benchmark, where acceptance reaches prompt "
    "lookup's.",
)
@click.option("--limit", type=int, default=None, help="Only the first N conversations of each benchmark (a smoke run).")
@click.option(
    "--out",
    default="metrics/timings/bench.json",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The figures as JSON (not in git: they hold this machine's speeds).",
)
@click.option(
    "--results",
    "results_file",
    default=str(ROOT / "results" / "bench.jsonl"),
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The results file the figures are appended to, with machine, commit and params hash (not with --limit).",
)
def main(  # noqa: PLR0913  click passes one argument per option: the signature is the command line
    params, draft, prompts, max_new_tokens, concurrency, only, against, crossing, limit, out, results_file
):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = config.load(params)
    compared = compared_of(draft, against, crossing, only)
    folder = resolve(cfg.target.model, cfg.target.trust_remote_code)
    settings = Settings(Path(prompts), max_new_tokens or cfg.evaluate.max_new_tokens, concurrency, limit)
    result = run(cfg, folder, load_tokenizer(folder), compared, settings)
    write_json(out, result)
    print(table(result))
    if limit is not None:
        logging.info("a smoke run (--limit): not appended to %s", results_file)
        return
    record = provenance.stamp(
        "make bench", results.from_bench(result, compared.ratios), command_line(sys.argv[1:]), Path(params)
    )
    results.append(record, Path(results_file))
    logging.info("the figures appended to %s", results_file)


if __name__ == "__main__":
    main()
