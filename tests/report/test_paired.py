"""report/paired.py: the bootstrap interval on known cases, the seeds a decision needs, time to quality."""

import math

import numpy as np
import pytest
from scipy import stats

from aamperf.report.paired import Interval, mean_interval, seeds_needed, time_to_quality


def test_bootstrap_interval_of_a_large_normal_sample_matches_the_t_interval():
    """For n = 400 draws of N(1, 2^2) the percentile bootstrap of the mean and the t-interval agree
    (both ~ mean +- 1.96 s / sqrt(n)), at 95% and at 80%."""
    data = np.random.default_rng(7).normal(1.0, 2.0, 400)
    for confidence in (0.95, 0.80):
        got = mean_interval(data.tolist(), confidence)
        lo, hi = stats.t.interval(confidence, len(data) - 1, loc=data.mean(), scale=stats.sem(data))
        assert got.mean == pytest.approx(data.mean())
        assert got.lo == pytest.approx(lo, abs=0.03 * (hi - lo)) and got.hi == pytest.approx(
            hi, abs=0.03 * (hi - lo)
        )
        assert got.n == 400 and got.sd == pytest.approx(data.std(ddof=1))


def test_bootstrap_covers_the_true_mean_at_its_level():
    """Coverage over 200 samples of 30 exponential draws (skewed; true mean 1): near 95%."""
    rng = np.random.default_rng(3)
    covered = sum(
        (i := mean_interval(rng.exponential(1.0, 30).tolist(), 0.95)).lo <= 1.0 <= i.hi for _ in range(200)
    )
    assert 0.88 <= covered / 200 <= 0.99


def test_small_and_degenerate_samples():
    assert mean_interval([], 0.95) is None
    assert mean_interval([2.0], 0.95) == Interval(2.0, 2.0, 2.0, 1, 0.0)
    three = mean_interval([1.0, 2.0, 4.0], 0.95)
    assert 1.0 <= three.lo < three.mean < three.hi <= 4.0  # a percentile interval stays in the data's range


def test_seeds_needed_follows_the_spread_and_the_margin():
    z = stats.norm.ppf(0.975)
    speed = Interval(mean=math.log(1.05), lo=-0.01, hi=0.1, n=3, sd=0.06)
    assert seeds_needed(speed, 0.0, 0.95) == math.ceil((z * 0.06 / math.log(1.05)) ** 2)
    wider = Interval(mean=math.log(1.05), lo=-0.1, hi=0.2, n=3, sd=0.12)
    assert seeds_needed(wider, 0.0, 0.95) > 3.9 * seeds_needed(speed, 0.0, 0.95)  # ~ sd^2
    quality = Interval(mean=0.01, lo=-0.01, hi=0.03, n=3, sd=0.01)  # tolerance 0.02: margin 0.01
    assert seeds_needed(quality, 0.02, 0.95, inside=True) == math.ceil(z**2) == 4
    assert seeds_needed(Interval(0.025, 0.0, 0.05, 3, 0.01), 0.02, 0.95, inside=True) is None  # mean outside
    assert seeds_needed(Interval(0.0, 0.0, 0.0, 1, 0.0), 0.0, 0.95) is None  # no spread known


def test_time_to_quality_is_the_first_validation_at_or_below_the_target():
    validations = [(12.0, 2.5), (20.5, 2.0), (31.0, 1.9), (40.0, 1.95)]
    assert time_to_quality(validations, 2.0) == 20.5
    assert time_to_quality(validations, 1.9) == 31.0
    assert time_to_quality(validations, 1.8) is None
    assert time_to_quality([(None, 1.0), (5.0, None)], 2.0) is None  # lines without a time or a loss
