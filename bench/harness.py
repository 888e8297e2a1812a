"""What the bench scripts share: the turns evaluate decoded, acceptance length on them, and the pipeline's stages
run as dvc.yaml runs them with every output moved into a work folder."""

import json
import os
import shlex
import sys
from pathlib import Path

import yaml

from eaglepipe.core import config, uncertainty
from eaglepipe.core.records import read_jsonl
from eaglepipe.evaluate import decode

STAGES = ["prepare", "infer", "merge", "hidden", "train", "evaluate"]


def decoded_sets(decoded, names=config.BENCHMARKS) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Each benchmark's turns as evaluate decoded them (``data/decoded/<name>.jsonl``): (prompt ids, plain greedy
    output ids), in order; MT-bench's second turns follow the target's own greedy first answer."""
    return {
        name: [(row["prompt_ids"], row["output_ids"]) for _, row in read_jsonl(Path(decoded) / f"{name}.jsonl")]
        for name in names
        if (Path(decoded) / f"{name}.jsonl").exists()
    }


class Turns:
    """One method's acceptance on one set of turns, kept per turn: its length and the standard error over turns
    (eaglepipe/core/uncertainty.py; a turn is the cluster, so MT-bench's two turns of a question count as two)."""

    def __init__(self):
        self.emitted, self.steps = [], []

    def add(self, stats: decode.Stats) -> None:
        self.emitted.append(stats.emitted)
        self.steps.append(stats.steps)

    @property
    def length(self) -> float:
        return sum(self.emitted) / sum(self.steps) if sum(self.steps) else 0.0

    @property
    def se(self) -> float | None:
        se = uncertainty.ratio_se(self.emitted, self.steps)
        return None if se is None else round(se, 4)

    def __str__(self) -> str:
        return f"{self.length:.3f}" + (f" ± {self.se:.3f}" if self.se is not None else "")

    __repr__ = __str__

    def difference(self, first: "Turns") -> tuple[float, float | None]:
        """This length minus ``first``'s (measured on the same turns) and its paired standard error."""
        se = uncertainty.difference_se((self.emitted, self.steps), (first.emitted, first.steps))
        return self.length - first.length, se

    def against(self, first: "Turns") -> str:
        """``difference`` in words, starred where it exceeds twice its standard error."""
        d, se = self.difference(first)
        return f"Δ {d:+.3f} ± {se:.3f}" + ("*" if abs(d) > 2 * se else "") if se is not None else f"Δ {d:+.3f}"


def acceptance(model, drafter, prompts, stops, p) -> Turns:
    """Acceptance of ``drafter`` on each of ``prompts`` with the evaluate params ``p`` (greedy chains)."""
    turns = Turns()
    for ids, _ in prompts:
        stats = decode.Stats()
        decode.speculative(model, drafter, ids, p.max_new_tokens, stops, p.num_steps, stats)
        turns.add(stats)
    return turns


def acceptances(model, drafter, sets: dict, stops, p) -> dict[str, Turns]:
    return {name: acceptance(model, drafter, prompts, stops, p) for name, prompts in sets.items()}


def ngram(sets: dict, stops, p) -> dict[str, Turns]:
    """The n-gram baseline's acceptance on each set, with the evaluate params ``p``, replayed from the plain greedy
    outputs (``decode.replay``)."""
    lengths = {}
    for name, prompts in sets.items():
        lengths[name] = Turns()
        for ids, output in prompts:
            stats = decode.Stats()
            decode.replay(
                decode.NgramDrafter(p.ngram.max, p.ngram.min),
                ids,
                output,
                p.max_new_tokens,
                stops,
                p.num_steps,
                stats,
            )
            lengths[name].add(stats)
    return lengths


def print_table(sets: dict, before: list[str], after: list[str], rows, baseline: dict) -> None:
    """Acceptance lengths as a markdown table: a row per (cells before, {set: Turns}, cells after) in ``rows``, the
    n-gram baseline's row last, each length with its standard error and, after the first row, its difference from
    the first row's; the heading says how many turns each set holds."""
    print(
        f"\nacceptance length ± its standard error over turns, on the turns evaluate decoded "
        f"({', '.join(f'{b} {len(v)}' for b, v in sets.items())}); Δ: against the first row on the same turns, "
        "paired, * where it exceeds twice its standard error"
    )
    print("| " + " | ".join([*before, *sets, *after]) + " |")
    print("|---|" + "---:|" * (len(before) - 1 + len(sets) + len(after)))
    rows = rows + [(["n-gram baseline (no training)"] + [""] * (len(before) - 1), baseline, [""] * len(after))]
    for i, (cells, lengths, tail) in enumerate(rows):
        measured = [str(lengths[b]) + (f" ({lengths[b].against(rows[0][1][b])})" if i else "") for b in sets]
        print("| " + " | ".join([*map(str, cells), *measured, *map(str, tail)]) + " |")


def named(items: list, name: str, key: str) -> dict:
    """The item of ``items`` whose ``name`` is ``name`` (a source, say), for the override ``key``."""
    found = [item for item in items if isinstance(item, dict) and item.get("name") == name]
    if len(found) != 1:
        raise KeyError(f"{key}: {len(found)} items named {name!r}")
    return found[0]


def params_for(base: dict, overrides: dict) -> dict:
    """``base`` (params.yaml as loaded) with ``overrides``: dotted key -> value, a list's item named by its ``name``
    (``prepare.sources.sharegpt.n``); a key ending in ``+`` appends."""
    out = json.loads(json.dumps(base))
    for key, value in overrides.items():
        *path, last = key.rstrip("+").split(".")
        node = out
        for k in path:
            node = named(node, k, key) if isinstance(node, list) else node.setdefault(k, {})
        node[last] = node[last] + value if key.endswith("+") else value
    return out


def stage_commands(work: Path, stages=STAGES, dvc_file: Path = Path("dvc.yaml")) -> dict[str, list[str]]:
    """The dvc.yaml command of each of ``stages``, with params.yaml read from ``work`` and every path these stages
    write (their metrics and timings too) moved under ``work``; what they read and do not write (the sources, the
    held-out prompts, an upstream stage's outputs) stays the project's."""
    all_stages = yaml.safe_load(dvc_file.read_text())["stages"]
    written = {
        str(next(iter(o)) if isinstance(o, dict) else o)
        for name in stages
        for kind in ("outs", "metrics", "plots")
        for o in all_stages[name].get(kind, [])
    }

    def move(token: str) -> str:
        if token == "params.yaml":
            return str(work / "params.yaml")
        moved = token.startswith("metrics/") or any(
            token == w or token.startswith(w.rstrip("/") + "/") for w in written
        )
        return str(work / token) if moved else token

    return {name: [move(t) for t in shlex.split(all_stages[name]["cmd"])] for name in stages}


def env(cache=None, **extra) -> dict:
    """The environment a stage command runs in: this interpreter's bin folder first on PATH (its ``python``), and
    with ``cache`` the stages' resumable work (``EAGLEPIPE_CACHE``, config.CACHE) in that folder."""
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        **({"EAGLEPIPE_CACHE": str(cache)} if cache else {}),
        **extra,
    }


def distributed(commands: dict[str, list[str]]) -> list[str]:
    """The stages whose dvc.yaml command starts them through eaglepipe.core.runtime (torchrun under EAGLEPIPE_NPROC)."""
    return [name for name, cmd in commands.items() if cmd[1:3] == ["-m", "eaglepipe.core.runtime"]]


def train_command(work: Path, hidden: Path, name: str) -> list[str]:
    """The train stage's arguments (after the interpreter) on ``hidden`` and data/sequences, every output named
    ``name`` in ``work``: the model folder, metrics, plots, timings and checkpoints."""
    return [
        "stages/train.py",
        "--params",
        str(work / "params.yaml"),
        "--hidden",
        str(hidden),
        "--sequences",
        "data/sequences",
        "--out",
        str(work / name),
        "--metrics",
        str(work / f"{name}.json"),
        "--plots",
        str(work / f"{name}-plots.json"),
        "--timings",
        str(work / f"{name}-timings.json"),
        "--checkpoints",
        str(work / f"{name}-checkpoints"),
    ]
