"""Standard errors of ratios of sums over clusters: acceptance length (tokens emitted / verification steps) over
conversations, accuracy (correct / positions) over sequences. Units inside a cluster are not independent, so the
cluster is the sample. Delta method: for R = Σa_i / Σb_i over n clusters, SE(R) = sqrt(n / (n - 1) · Σ z_i²) with
z_i = (a_i - R·b_i) / Σb; for the difference of two ratios measured on the same clusters, each cluster's z terms are
subtracted before squaring (paired), so what the clusters share cancels."""
from __future__ import annotations

import math


def influence(nums: list[float], dens: list[float]) -> list[float]:
    """Each cluster's term z_i of the linearised ratio Σnums / Σdens."""
    total = sum(dens)
    ratio = sum(nums) / total
    return [(a - ratio * b) / total for a, b in zip(nums, dens)]


def _se(terms: list[float]) -> float | None:
    n = len(terms)
    return math.sqrt(n / (n - 1) * sum(z * z for z in terms)) if n > 1 else None


def ratio_se(nums: list[float], dens: list[float]) -> float | None:
    """SE of Σnums / Σdens; None under two clusters or with nothing counted."""
    return _se(influence(nums, dens)) if sum(dens) else None


def difference_se(a: tuple[list, list], b: tuple[list, list]) -> float | None:
    """SE of ratio(a) - ratio(b), each a (nums, dens) pair over the same clusters in the same order."""
    if not sum(a[1]) or not sum(b[1]):
        return None
    return _se([x - y for x, y in zip(influence(*a), influence(*b))])
