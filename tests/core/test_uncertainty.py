"""The delta-method standard errors of ratios over clusters (eaglepipe/core/uncertainty.py)."""

import random

import numpy as np
import pytest

from eaglepipe.core import uncertainty as u


def test_a_hand_computed_case():
    """R = 12 / 8 = 1.5 over three clusters; z = 1/8, -1/8, 0, so SE = sqrt(3/2 · 2/64); a ratio against itself
    differs by exactly 0 with no error; against a constant ratio, the difference's error is the ratio's own."""
    a = ([4, 2, 6], [2, 2, 4])
    assert u.ratio_se(*a) == pytest.approx((3 / 2 * 2 / 64) ** 0.5)
    assert u.difference_se(a, a) == 0.0
    b = ([2, 2, 4], [2, 2, 4])
    assert u.ratio_se(*b) == 0.0 and u.difference_se(a, b) == pytest.approx(u.ratio_se(*a))
    assert u.ratio_se([4], [2]) is None and u.ratio_se([0, 0], [0, 0]) is None


def test_it_matches_the_spread_of_the_ratio_over_many_draws():
    """Draw 200 clusters of 1-30 units with success probability 0.3, many times: the standard deviation of the
    ratio across draws agrees with the mean delta-method SE within 15%."""
    rng = random.Random(0)
    ratios, ses = [], []
    for _ in range(300):
        dens = [rng.randint(1, 30) for _ in range(200)]
        nums = [sum(rng.random() < 0.3 for _ in range(d)) for d in dens]
        ratios.append(sum(nums) / sum(dens))
        ses.append(u.ratio_se(nums, dens))
    mean = sum(ratios) / len(ratios)
    sd = (sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1)) ** 0.5
    assert sum(ses) / len(ses) == pytest.approx(sd, rel=0.15)


def test_extrapolate_a_hand_computed_case():
    """Ratios 1.2, 1.4 and 1.6 in every cluster: a slope of 0.1 per doubling two doublings apart, the goal two
    doublings beyond, every error 0; a ratio that does not grow never reaches the goal."""
    dens = [10, 20, 5]
    lo, hi, goal = ([1.2 * d for d in dens], dens), ([1.4 * d for d in dens], dens), ([1.6 * d for d in dens], dens)
    x = u.extrapolate(lo, hi, goal, 2)
    assert x["slope"] == pytest.approx(0.1) and x["beyond"] == pytest.approx(2.0)
    assert x["slope_se"] == pytest.approx(0, abs=1e-12) and x["beyond_se"] == pytest.approx(0, abs=1e-12)
    assert u.extrapolate(hi, lo, goal, 2)["beyond"] == float("inf")


def test_extrapolate_matches_the_spread_over_many_draws():
    """Three success rates 0.3, 0.4, 0.5 drawn on the same 400 clusters of 1-30 units (one doubling apart, the goal
    one doubling beyond), many times: the standard deviation of the estimated doublings across draws agrees with
    the mean delta-method SE within 20%."""
    rng = np.random.default_rng(0)
    beyond, ses = [], []
    for _ in range(300):
        dens = rng.integers(1, 31, 400)
        lo, hi, goal = ((rng.binomial(dens, q).tolist(), dens.tolist()) for q in (0.3, 0.4, 0.5))
        x = u.extrapolate(lo, hi, goal, 1)
        beyond.append(x["beyond"])
        ses.append(x["beyond_se"])
    assert np.mean(beyond) == pytest.approx(1.0, abs=0.05)
    assert np.mean(ses) == pytest.approx(np.std(beyond, ddof=1), rel=0.2)
