"""Prepare: read every prompt source, drop duplicates, sample ``n`` prompts per source, and report what happened.

Stability rules (downstream caches key on prompt ids, so a selection must not move for unrelated reasons):
  * each source is sampled with its own RNG, seeded from ``seed`` and the source's name, and takes the first ``n``
    of a shuffled candidate list: changing another source's ``n``, or adding a source, never changes this source's
    pick, and raising this source's ``n`` only adds prompts;
  * duplicates (same id) are removed from a source's candidates before sampling, against every valid record of the
    sources listed before it (and earlier records of its own file), so the first source in list order wins and the
    result does not depend on what the earlier sources happened to pick.
"""
from __future__ import annotations

import logging
import random
from collections import Counter
from pathlib import Path

from eaglepipe.errors import UserError
from eaglepipe.records import Prompt, RecordError
from eaglepipe.sources import read_source

log = logging.getLogger(__name__)

COUNTS = ("n", "read", "valid", "skipped", "duplicates", "selected", "shortfall")


def read_candidates(src, on_error: str, seen: set) -> tuple[list[Prompt], dict]:
    """The valid prompts of one source whose ids are not in ``seen``, in file order (their ids are added to it), and
    the source's counts: read, valid, skipped, skipped_by_reason, duplicates, and ``damage`` (``{offset, bytes,
    records_before}``) when the file ends in an unreadable tail (counted as one record skipped as ``damaged``).
    Records are streamed and only the candidates kept, so memory grows with the distinct prompts, not the file."""
    candidates, skipped, damage, read, duplicates = [], Counter(), None, 0, 0
    for item in read_source(src.path, src.format, src.name):
        read += 1
        if isinstance(item, RecordError):
            if on_error == "fail":
                raise item
            log.warning("skipped (%s): %s", item.reason, item)
            skipped[item.reason] += 1
            damage = item.damage or damage
        elif item.id in seen:
            duplicates += 1
        else:
            seen.add(item.id)
            candidates.append(item)
    counts = {"read": read, "valid": read - sum(skipped.values()), "skipped": sum(skipped.values()),
              "skipped_by_reason": dict(skipped), "duplicates": duplicates}
    return candidates, counts | ({"damage": damage} if damage else {})


def sample(candidates: list, n: int, seed: int, name: str) -> list:
    """``n`` candidates picked by a shuffle seeded from (seed, name), returned in their original order."""
    order = list(range(len(candidates)))
    random.Random(f"{seed}/{name}").shuffle(order)
    return [candidates[i] for i in sorted(order[:n])]


def prepare(cfg) -> tuple[list[Prompt], dict]:
    """All selected prompts (sources in config order, each in file order) and the report for metrics/prepare.json.
    ``cfg``: the ``prepare`` section (config.Prepare)."""
    for i, src in enumerate(cfg.sources):  # before reading any: a typo in the last path costs no time
        if not Path(src.path).is_file():
            raise UserError(f"prepare.sources[{i}] ({src.name}): no such file {src.path}")
    seen, selected, report = set(), [], {"sources": {}}
    for src in cfg.sources:
        candidates, counts = read_candidates(src, src.on_error or cfg.on_error, seen)
        picked = sample(candidates, src.n, cfg.seed, src.name)
        if len(picked) < src.n:
            log.warning("source %s: only %d usable records for n=%d", src.name, len(picked), src.n)
        selected += picked
        report["sources"][src.name] = {"n": src.n, **counts, "selected": len(picked), "shortfall": src.n - len(picked)}
    report["totals"] = totals(list(report["sources"].values()))
    if not selected:  # fail here, not in a later stage
        raise UserError(f"prepare: no prompt selected from {len(cfg.sources)} source(s) "
                        f"({report['totals']['read']} records read, {report['totals']['skipped']} skipped)")
    return selected, report


def totals(per_source: list[dict]) -> dict:
    out = {k: sum(s[k] for s in per_source) for k in COUNTS}
    reasons = sum((Counter(s["skipped_by_reason"]) for s in per_source), Counter())
    return {**out, "skipped_by_reason": dict(sorted(reasons.items()))}


def summary(report: dict) -> str:
    """A few human lines: one per source, the totals, the skip reasons and the damaged files if any."""
    lines = [f"{'source':<12} {'read':>6} {'valid':>6} {'skipped':>8} {'dups':>5} {'selected':>9} {'short':>6}"]
    for name, s in [*report["sources"].items(), ("TOTAL", report["totals"])]:
        lines.append(f"{name:<12} {s['read']:>6} {s['valid']:>6} {s['skipped']:>8} {s['duplicates']:>5} "
                     f"{s['selected']:>9} {s['shortfall']:>6}")
    reasons = report["totals"]["skipped_by_reason"]
    if reasons:
        lines.append("skipped: " + ", ".join(f"{reason} {count}" for reason, count in reasons.items()))
    for name, s in report["sources"].items():
        if "damage" in s:
            d = s["damage"]
            lines.append(f"damaged: {name} from byte {d['offset']} to its end ({d['bytes']} bytes), "
                         f"after {d['records_before']} records")
    return "\n".join(lines)
