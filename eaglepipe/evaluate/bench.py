"""The logic of ``make bench`` (bench/bench_vllm.py, its command line): the whole benchmark sets decoded in vLLM by
plain decoding, the trained drafter (eagle3), prompt lookup (ngram) and any other drafter, and their figures.

The sets (SETS): all of evaluate's held-out prompts, MT-bench's 80 questions (turn 2 asked after the target's own
greedy turn-1 answer, as evaluate asks it) and HumanEval's 164 problems, each answered greedily. Acceptance length is
evaluate's: tokens emitted over decode steps, where a step that proposed nothing emits one token (``steps_of``), with
its standard error over conversations (eaglepipe/core/uncertainty.py). Per benchmark, per category and, for
MT-bench, per turn (``groups``): acceptance length, outputs equal to plain decoding's (``report``); paired
differences between methods (``versus``); where a straight line in log2 of the trained tokens through two drafters
reaches prompt lookup (``crossings``); per method tokens/s and its ratio to plain decoding's (``add_speeds``).
"""

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from eaglepipe.core import config, uncertainty
from eaglepipe.dataset import benchmarks
from eaglepipe.drafter.methods import speculative_config
from eaglepipe.engines import Sampling
from eaglepipe.evaluate import serve
from eaglepipe.evaluate.run import Chat
from eaglepipe.target.model import stop_ids
from eaglepipe.text import derive

SETS = ("heldout", "mtbench", "humaneval")


def methods(e: config.Evaluate, draft: Path, against: dict[str, Path]) -> dict[str, dict]:
    """The speculative configs compared with plain decoding: the drafter, prompt lookup, then each other drafter
    (``eagle3:<label>``)."""
    return {
        "eagle3": speculative_config(draft, e.num_steps),
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": e.num_steps,
            "prompt_lookup_max": e.ngram.max,
            "prompt_lookup_min": e.ngram.min,
        },
        **{f"eagle3:{label}": speculative_config(path, e.num_steps) for label, path in against.items()},
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


@dataclass(frozen=True)
class Settings:
    """How the sets are decoded: the held-out prompts (evaluate's ``--prompts``), new tokens per turn, requests in
    flight, and at most ``limit`` conversations of each benchmark (a smoke run; None: all of them)."""

    heldout: Path
    max_new_tokens: int
    concurrency: int
    limit: int | None = None


def benchmark_sets(chat, settings: Settings) -> dict[str, dict]:
    """Per benchmark of SETS: its conversations, the rows to decode (every turn 1 for now) and each method's decoded
    outputs (none yet)."""
    sets = {}
    for name in SETS:
        conversations, _ = benchmarks.select({name: config.Benchmark(n=None)}, settings.heldout, settings.limit)
        sets[name] = {"conversations": conversations, "rows": turns_of(conversations, chat), "decoded": {}}
    return sets


def decode_plain(server, sets: dict, chat, sampling: Sampling) -> dict[str, dict]:
    """Plain decoding of every set: turn 1, then each turn 2 after the target's own turn-1 answer (added to the
    set's rows, its plain outputs kept as ``plain``); per set its seconds and tokens."""
    timed = {}
    for name, s in sets.items():
        first = server.decode(s["rows"], sampling)
        answers = {r["conversation"]: chat.answer(r["prompt_ids"], o) for r, o in zip(s["rows"], first["outputs"])}
        second = turns_of(s["conversations"], chat, answers)
        for j, r in enumerate(second):
            r["index"] = len(s["rows"]) + j
        s["rows"] += second
        rest = server.decode(second, sampling) if second else {"outputs": [], "seconds": 0.0, "tokens": 0}
        s["plain"] = first["outputs"] + rest["outputs"]
        timed[name] = {"seconds": first["seconds"] + rest["seconds"], "tokens": first["tokens"] + rest["tokens"]}
        logging.info("plain %s: %d turns", name, len(s["rows"]))
    return timed


def decode_method(server, sets: dict, method: str, sampling: Sampling) -> dict[str, dict]:
    """Every set's rows decoded by ``method`` (kept in the set's ``decoded``); per set its seconds, tokens and
    ``report``."""
    figures = {}
    for name, s in sets.items():
        got = s["decoded"][method] = server.decode(s["rows"], sampling)
        figures[name] = {
            "seconds": got["seconds"],
            "tokens": got["tokens"],
            **report(s["conversations"], s["rows"], got, s["plain"]),
        }
        logging.info("%s %s: acceptance length %s", method, name, figures[name]["acceptance_length"])
    return figures


def add_speeds(results: dict) -> None:
    """Each method's tokens/s and its ratio to plain decoding's, per benchmark; seconds rounded."""
    for by_method in results.values():
        plain_tps = by_method["plain"]["tokens"] / by_method["plain"]["seconds"]
        for m in by_method.values():
            m["tokens_per_s"] = round(m["tokens"] / m["seconds"], 2)
            m["speedup"] = round(m["tokens_per_s"] / plain_tps, 3)
            m["seconds"] = round(m["seconds"], 2)


def run(cfg: config.Params, folder, tokenizer, compared: Compared, settings: Settings) -> dict:
    """Plain decoding, then each method of ``compared``, on every set of SETS, each method in a vLLM server of its
    own; the figures as make bench writes them: per benchmark and method (``report``, with speeds), the paired
    differences (``versus``), the crossings (``crossings``)."""
    e = cfg.evaluate
    stops = stop_ids(folder, tokenizer)
    spec = derive.spec_from_params(cfg.target.reasoning)
    chat = Chat(tokenizer, cfg.target.chat_template_kwargs, spec, stops)
    sampling = Sampling(temperature=0.0, max_new_tokens=settings.max_new_tokens, stop_token_ids=tuple(sorted(stops)))
    sets = benchmark_sets(chat, settings)
    with serve.Served(folder, tokenizer, cfg.serve, run="bench-plain", concurrency=settings.concurrency) as server:
        plain = decode_plain(server, sets, chat, sampling)
    results = {name: {"plain": plain[name]} for name in SETS}
    ran = []
    for method, speculative in methods(e, compared.draft, compared.against).items():
        if compared.only and method.split(":")[0] not in compared.only:
            continue
        ran.append(method)
        with serve.Served(folder, tokenizer, cfg.serve, speculative, f"bench-{method}", settings.concurrency) as server:
            for name, figures in decode_method(server, sets, method, sampling).items():
                results[name][method] = figures
    paired = {
        f"{a} - {b}": {
            name: versus(s["conversations"], s["rows"], s["decoded"][a], s["decoded"][b]) for name, s in sets.items()
        }
        for a, b in comparisons(ran)
    }
    add_speeds(results)
    return {
        "max_new_tokens": settings.max_new_tokens,
        "concurrency": settings.concurrency,
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
