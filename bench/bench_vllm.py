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
check. Writes the figures as JSON (``--out``) and prints the table.
"""

import logging
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import click

from eaglepipe.core import config, uncertainty
from eaglepipe.core.records import write_json
from eaglepipe.dataset import benchmarks
from eaglepipe.engines import Sampling
from eaglepipe.evaluate import run as evaluate
from eaglepipe.evaluate import serve
from eaglepipe.target import model as target
from eaglepipe.text import derive

SETS = ("heldout", "mtbench", "humaneval")


def methods(e: config.Evaluate, draft: Path, against: dict[str, Path]) -> dict[str, dict]:
    """The speculative configs compared with plain decoding: the drafter, prompt lookup, then each other drafter
    (``eagle3:<label>``)."""
    return {
        "eagle3": serve.eagle3(draft, e.num_steps),
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": e.num_steps,
            "prompt_lookup_max": e.ngram.max,
            "prompt_lookup_min": e.ngram.min,
        },
        **{f"eagle3:{label}": serve.eagle3(path, e.num_steps) for label, path in against.items()},
    }


def comparisons(methods: list[str]) -> list[tuple[str, str]]:
    """The paired differences reported, (a, b) for a − b: every drafter against prompt lookup, each other drafter
    against the drafter."""
    drafters = [m for m in methods if m.startswith("eagle3")]
    return [(m, "ngram") for m in drafters if "ngram" in methods] + [
        (m, "eagle3") for m in drafters if m != "eagle3" and "eagle3" in methods
    ]


def turns_of(conversations, chat, answers: dict | None = None) -> list[dict]:
    """Rows to decode: every conversation's turn 1, or with ``answers`` (turn-1 assistant messages by conversation
    position) the turn 2 of those that have one."""
    rows = []
    for i, c in enumerate(conversations):
        if answers is None or (c.turns > 1 and i in answers):
            turn = 1 if answers is None else 2
            ids = chat.ids(c.messages_for([] if answers is None else [answers[i]]), c.tools)
            rows.append({"index": len(rows), "conversation": i, "turn": turn, "prompt_ids": ids})
    return rows


def steps_of(output: list, spec: dict) -> int:
    """A request's decode steps after the prefill: vLLM counts only the steps that proposed drafts (``num_spec_steps``,
    S, with A accepted drafts); each other step emitted one token, so there were ``len(output) - 1 - A - S`` of them.
    vLLM also counts drafts accepted past the stop id or the length limit on a request's last step, which can hide up
    to ``num_speculative_tokens`` draft-less steps of a request (prompt lookup's; the drafter proposes every step)."""
    s, a = spec["num_spec_steps"], spec["num_accepted_draft_tokens"]
    return s + max(0, len(output) - 1 - a - s)


def per_conversation(rows: list[dict], decoded: dict, idx: list[int]) -> tuple[list, list]:
    """Tokens emitted and decode steps per conversation over rows ``idx`` of one method's run, in conversation
    order."""
    emitted, steps = defaultdict(int), defaultdict(int)
    for i in idx:
        emitted[rows[i]["conversation"]] += len(decoded["outputs"][i]) - 1
        steps[rows[i]["conversation"]] += steps_of(decoded["outputs"][i], decoded["spec"][i])
    keys = sorted(emitted)
    return [emitted[k] for k in keys], [steps[k] for k in keys]


def groups(conversations, rows) -> list[tuple[str | None, str | None, list[int]]]:
    """The groups a benchmark is reported by, as (kind, key, row indices): the whole set (None, None), each category
    (``per_category``) where there are several, each turn (``per_turn``) where there are several."""
    out = [(None, None, list(range(len(rows))))]
    categories = sorted({conversations[r["conversation"]].category for r in rows})
    if len(categories) > 1:
        out += [
            ("per_category", c, [i for i, r in enumerate(rows) if conversations[r["conversation"]].category == c])
            for c in categories
        ]
    if len({r["turn"] for r in rows}) > 1:
        out += [("per_turn", str(t), [i for i, r in enumerate(rows) if r["turn"] == t]) for t in (1, 2)]
    return out


def place(out: dict, kind: str | None, key: str | None, figures: dict) -> None:
    """Put a group's figures where ``groups`` says: the whole set's at the top, the others under kind -> key."""
    if kind is None:
        out.update(figures)
    else:
        out.setdefault(kind, {})[key] = figures


def report(conversations, rows, decoded: dict, plain: list) -> dict:
    """Per group (``groups``): acceptance length with its error over conversations, outputs equal to plain."""
    out = {}
    for kind, key, idx in groups(conversations, rows):
        e, n = per_conversation(rows, decoded, idx)
        se = uncertainty.ratio_se(e, n)
        place(
            out,
            kind,
            key,
            {
                "turns": len(idx),
                "equal_to_plain": sum(decoded["outputs"][i] == plain[i] for i in idx),
                "acceptance_length": round(sum(e) / sum(n), 4) if sum(n) else None,
                "acceptance_length_se": None if se is None else round(se, 4),
            },
        )
    return out


def versus(conversations, rows, a: dict, b: dict) -> dict:
    """Per group, placed as ``report`` places it: method a's acceptance length minus method b's on the same
    conversations, with the paired standard error (uncertainty.difference_se) and whether the difference exceeds
    twice it."""
    out = {}
    for kind, key, idx in groups(conversations, rows):
        x, y = per_conversation(rows, a, idx), per_conversation(rows, b, idx)
        if not sum(x[1]) or not sum(y[1]):
            place(out, kind, key, {"difference": None, "se": None, "beyond_2se": False})
            continue
        diff, se = sum(x[0]) / sum(x[1]) - sum(y[0]) / sum(y[1]), uncertainty.difference_se(x, y)
        place(
            out,
            kind,
            key,
            {
                "difference": round(diff, 4),
                "se": None if se is None else round(se, 4),
                "beyond_2se": se is not None and abs(diff) > 2 * se,
            },
        )
    return out


def crossings(sets: dict, ratios: dict[str, float]) -> dict:
    """Per drafter ``eagle3:LABEL`` whose trained tokens are RATIO times the drafter's (``ratios``), per benchmark and
    group (``place``): where a straight line in log2(trained tokens) through the two drafters' acceptance lengths
    reaches prompt lookup's (uncertainty.extrapolate, paired over the conversations): ``slope`` per doubling, ``gap``
    (prompt lookup's lead over LABEL's drafter) and ``beyond`` (doublings beyond LABEL's drafter, negative where the
    line crossed before it; None where the slope is not positive), each with its SE."""
    out = {}
    for label, ratio in ratios.items():
        for name, s in sets.items():
            for kind, key, idx in groups(s["conversations"], s["rows"]):
                lo, hi, goal = (
                    per_conversation(s["rows"], s["decoded"][m], idx) for m in ("eagle3", f"eagle3:{label}", "ngram")
                )
                x = (
                    uncertainty.extrapolate(lo, hi, goal, math.log2(ratio))
                    if all(sum(steps) for _, steps in (lo, hi, goal))
                    else {}
                )
                place(
                    out.setdefault(label, {}).setdefault(name, {}),
                    kind,
                    key,
                    {
                        k: None if x.get(k) is None or math.isinf(x[k]) else round(x[k], 4)
                        for k in ("slope", "slope_se", "gap", "gap_se", "beyond", "beyond_se")
                    },
                )
    return out


def flat(by_group: dict) -> list[tuple[str, dict]]:
    """``report``'s or ``versus``'s groups as (label, figures) rows: all, each turn, each category."""
    return (
        [("all", by_group)]
        + [(f"turn {k}", v) for k, v in by_group.get("per_turn", {}).items()]
        + list(by_group.get("per_category", {}).items())
    )


@dataclass(frozen=True)
class Compared:
    """What is decoded besides plain decoding: the trained drafter (``draft``), the other drafters by label
    (``against``), the methods to run (``only``, by their name before any ``:``; all when empty) and the crossings to
    extrapolate (``ratios``: label -> its drafter's trained tokens over the drafter's, ``crossings``)."""

    draft: Path
    against: dict[str, Path] = field(default_factory=dict)
    only: tuple = ()
    ratios: dict[str, float] = field(default_factory=dict)


def run(
    cfg,
    folder,
    tokenizer,
    compared: Compared,
    heldout: Path,
    max_new: int,
    concurrency: int,
    limit: int | None = None,
) -> dict:
    e = cfg.evaluate
    stops = target.stop_ids(folder, tokenizer)
    chat = evaluate.Chat(
        tokenizer, cfg.target.chat_template_kwargs, derive.spec_from_params(cfg.target.reasoning), stops
    )
    sampling = Sampling(temperature=0.0, max_new_tokens=max_new, stop_token_ids=tuple(sorted(stops)))
    sets = {}
    for name in SETS:
        conversations, _ = benchmarks.select({name: config.Benchmark(n=None)}, heldout, limit)
        sets[name] = {"conversations": conversations, "rows": turns_of(conversations, chat), "decoded": {}}
    results = {name: {} for name in SETS}
    with serve.Served(folder, tokenizer, cfg.serve, run="bench-plain", concurrency=concurrency) as server:
        for name, s in sets.items():  # turn 1, then each turn 2 after the target's own turn-1 answer
            first = server.decode(s["rows"], sampling)
            answers = {r["conversation"]: chat.answer(r["prompt_ids"], o) for r, o in zip(s["rows"], first["outputs"])}
            second = turns_of(s["conversations"], chat, answers)
            for j, r in enumerate(second):
                r["index"] = len(s["rows"]) + j
            s["rows"] += second
            rest = server.decode(second, sampling) if second else {"outputs": [], "seconds": 0.0, "tokens": 0}
            s["plain"] = first["outputs"] + rest["outputs"]
            results[name]["plain"] = {
                "seconds": first["seconds"] + rest["seconds"],
                "tokens": first["tokens"] + rest["tokens"],
            }
            logging.info("plain %s: %d turns", name, len(s["rows"]))
    ran = []
    for method, spec in methods(e, compared.draft, compared.against).items():
        if compared.only and method.split(":")[0] not in compared.only:
            continue
        ran.append(method)
        with serve.Served(folder, tokenizer, cfg.serve, spec, f"bench-{method}", concurrency) as server:
            for name, s in sets.items():
                got = s["decoded"][method] = server.decode(s["rows"], sampling)
                results[name][method] = {
                    "seconds": got["seconds"],
                    "tokens": got["tokens"],
                    **report(s["conversations"], s["rows"], got, s["plain"]),
                }
                logging.info("%s %s: acceptance length %s", method, name, results[name][method]["acceptance_length"])
    paired = {
        f"{a} - {b}": {
            name: versus(s["conversations"], s["rows"], s["decoded"][a], s["decoded"][b]) for name, s in sets.items()
        }
        for a, b in comparisons(ran)
    }
    for by_method in results.values():
        plain_tps = by_method["plain"]["tokens"] / by_method["plain"]["seconds"]
        for m in by_method.values():
            m["tokens_per_s"] = round(m["tokens"] / m["seconds"], 2)
            m["speedup"] = round(m["tokens_per_s"] / plain_tps, 3)
            m["seconds"] = round(m["seconds"], 2)
    return {
        "max_new_tokens": max_new,
        "concurrency": concurrency,
        "num_steps": e.num_steps,
        "ngram": {"max": e.ngram.max, "min": e.ngram.min},
        "benchmarks": results,
        "paired": paired,
        "crossing": crossings(sets, compared.ratios),
    }


def figure(value: float | None, se: float | None, signed: bool = False) -> str:
    """A figure and its standard error for the table; n/a where either is unknown."""
    if value is None:
        return "n/a"
    return f"{value:{'+' if signed else ''}.3f} ± " + ("n/a" if se is None else f"{se:.3f}")


def table(result: dict) -> str:
    lines = [
        "| benchmark | group | method | acceptance length ± SE | equal to plain | tokens/s | vs plain |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, by_method in result["benchmarks"].items():
        for method, m in by_method.items():
            if method == "plain":
                lines.append(f"| {name} | all | plain | 1 | | {m['tokens_per_s']} | 1.00 |")
                continue
            for group, g in flat(m):
                speed = [str(m["tokens_per_s"]), f"{m['speedup']:.2f}"] if group == "all" else ["", ""]
                lines.append(
                    f"| {name} | {group} | {method} | "
                    f"{figure(g['acceptance_length'], g['acceptance_length_se'])} | "
                    f"{g['equal_to_plain']}/{g['turns']} | " + " | ".join(speed) + " |"
                )
    if result["paired"]:
        lines += [
            "",
            "| a − b | benchmark | group | difference ± SE (paired over conversations) | beyond 2 SE |",
            "|---|---|---|---:|---|",
        ]
        lines += [
            f"| {pair} | {name} | {group} | {figure(d['difference'], d['se'], signed=True)} | "
            f"{'yes' if d['beyond_2se'] else 'no'} |"
            for pair, by_name in result["paired"].items()
            for name, by_group in by_name.items()
            for group, d in flat(by_group)
        ]
    if result.get("crossing"):
        lines += [
            "",
            "| drafter | benchmark | group | τ per doubling of the trained tokens ± SE | "
            "n-gram ahead by ± SE | doublings beyond it to n-gram ± SE |",
            "|---|---|---|---:|---:|---:|",
        ]
        lines += [
            f"| eagle3:{label} | {name} | {group} | {figure(c['slope'], c['slope_se'], signed=True)} | "
            f"{figure(c['gap'], c['gap_se'], signed=True)} | "
            f"{figure(c['beyond'], c['beyond_se']) if c['beyond'] is not None else 'never (slope <= 0)'} |"
            for label, by_name in result["crossing"].items()
            for name, by_group in by_name.items()
            for group, c in flat(by_group)
        ]
    return "\n".join(lines)


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
def main(  # noqa: PLR0913  click passes one argument per option: the signature is the command line
    params, draft, prompts, max_new_tokens, concurrency, only, against, crossing, limit, out
):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = config.load(params)
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
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    result = run(
        cfg,
        folder,
        target.load_tokenizer(folder),
        Compared(Path(draft).resolve(), {label: Path(path).resolve() for label, path in others.items()}, only, ratios),
        Path(prompts),
        max_new_tokens or cfg.evaluate.max_new_tokens,
        concurrency,
        limit,
    )
    write_json(out, result)
    print(table(result))


if __name__ == "__main__":
    main()
