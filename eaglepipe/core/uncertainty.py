"""Standard errors of ratios of sums over clusters: acceptance length (tokens emitted / verification steps) over
conversations, accuracy (correct / positions) over sequences. Units inside a cluster are not independent, so the
cluster is the sample. Delta method: for R = Σa_i / Σb_i over n clusters, SE(R) = sqrt(n / (n - 1) · Σ z_i²) with
z_i = (a_i - R·b_i) / Σb; for the difference of two ratios measured on the same clusters, each cluster's z terms are
subtracted before squaring (paired), so what the clusters share cancels; any smooth function of several ratios on the
same clusters (``extrapolate``) takes the same chain rule per cluster."""

from __future__ import annotations

import math


def influence(nums: list[float], dens: list[float]) -> list[float]:
    """Each cluster's term z_i of the linearised ratio Σnums / Σdens."""
    total = sum(dens)
    ratio = sum(nums) / total
    return [(a - ratio * b) / total for a, b in zip(nums, dens)]


def cluster_se(terms: list[float]) -> float | None:
    """SE of a statistic whose linearised terms per cluster are ``terms``; None under two clusters."""
    n = len(terms)
    return math.sqrt(n / (n - 1) * sum(z * z for z in terms)) if n > 1 else None


def ratio_se(nums: list[float], dens: list[float]) -> float | None:
    """SE of Σnums / Σdens; None under two clusters or with nothing counted."""
    return cluster_se(influence(nums, dens)) if sum(dens) else None


def difference_se(a: tuple[list, list], b: tuple[list, list]) -> float | None:
    """SE of ratio(a) - ratio(b), each a (nums, dens) pair over the same clusters in the same order."""
    if not sum(a[1]) or not sum(b[1]):
        return None
    return cluster_se([x - y for x, y in zip(influence(*a), influence(*b))])


def extrapolate(lo: tuple[list, list], hi: tuple[list, list], goal: tuple[list, list], doublings: float) -> dict:
    """Where a ratio that grows linearly in log2 of the training data reaches ``goal``'s: ``lo`` and ``hi`` are the
    ratio at two data sizes ``doublings`` apart, ``goal`` the one to reach (each (nums, dens) over the same clusters in
    the same order). Returns the slope per doubling (``slope``) and the doublings beyond ``hi`` (``beyond``: the gap
    over the slope; inf where the slope is not positive), each with its paired delta-method SE (``*_se``)."""
    r_lo, r_hi, r_goal = (sum(n) / sum(d) for n, d in (lo, hi, goal))
    z_lo, z_hi, z_goal = (influence(*x) for x in (lo, hi, goal))
    slope, gap = (r_hi - r_lo) / doublings, r_goal - r_hi
    z_slope = [(high - low) / doublings for high, low in zip(z_hi, z_lo)]
    out = {
        "slope": slope,
        "slope_se": cluster_se(z_slope),
        "gap": gap,
        "gap_se": cluster_se([g - h for g, h in zip(z_goal, z_hi)]),
    }
    if slope <= 0:
        return {**out, "beyond": math.inf, "beyond_se": None}
    z_beyond = [(g - h) / slope - gap * s / slope**2 for g, h, s in zip(z_goal, z_hi, z_slope)]
    return {**out, "beyond": gap / slope, "beyond_se": cluster_se(z_beyond)}
