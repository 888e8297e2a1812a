"""``make repro`` and ``make <stage>``: ``dvc repro``, in the project's root, with a plan before and a summary after.

Before: the stages DVC will run, in order (``dvc status --with-deps``; the stages below them run too when those
outputs change), each with an estimate: its last wall time here (``metrics/timings/stages.json``, not in git), else
the reference run's (``metrics/reference_timings.json``) scaled by a one-second probe of this machine's float32
matrix speed against the reference machine's.
During: DVC's output passes through, each stage's start stamped with the time spent so far; its wall time is recorded.
After: per benchmark the drafter's acceptance length against the n-gram baseline (``metrics/eval.json``), the serve
check's verdict (``metrics/serve.json``), where the drafter is, and the next commands.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import click
import yaml

MEASURED = Path("metrics/timings/stages.json")
REFERENCE = Path("metrics/reference_timings.json")
EVAL, SERVE, DRAFTER = Path("metrics/eval.json"), Path("metrics/serve.json"), Path("models/draft")
STAGE_LINE = re.compile(r"^(Running stage|Stage) '([^']+)'")  # DVC's lines as a stage starts or is skipped
NEXT = (
    "make metrics   # every figure, one per line",
    "make plots     # training curves, acceptance per position",
    "make diff      # what changed since the last commit",
    "make bench     # the drafter, plain decoding and prompt lookup in vLLM on all held-out, MT-bench, HumanEval",
)


def stage_order() -> list[str]:
    """The stages in dvc.yaml's order, which is the pipeline's (each reads only what a stage above it wrote)."""
    return list(yaml.safe_load(Path("dvc.yaml").read_text())["stages"])


def stale(targets: tuple[str, ...]) -> dict[str, list]:
    """``dvc status --with-deps``: the stages of ``targets`` (all when empty) and above them whose deps, params or
    outputs differ from dvc.lock, with DVC's reasons."""
    out = subprocess.run(
        ["dvc", "status", "--json", "--with-deps", *targets], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out or "{}")


def below(stages: list[str], order: list[str]) -> list[str]:
    """The stages of ``order`` that read, directly or not, an output of one of ``stages``."""
    spec = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]

    def paths(s, key):
        return [next(iter(d)) if isinstance(d, dict) else d for d in spec[s].get(key, [])]

    reached, found = set(stages), []
    for s in order:
        if s not in reached and any(
            dep == out or dep.startswith(out.rstrip("/") + "/")
            for dep in paths(s, "deps")
            for r in reached
            for out in paths(r, "outs")
        ):
            reached.add(s)
            found.append(s)
    return found


def probe(seconds: float = 1.0) -> float:
    """This machine's float32 matrix speed in GFLOP/s (a [256 x 576] by [576 x 1536] product, the embedded target's
    MLP shape, repeated for about ``seconds``), at torch's default thread count."""
    import torch

    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    for _ in range(3):
        a @ b
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        n += 1
    return 2 * 256 * 576 * 1536 * n / elapsed / 1e9


def estimates(names: list[str]) -> dict[str, tuple[float, str]]:
    """Seconds and where they come from, per stage: this machine's last wall time, else the reference run's scaled
    by the probe; a stage with neither has none."""
    measured = json.loads(MEASURED.read_text()) if MEASURED.exists() else {}
    ref = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {"stages": {}}
    out, scale = {}, None
    for name in names:
        if name in measured:
            out[name] = (measured[name]["seconds"], f"its last run here, {measured[name]['at'][:10]}")
        elif name in ref["stages"]:
            if scale is None:
                scale = ref["probe_gflops"] / probe()
            out[name] = (ref["stages"][name] * scale, f"the reference run x {scale:.2f} (probe)")
    return out


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def print_plan(targets: tuple[str, ...]) -> list[str]:
    """Print the stages that will or may run with their estimates; return those that will."""
    order = stage_order()
    changed = stale(targets)
    will = [s for s in order if s in changed]
    wanted = set(order) if not targets else set(changed) | set(targets)
    may = [s for s in below(will, order) if s in wanted]
    if not will:
        click.echo("make repro: every stage is up to date; nothing to run.")
        return []
    est = estimates(will + may)
    click.echo("make repro: the plan")
    for s in order:
        if s in will or s in may:
            how = f"~{minutes(est[s][0])} ({est[s][1]})" if s in est else "no estimate"
            why = "to run" if s in will else "runs if what it reads changes"
            click.echo(f"  {s:<9} {why:<32} {how}")
    if est:
        click.echo(f"  about {minutes(sum(t for t, _ in est.values()))} in all, if every stage listed runs")
    click.echo()
    return will


