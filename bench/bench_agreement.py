"""Benchmark: how far the answers' engine and the states' model differ on the same target when nothing is wrong, the
figures ``hidden.agreement.max_mean_abs_diff: auto`` is set from (eaglepipe/hidden/comparison.py).

    python bench/bench_agreement.py [--n 32] [--max-new-tokens 64] [--engine hf:float32 --engine vllm:float32 ...]
                                    [--states float32 --states bfloat16] [--results results/components.jsonl]

Runs the stages as dvc.yaml runs them, in a work folder: infer on the first ``--n`` held-out prompts with each
``--engine`` (name:dtype; the pre-flight off, since it is what is measured), merge, then hidden at each ``--states``
compute dtype with the check in ``warn`` mode; prints what hidden's report says (``agreement.logprobs``): the mean
|engine - target| log-probability over every answer token, the largest mean of one sequence, the largest single
difference, in nats. Appended to ``--results`` with machine and commit (not with ``--no-results``).
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import yaml
from harness import env, params_for, stage_commands

from eaglepipe.core.records import Prompt, content_id, read_jsonl, write_jsonl
from eaglepipe.tools import provenance, results
from eaglepipe.tools.results import Value

ROOT = Path(__file__).resolve().parent.parent


def run(command: list[str], cache: Path) -> None:
    done = subprocess.run(command, cwd=ROOT, env=env(cache), capture_output=True, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def prompts_file(work: Path, n: int) -> Path:
    """The first ``n`` held-out conversations (data/eval/heldout.jsonl) as prompt records."""
    conversations = [obj for _, obj in read_jsonl(ROOT / "data" / "eval" / "heldout.jsonl")][:n]
    path = work / "prompts.jsonl"
    write_jsonl(path, [Prompt(content_id(c["messages"], None), "heldout", c["messages"]) for c in conversations])
    return path


def measure(work: Path, engine: str, states: list[str], settings: dict) -> dict[str, dict]:
    """hidden's ``agreement.logprobs`` for answers of ``engine`` (name:dtype), at each states dtype."""
    name, dtype = engine.split(":")
    overrides = {
        "infer.engine": name,
        "infer.dtype": dtype,
        "infer.preflight": {"mode": "off"},
        "infer.samples": 1,
        "infer.max_new_tokens": settings["max_new_tokens"],
        "hidden.agreement": {"mode": "warn"},
    }
    found = {}
    for states_dtype in states:
        folder = work / f"{name}-{dtype}-{states_dtype}"
        folder.mkdir()
        params = params_for(yaml.safe_load((ROOT / "params.yaml").read_text()), overrides)
        params["hidden"]["compute_dtype"] = states_dtype
        (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        commands = stage_commands(folder, ["infer", "merge", "hidden"])
        commands["infer"][commands["infer"].index("--prompts") + 1] = str(settings["prompts"])
        for stage in ("infer", "merge", "hidden"):  # infer's cache answers the second states dtype
            run(commands[stage], work / "cache")
        report = json.loads((folder / "metrics" / "hidden.json").read_text())
        found[states_dtype] = report["agreement"]["logprobs"]
    return found


@click.command(help=__doc__)
@click.option("--n", default=32, show_default=True, help="Held-out prompts.")
@click.option("--max-new-tokens", default=64, show_default=True, help="Longest answer.")
@click.option(
    "--engine",
    "engines",
    multiple=True,
    default=["hf:float32", "hf:bfloat16", "vllm:float32"],
    show_default=True,
    help="infer's engine and dtype, name:dtype.",
)
@click.option("--states", multiple=True, default=["float32", "bfloat16"], show_default=True, help="hidden's dtype.")
@click.option("--results", "results_file", default=str(ROOT / "results" / "components.jsonl"), show_default=True)
@click.option("--no-results", is_flag=True, help="Print only.")
def main(n, max_new_tokens, engines, states, results_file, no_results):
    values = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        settings = {"prompts": prompts_file(work, n), "max_new_tokens": max_new_tokens}
        for engine in engines:
            for states_dtype, figures in measure(work, engine, list(states), settings).items():
                label = f"{engine.replace(':', ' ')} / {states_dtype}"
                print(f"{label}: {json.dumps(figures)}")
                values[f"{label}: mean"] = Value(value=figures["mean_abs_diff"])
                values[f"{label}: worst sequence"] = Value(value=figures["max_sequence_mean_abs_diff"])
    if no_results:
        return
    name = (
        "hidden's agreement check: |engine - target| log-probability in nats, engine / states dtype "
        "(`bench/bench_agreement.py`)"
    )
    command = " ".join(["python bench/bench_agreement.py", *sys.argv[1:]])
    note = f"{n} held-out prompts, {max_new_tokens} new tokens"
    results.append(provenance.stamp(name, values, command, ROOT / "params.yaml", note), Path(results_file))


if __name__ == "__main__":
    main()
