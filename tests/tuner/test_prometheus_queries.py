"""The PromQL the tuner sends and the bucket arithmetic behind its goodput estimate, on hand-built data."""

from __future__ import annotations

import math

import pytest

from chunkpilot.tuner.prometheus import buckets_query, fraction_below, quantile_query, rate_query

# cumulative counts per upper bound, as `sum by (le) (increase(..._bucket[w]))` returns them
BUCKETS = {0.1: 10.0, 0.5: 60.0, 1.0: 90.0, math.inf: 100.0}


@pytest.mark.parametrize("threshold, share", [
    (0.1, 0.10),  # exactly on a bucket edge
    (0.3, 0.35),  # halfway through (0.1, 0.5]: 10 + 0.5 * 50
    (0.05, 0.05),  # inside the first bucket, from 0
    (1.0, 0.90),
    (5.0, 0.90),  # beyond the last finite edge: only what is known to be below
])
def test_fraction_below_interpolates_like_histogram_quantile(threshold, share):
    assert fraction_below(BUCKETS, threshold) == pytest.approx(share)


def test_fraction_below_without_data_is_unknown():
    assert fraction_below({}, 1.0) is None
    assert fraction_below({1.0: 0.0, math.inf: 0.0}, 1.0) is None


def test_queries_aggregate_all_pods_of_the_selector_over_the_window():
    sel = 'namespace="team",service="llm"'
    assert quantile_query("chunkpilot:inter_token_latency_seconds", 0.99, sel, 60) == (
        'histogram_quantile(0.99, sum by (le) (rate(chunkpilot:inter_token_latency_seconds_bucket'
        '{namespace="team",service="llm"}[60s])))')
    assert buckets_query("m", sel, 8.4) == 'sum by (le) (increase(m_bucket{namespace="team",service="llm"}[8s]))'
    assert rate_query("m_total", sel, 0.2) == 'sum(rate(m_total{namespace="team",service="llm"}[1s]))'
