"""Prepare: read every prompt source, drop duplicates, sample ``n`` prompts per source, and report what happened.

Stability (downstream caches key on prompt ids):
  * each source takes the first ``n`` of its candidates shuffled by an RNG seeded from ``seed`` and its name:
    another source's ``n``, or a new source, never changes its pick; raising its ``n`` only adds prompts;
  * a candidate whose id is a valid record of an earlier source (or earlier in its own file) is a duplicate,
    removed before sampling: the first source in list order wins, whatever the earlier sources picked.

With ``prepare.exclude_benchmarks`` a record is kept out (counted as ``benchmark``) when a user turn, or a
blank-line-separated part of one, normalised, is a prompt evaluate decodes (``benchmarks.excluded_texts``).
A ``pkg:`` source's report entry names its package and version (``sources.package_file``).
"""

from __future__ import annotations

import logging
import random
from collections import Counter

from eaglepipe.core.config import PACKAGE_PATH
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import Prompt, RecordError, content_id
from eaglepipe.dataset.benchmarks import normalise, user_texts
from eaglepipe.dataset.sources import package_file, read_source, resolve

log = logging.getLogger(__name__)

COUNTS = ("n", "read", "valid", "skipped", "left_out", "benchmark", "duplicates", "selected", "shortfall")
BY_KEY = ("skipped_by_reason", "left_out_by_rule", "rules")


def read_candidates(src, on_error: str, seen: set, excluded: set = frozenset()) -> tuple[list[Prompt], dict]:
    """The valid prompts of one source, in file order, whose ids are not in ``seen`` (they are added to it) and with
    no user turn in ``excluded``; and the source's counts: read, valid, skipped and skipped_by_reason (broken
    records), left_out and left_out_by_rule (no prompt in them), rules (the valid records each conversation rule
    concerns), benchmark (kept out), duplicates, and ``damage`` (``{offset, bytes, records_before}``) for an
    unreadable tail (one record skipped as ``damaged``). Records are streamed; only the candidates are kept."""
    candidates = []
    skipped = Counter()
    left_out = Counter()
    rules = Counter()
    damage = None
    read = 0
    duplicates = 0
    benchmark = 0
    for item in read_source(src.path, src.format, src.name, src.columns, rules):
        read += 1
        if src.max_turns and not isinstance(item, RecordError):
            item = first_turns(item, src.max_turns, rules)
        if isinstance(item, RecordError) and item.left_out:
            log.debug("left out (%s): %s", item.reason, item)
            left_out[item.reason] += 1
        elif isinstance(item, RecordError):
            if on_error == "fail":
                raise item
            log.warning("skipped (%s): %s", item.reason, item)
            skipped[item.reason] += 1
            damage = item.damage or damage
        elif excluded and any(
            normalise(part) in excluded for t in user_texts(item.messages) for part in (t, *t.split("\n\n"))
        ):
            benchmark += 1
        elif item.id in seen:
            duplicates += 1
        else:
            seen.add(item.id)
            candidates.append(item)
    counts = {
        "read": read,
        "valid": read - sum(skipped.values()) - sum(left_out.values()),
        "skipped": sum(skipped.values()),
        "skipped_by_reason": dict(sorted(skipped.items())),
        "left_out": sum(left_out.values()),
        "left_out_by_rule": dict(sorted(left_out.items())),
        "rules": dict(sorted(rules.items())),
        "benchmark": benchmark,
        "duplicates": duplicates,
    }
    return candidates, counts | ({"damage": damage} if damage else {})


def first_turns(prompt: Prompt, k: int, rules: Counter) -> Prompt:
    """The prompt cut after its k-th user turn (``max_turns``), with a new id; counted as ``cut_to_max_turns``."""
    users = [i for i, m in enumerate(prompt.messages) if m["role"] == "user"]
    if len(users) <= k:
        return prompt
    rules["cut_to_max_turns"] += 1
    messages = prompt.messages[: users[k - 1] + 1]
    return Prompt(content_id(messages, prompt.tools), prompt.source, messages, prompt.tools)


def sample(candidates: list, n: int, seed: int, name: str) -> list:
    """``n`` candidates picked by a shuffle seeded from (seed, name), returned in their original order."""
    order = list(range(len(candidates)))
    random.Random(f"{seed}/{name}").shuffle(order)
    return [candidates[i] for i in sorted(order[:n])]


def prepare(cfg, excluded: set = frozenset()) -> tuple[list[Prompt], dict]:
    """All selected prompts (sources in config order, each in file order) and the report for metrics/prepare.json.
    ``cfg``: the ``prepare`` section (config.Prepare); ``excluded``: the benchmark texts to keep out (normalised)."""
    for i, src in enumerate(cfg.sources):  # checked before any is read
        try:
            if not resolve(src.path).exists():
                raise FileNotFoundError(f"no such file {src.path}")
        except FileNotFoundError as e:
            raise UserError(f"prepare.sources[{i}] ({src.name}): {e}") from None
    seen, selected, report = set(), [], {"sources": {}}
    for src in cfg.sources:
        candidates, counts = read_candidates(src, src.on_error or cfg.on_error, seen, excluded)
        picked = sample(candidates, src.n, cfg.seed, src.name)
        if len(picked) < src.n:
            log.warning("source %s: only %d usable records for n=%d", src.name, len(picked), src.n)
        selected += picked
        report["sources"][src.name] = {"n": src.n, **counts, "selected": len(picked), "shortfall": src.n - len(picked)}
        if PACKAGE_PATH.fullmatch(src.path):
            report["sources"][src.name]["package_file"] = package_file(src.path)
    report["totals"] = totals(list(report["sources"].values()))
    if not selected:  # fail here, not in a later stage
        raise UserError(
            f"prepare: no prompt selected from {len(cfg.sources)} source(s) "
            f"({report['totals']['read']} records read, {report['totals']['skipped']} skipped, "
            f"{report['totals']['left_out']} left out)"
        )
    return selected, report


def totals(per_source: list[dict]) -> dict:
    out = {k: sum(s[k] for s in per_source) for k in COUNTS}
    for key in BY_KEY:
        out[key] = dict(sorted(sum((Counter(s[key]) for s in per_source), Counter()).items()))
    return out


def summary(report: dict) -> str:
    """A few human lines: one per source, the totals, the reasons and rules if any, and the damaged files."""
    lines = [
        f"{'source':<12} {'read':>6} {'valid':>6} {'skipped':>8} {'left out':>9} {'bench':>6} {'dups':>5} "
        f"{'selected':>9} {'short':>6}"
    ]
    for name, s in [*report["sources"].items(), ("TOTAL", report["totals"])]:
        lines.append(
            f"{name:<12} {s['read']:>6} {s['valid']:>6} {s['skipped']:>8} {s['left_out']:>9} "
            f"{s['benchmark']:>6} {s['duplicates']:>5} {s['selected']:>9} {s['shortfall']:>6}"
        )
    for key, title in zip(BY_KEY, ("skipped", "left out", "rules")):
        if report["totals"][key]:
            lines.append(f"{title}: " + ", ".join(f"{k} {count}" for k, count in report["totals"][key].items()))
    for name, s in report["sources"].items():
        if "damage" in s:
            d = s["damage"]
            data = " of its decompressed data" if d.get("decompressed") else ""
            lines.append(
                f"damaged: {name} from byte {d['offset']}{data} to its end ({d['bytes']} bytes), "
                f"after {d['records_before']} records"
            )
    return "\n".join(lines)
