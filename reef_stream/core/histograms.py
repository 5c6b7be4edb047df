"""Fixed-bucket histograms of ages in seconds, as the trainer writes them and readers read them.

A histogram is a count per bucket, keyed by the bucket's upper bound written as Prometheus
writes ``le`` (``"0.25"``, ``"1"``, ..., ``"+Inf"``). A value falls in the first bucket whose
bound it does not exceed (``value <= bound``), so the counts are per bucket, NOT cumulative as
Prometheus' ``_bucket`` series are: the values in ``le="2"`` are those in (1.5, 2]. Values
above every bound, and NaN, fall in ``"+Inf"``; a negative value (clocks of two hosts apart) in
the first bucket.

The trainer keeps its age histograms (``reef_stream.core.metric_names``: ``TRAINER_SAMPLE_AGE_SAMPLES``
and the two parts of that age) as running totals with ``age_buckets``; a reader orders the
buckets with ``AGE_LABELS``. Pure: no Kafka, no clock.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Sequence

#: Upper bounds of the age buckets, in seconds; a last bucket, ``"+Inf"``, holds the rest.
AGE_BOUNDS_S: tuple[float, ...] = (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48,
                                   64, 128, 256)
INF = "+Inf"


def bound_label(bound: float) -> str:
    """``le`` of a bound: ``"1"`` for 1 or 1.0, ``"0.25"`` for 0.25."""
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


#: Every bucket's ``le``, in order, ``"+Inf"`` last.
AGE_LABELS: tuple[str, ...] = (*map(bound_label, AGE_BOUNDS_S), INF)


def bucket_label(value: float, bounds: Sequence[float] = AGE_BOUNDS_S) -> str:
    """``le`` of the first bucket whose bound ``value`` does not exceed (``"+Inf"`` above them
    all, or NaN). ``bounds`` must be increasing."""
    if math.isnan(value):
        return INF
    index = bisect_left(bounds, value)       # the first bound >= value
    return INF if index == len(bounds) else bound_label(bounds[index])


def age_buckets(seconds: Iterable[float], bounds: Sequence[float] = AGE_BOUNDS_S) -> Counter[str]:
    """How many of ``seconds`` fall in each bucket (``bucket_label``); empty buckets absent."""
    return Counter(bucket_label(value, bounds) for value in seconds)
