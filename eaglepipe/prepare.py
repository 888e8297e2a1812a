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

from eaglepipe.records import Prompt, RecordError
from eaglepipe.sources import FORMATS, read_source

log = logging.getLogger(__name__)

ON_ERROR = ("fail", "skip")
COUNTS = ("n", "read", "valid", "skipped", "duplicates", "selected", "shortfall")


def check_config(cfg: dict) -> None:
    """Raise ValueError naming the first bad key of the ``prepare`` section."""
    if cfg.get("on_error", "fail") not in ON_ERROR:
        raise ValueError(f"prepare.on_error should be one of {ON_ERROR}, got {cfg.get('on_error')!r}")
    sources = cfg.get("sources")
    if not isinstance(sources, list) or not sources:
        raise ValueError("prepare.sources should be a non-empty list of {name, path, format, n}")
    names = [s.get("name") for s in sources if isinstance(s, dict)]
    for i, s in enumerate(sources):
        if not isinstance(s, dict) or set(s) != {"name", "path", "format", "n"}:
            raise ValueError(f"prepare.sources[{i}] should have exactly the keys name, path, format, n")
        if s["format"] not in FORMATS:
            raise ValueError(f"prepare.sources[{i}].format {s['format']!r} is not one of {', '.join(FORMATS)}")
        if not isinstance(s["n"], int) or isinstance(s["n"], bool) or s["n"] < 0:
            raise ValueError(f"prepare.sources[{i}].n should be a non-negative integer, got {s['n']!r}")
        if names.count(s["name"]) > 1:
            raise ValueError(f"prepare.sources: the name {s['name']!r} is used twice")


def read_valid(src: dict, on_error: str) -> tuple[list[Prompt], Counter, int]:
    """The valid prompts of one source in file order, the skipped records by reason, and how many records were read."""
    valid, skipped, read = [], Counter(), 0
    for item in read_source(src["path"], src["format"], src["name"]):
        read += 1
        if isinstance(item, RecordError):
            if on_error == "fail":
                raise item
            log.warning("skipped (%s): %s", item.reason, item)
            skipped[item.reason] += 1
        else:
            valid.append(item)
    return valid, skipped, read


def sample(candidates: list, n: int, seed: int, name: str) -> list:
    """``n`` candidates picked by a shuffle seeded from (seed, name), returned in their original order."""
    order = list(range(len(candidates)))
    random.Random(f"{seed}/{name}").shuffle(order)
    return [candidates[i] for i in sorted(order[:n])]


def prepare(cfg: dict) -> tuple[list[Prompt], dict]:
    """All selected prompts (sources in config order, each in file order) and the report for metrics/prepare.json."""
    check_config(cfg)
    seed, on_error = cfg.get("seed", 0), cfg.get("on_error", "fail")
    seen, selected, report = set(), [], {"seed": seed, "on_error": on_error, "sources": {}}
    for src in cfg["sources"]:
        valid, skipped, read = read_valid(src, on_error)
        candidates = []
        for p in valid:
            if p.id not in seen:
                seen.add(p.id)
                candidates.append(p)
        picked = sample(candidates, src["n"], seed, src["name"])
        if len(picked) < src["n"]:
            log.warning("source %s: only %d usable records for n=%d", src["name"], len(picked), src["n"])
        selected += picked
        report["sources"][src["name"]] = {
            "path": str(src["path"]), "format": src["format"], "n": src["n"],
            "read": read, "valid": len(valid), "skipped": sum(skipped.values()), "skipped_by_reason": dict(skipped),
            "duplicates": len(valid) - len(candidates), "selected": len(picked),
            "shortfall": src["n"] - len(picked),
        }
    report["totals"] = totals(list(report["sources"].values()))
    return selected, report


def totals(per_source: list[dict]) -> dict:
    out = {k: sum(s[k] for s in per_source) for k in COUNTS}
    reasons = sum((Counter(s["skipped_by_reason"]) for s in per_source), Counter())
    return {**out, "skipped_by_reason": dict(sorted(reasons.items()))}


def summary(report: dict) -> str:
    """A few human lines: one per source, the totals, and the skip reasons if any."""
    lines = [f"{'source':<12} {'read':>6} {'valid':>6} {'skipped':>8} {'dups':>5} {'selected':>9} {'short':>6}"]
    for name, s in [*report["sources"].items(), ("TOTAL", report["totals"])]:
        lines.append(f"{name:<12} {s['read']:>6} {s['valid']:>6} {s['skipped']:>8} {s['duplicates']:>5} "
                     f"{s['selected']:>9} {s['shortfall']:>6}")
    reasons = report["totals"]["skipped_by_reason"]
    if reasons:
        lines.append("skipped: " + ", ".join(f"{reason} {count}" for reason, count in reasons.items()))
    return "\n".join(lines)
