"""Paired comparisons: runs paired by seed, bootstrap intervals, the seeds a verdict would need,
and time to quality.

A configuration and the baseline are run with the same seeds on the same data (`data.seed`), so
each seed gives one paired difference: the speed-up of that seed, the change of its validation
loss. A verdict rests on the interval of their mean, not on medians of unpaired runs.
"""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_PAIRS = 3  # fewer paired seeds give no spread to speak of: the verdict is "undecided"


@dataclass
class Interval:
    """The mean of paired values and its bootstrap confidence interval."""

    mean: float
    lo: float
    hi: float
    n: int
    sd: float  # of the paired values: what the seeds a decision needs are estimated from


def mean_interval(values: Sequence[float], confidence: float) -> Interval | None:
    """Mean of `values` with a percentile bootstrap interval (scipy.stats.bootstrap, 9999 resamples,
    a fixed random state so a report is reproducible). None for no values; a single value (or
    identical values) has an interval of zero width, and the verdict then says it is too few."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return None
    mean = float(data.mean())
    sd = float(data.std(ddof=1)) if data.size > 1 else 0.0
    if data.size < 2 or sd == 0.0:
        return Interval(mean, mean, mean, int(data.size), sd)
    from scipy import stats  # here: importing scipy.stats adds ~0.6 s to the start of every run

    result = stats.bootstrap(
        (data,),
        np.mean,
        confidence_level=confidence,
        n_resamples=9999,
        method="percentile",
        random_state=np.random.default_rng(0),
    )
    ci = result.confidence_interval
    return Interval(mean, float(ci.low), float(ci.high), int(data.size), sd)


def seeds_needed(interval: Interval, bound: float, confidence: float, inside: bool = False) -> int | None:
    """Paired seeds at which the interval's half-width, z * sd / sqrt(n), would (at the measured mean
    and spread) clear `bound`: lie on one side of it (speed: bound 0 on log ratios), or with `inside`, lie
    within +-bound (quality); the side of the mean decides which. None when more seeds cannot
    decide it (the mean itself is outside) or the spread is unknown (fewer than 2 pairs)."""
    if interval.n < 2:
        return None
    margin = bound - abs(interval.mean) if inside else abs(interval.mean) - bound
    if margin <= 0:
        return None
    if interval.sd == 0:
        return max(interval.n, MIN_PAIRS)
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    return max(MIN_PAIRS, math.ceil((z * interval.sd / margin) ** 2))


def time_to_quality(validations: list[tuple[float, float]], target: float) -> float | None:
    """Seconds from the run's start to the first validation whose loss is <= `target`, or None if never.
    `validations`: (elapsed_s from the run's start, val_loss) in the order they were logged."""
    for elapsed_s, val_loss in validations:
        if val_loss is not None and elapsed_s is not None and val_loss <= target:
            return elapsed_s
    return None


def geometric(interval: Interval | None) -> tuple[float | None, float | None, float | None]:
    """(mean, lo, hi) of an interval on log ratios, as ratios."""
    if interval is None:
        return None, None, None
    return math.exp(interval.mean), math.exp(interval.lo), math.exp(interval.hi)


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