def run(targets: tuple[str, ...]) -> int:
    """``dvc repro`` on ``targets``, its output passed through; each stage's wall time is added to MEASURED."""
    start = last = time.monotonic()
    current, timed = None, {}
    proc = subprocess.Popen(["dvc", "repro", *targets], stdout=subprocess.PIPE, text=True, bufsize=1)
    for line in proc.stdout:
        m = STAGE_LINE.match(line)
        now = time.monotonic()
        if current and (m or line.startswith("Updating lock file")):
            timed[current] = now - last
            current = None
        if m and m.group(1) == "Running stage":
            current, last = m.group(2), now
            line = line.rstrip("\n") + f"  [{minutes(now - start)} in]\n"
        sys.stdout.write(line)
        sys.stdout.flush()
    code = proc.wait()
    if current and code == 0:
        timed[current] = time.monotonic() - last
    if timed:
        measured = json.loads(MEASURED.read_text()) if MEASURED.exists() else {}
        at = datetime.now(UTC).isoformat(timespec="seconds")
        measured.update({s: {"seconds": round(t, 1), "at": at} for s, t in timed.items()})
        MEASURED.parent.mkdir(parents=True, exist_ok=True)
        MEASURED.write_text(json.dumps(measured, indent=2) + "\n")
    click.echo(
        f"\nmake repro: {'done' if code == 0 else f'failed (exit {code})'} in "
        f"{minutes(time.monotonic() - start)}" + "".join(f"; {s} {minutes(t)}" for s, t in timed.items())
    )
    if code:
        click.echo("make repro: the failing stage's message is above; a rerun resumes, keeping what finished.")
    return code


def summary() -> str:
    """The figures the run was for, from the metrics files, and what to do next."""
    lines = []
    if EVAL.exists():
        ev = json.loads(EVAL.read_text())
        lines.append(
            "acceptance length (tokens per target forward, greedy; ± one standard error over conversations),"
            " the drafter against prompt lookup (n-gram):"
        )
        for name, b in ev["benchmarks"].items():
            diff = b["acceptance_length"] - b["baseline_acceptance_length"]
            verdict = ("beats n-gram" if diff > 0 else "loses to n-gram") + (
                " by more than twice the error"
                if abs(diff) > 2 * (b.get("difference_se") or float("inf"))
                else ", within twice the error"
            )
            lines.append(
                f"  {name:<10} {b['acceptance_length']:.3f} ± {b.get('acceptance_length_se') or 0:.3f} vs "
                f"{b['baseline_acceptance_length']:.3f} ± {b.get('baseline_acceptance_length_se') or 0:.3f}: "
                f"{verdict} ({b['prompts']} conversations, {b['turns']} turns; lossless: {b['lossless']})"
            )
    if SERVE.exists():
        sv = json.loads(SERVE.read_text())
        lines.append(
            f"serve check (vLLM serving the drafter): {'passed' if sv['passed'] else 'FAILED'}, acceptance "
            f"length {sv['acceptance_length']:.3f} against evaluate's {sv['evaluate_acceptance_length']:.3f},"
            f" outputs equal to plain greedy: {sv['outputs_equal']}"
        )
    if DRAFTER.exists():
        lines.append(f"the drafter: {DRAFTER}/ (an EAGLE-3 checkpoint vLLM and SGLang load as it is)")
    return "\n".join(lines + ["next:"] + [f"  {c}" for c in NEXT])


@click.command(help=__doc__)
@click.argument("targets", nargs=-1)
@click.option("--dry", is_flag=True, help="Print the plan and stop.")
def main(targets, dry):
    will = print_plan(targets)
    if dry:
        return
    code = run(targets) if will else 0
    if code == 0 and (not targets or {"evaluate", "serve"} & set(targets)):
        click.echo("\n" + summary())
    sys.exit(code)


if __name__ == "__main__":
    main()
