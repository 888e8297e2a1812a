"""The delta-method standard errors of ratios over clusters (eaglepipe/uncertainty.py)."""
import random

import pytest

from eaglepipe import uncertainty as u


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
