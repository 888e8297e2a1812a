"""``make repro`` and ``make <stage>``: ``dvc repro``, in the project's root, with a plan before and a summary after.

Every path is the project's (the folder above this package), whatever the working directory.
Before: the stages DVC will run, in order (``dvc status --with-deps``; the stages below them run too when those
outputs change), each with an estimate and where it comes from: its last wall time here
(``metrics/timings/stages.json``, not in git), else the newest ``make repro`` in ``results/`` of this machine's class
(GPU, AVX-512 with AMX, AVX-512, AVX2 only: eaglepipe/tools/results.py), else the reference run's
(``metrics/reference_timings.json``) scaled by a one-second probe of this machine's float32 matrix speed against the
reference machine's.
During: DVC's output passes through, each stage's start stamped with the time spent so far; its wall time is recorded.
After: per benchmark the drafter's acceptance length against the n-gram baseline (``metrics/eval.json``), the serve
check's verdict (``metrics/serve.json``), where the drafter is, and the next commands. A run of every stage appends
its wall time and stage times to ``results/repro.jsonl``, and a run of evaluate its acceptance lengths to
``results/evaluate.jsonl``, each with this machine, the commit and the params hash.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import click
import yaml

from eaglepipe.core.codedeps import ROOT
from eaglepipe.tools import provenance, results

STAGE_LINE = re.compile(r"^(Running stage|Stage) '([^']+)'")  # DVC's lines as a stage starts or is skipped
NEXT = (
    "make metrics   # every figure, one per line",
    "make plots     # training curves, acceptance per position",
    "make diff      # what changed since the last commit",
    "make bench     # the drafter, plain decoding and prompt lookup in vLLM on all held-out, MT-bench, HumanEval",
)


@dataclass(frozen=True)
class Project:
    """The files make repro reads and writes, under the project's root."""

    root: Path = ROOT

    @property
    def measured(self) -> Path:
        return self.root / "metrics/timings/stages.json"

    @property
    def reference(self) -> Path:
        return self.root / "metrics/reference_timings.json"

    @property
    def evaluation(self) -> Path:
        return self.root / "metrics/eval.json"

    @property
    def serve(self) -> Path:
        return self.root / "metrics/serve.json"

    @property
    def drafter(self) -> Path:
        return self.root / "models/draft"

    @property
    def results(self) -> Path:
        return self.root / "results"

    def pipeline(self) -> dict:
        """dvc.yaml's stages."""
        return yaml.safe_load((self.root / "dvc.yaml").read_text())["stages"]


@dataclass(frozen=True)
class Estimate:
    """A stage's expected wall seconds and where the figure comes from."""

    seconds: float
    source: str


@dataclass(frozen=True)
class Run:
    """What ``dvc repro`` did: its exit code and the wall seconds of each stage that ran, in order."""

    code: int
    timed: dict[str, float]


def stage_order(project: Project) -> list[str]:
    """The stages in dvc.yaml's order, which is the pipeline's (each reads only what a stage above it wrote)."""
    return list(project.pipeline())


def stale(targets: tuple[str, ...], project: Project) -> dict[str, list]:
    """``dvc status --with-deps``: the stages of ``targets`` (all when empty) and above them whose deps, params or
    outputs differ from dvc.lock, with DVC's reasons."""
    out = subprocess.run(
        ["dvc", "status", "--json", "--with-deps", *targets],
        cwd=project.root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out or "{}")


def below(stages: list[str], order: list[str], project: Project) -> list[str]:
    """The stages of ``order`` that read, directly or not, an output of one of ``stages``."""
    spec = project.pipeline()

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


def of_this_class(project: Project, kind: str) -> dict[str, Estimate]:
    """Each stage's wall seconds in the newest ``make repro`` of results/ run on a machine of class ``kind``."""
    record = results.latest_of_kind(results.named(results.load(project.results), "make repro"), kind)
    if record is None:
        return {}
    source = f"make repro of {record.commit} on {record.machine.cpu} ({results.KINDS[kind]}), {record.date}"
    prefix = "seconds."
    return {
        key.removeprefix(prefix): Estimate(value.value, source)
        for key, value in record.values.items()
        if key.startswith(prefix) and key != "seconds.wall"
    }


def estimates(names: list[str], project: Project, kind: str) -> dict[str, Estimate]:
    """Per stage: this machine's last wall time, else results/' of machines of class ``kind``, else the reference
    run's scaled by the probe; a stage with none of them has no estimate."""
    measured = json.loads(project.measured.read_text()) if project.measured.exists() else {}
    same_class = of_this_class(project, kind)
    reference = json.loads(project.reference.read_text()) if project.reference.exists() else {"stages": {}}
    out, scale = {}, None
    for name in names:
        if name in measured:
            out[name] = Estimate(measured[name]["seconds"], f"its last run here, {measured[name]['at'][:10]}")
        elif name in same_class:
            out[name] = same_class[name]
        elif name in reference["stages"]:
            if scale is None:
                scale = reference["probe_gflops"] / probe()
            out[name] = Estimate(reference["stages"][name] * scale, f"the reference run x {scale:.2f} (probe)")
    return out


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def print_plan(targets: tuple[str, ...], project: Project) -> list[str]:
    """Print the stages that will or may run with their estimates; return those that will."""
    order = stage_order(project)
    changed = stale(targets, project)
    will = [s for s in order if s in changed]
    wanted = set(order) if not targets else set(changed) | set(targets)
    may = [s for s in below(will, order, project) if s in wanted]
    if not will:
        click.echo("make repro: every stage is up to date; nothing to run.")
        return []
    est = estimates(will + may, project, provenance.this_machine().kind)
    click.echo("make repro: the plan")
    for s in order:
        if s in will or s in may:
            how = f"~{minutes(est[s].seconds)} ({est[s].source})" if s in est else "no estimate"
            why = "to run" if s in will else "runs if what it reads changes"
            click.echo(f"  {s:<9} {why:<32} {how}")
    if est:
        click.echo(f"  about {minutes(sum(e.seconds for e in est.values()))} in all, if every stage listed runs")
    click.echo()
    return will


def record_timings(timed: dict[str, float], project: Project) -> None:
    """Each timed stage's seconds, with the time now, into this machine's timings (``Project.measured``)."""
    measured = json.loads(project.measured.read_text()) if project.measured.exists() else {}
    at = datetime.now(UTC).isoformat(timespec="seconds")
    measured.update({s: {"seconds": round(t, 1), "at": at} for s, t in timed.items()})
    project.measured.parent.mkdir(parents=True, exist_ok=True)
    project.measured.write_text(json.dumps(measured, indent=2) + "\n")


def run(targets: tuple[str, ...], project: Project) -> Run:
    """``dvc repro`` on ``targets``, its output passed through; each stage's wall time is added to the timings."""
    start = last = time.monotonic()
    current, timed = None, {}
    proc = subprocess.Popen(["dvc", "repro", *targets], cwd=project.root, stdout=subprocess.PIPE, text=True, bufsize=1)
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
        record_timings(timed, project)
    click.echo(
        f"\nmake repro: {'done' if code == 0 else f'failed (exit {code})'} in "
        f"{minutes(time.monotonic() - start)}" + "".join(f"; {s} {minutes(t)}" for s, t in timed.items())
    )
    if code:
        click.echo("make repro: the failing stage's message is above; a rerun resumes, keeping what finished.")
    return Run(code, timed)


def record_results(finished: Run, wall: float, command: str, project: Project) -> None:
    """Append to results/ what a successful run measured: the wall and stage seconds when every stage ran, the
    acceptance lengths when evaluate ran."""
    params = project.root / "params.yaml"
    if set(finished.timed) == set(stage_order(project)):
        values = {"seconds.wall": results.figure(wall, digits=1)}
        values |= {f"seconds.{s}": results.figure(t, digits=1) for s, t in finished.timed.items()}
        results.append(provenance.stamp("make repro", values, command, params), project.results / "repro.jsonl")
        click.echo(f"make repro: its wall time and stage times appended to {project.results / 'repro.jsonl'}")
    if "evaluate" in finished.timed and project.evaluation.exists():
        values = results.from_eval(json.loads(project.evaluation.read_text()))
        results.append(provenance.stamp("evaluate", values, command, params), project.results / "evaluate.jsonl")
        click.echo(f"make repro: evaluate's figures appended to {project.results / 'evaluate.jsonl'}")


def summary(project: Project) -> str:
    """The figures the run was for, from the metrics files, and what to do next."""
    lines = []
    if project.evaluation.exists():
        ev = json.loads(project.evaluation.read_text())
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
    if project.serve.exists():
        sv = json.loads(project.serve.read_text())
        lines.append(
            f"serve check (vLLM serving the drafter): {'passed' if sv['passed'] else 'FAILED'}, acceptance "
            f"length {sv['acceptance_length']:.3f} against evaluate's {sv['evaluate_acceptance_length']:.3f},"
            f" outputs equal to plain greedy: {sv['outputs_equal']}"
        )
    if project.drafter.exists():
        lines.append(
            f"the drafter: {project.drafter.relative_to(project.root)}/ (an EAGLE-3 checkpoint vLLM and "
            "SGLang load as it is)"
        )
    return "\n".join(lines + ["next:"] + [f"  {c}" for c in NEXT])


def command_of(targets: tuple[str, ...], since: float | None) -> str:
    """The command a results record names: ``make repro`` (or ``make <stage>``) where the Makefile started this with
    ``--since``, else this module's own command line."""
    if since is not None:
        return "make " + " ".join(targets or ("repro",))
    return " ".join(["python -m eaglepipe.tools.repro", *targets])


@click.command(help=__doc__)
@click.argument("targets", nargs=-1)
@click.option("--dry", is_flag=True, help="Print the plan and stop.")
@click.option(
    "--since",
    type=float,
    default=None,
    help="When the command began, in seconds since the epoch (make repro passes the time before it set up the "
    "environments): the wall time results/ records counts from it [default: this program's start].",
)
def main(targets, dry, since):
    started = time.time() if since is None else since
    project = Project()
    try:
        will = print_plan(targets, project)
    except results.ResultsError as e:
        raise click.ClickException(str(e)) from None
    if dry:
        return
    finished = run(targets, project) if will else Run(0, {})
    if finished.code == 0 and finished.timed:
        record_results(finished, time.time() - started, command_of(targets, since), project)
    if finished.code == 0 and (not targets or {"evaluate", "serve"} & set(targets)):
        click.echo("\n" + summary(project))
    sys.exit(finished.code)


if __name__ == "__main__":
    main()
