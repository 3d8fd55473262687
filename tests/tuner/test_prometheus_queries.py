"""The PromQL the tuner sends and the bucket arithmetic behind its goodput estimate, on hand-built data."""

from __future__ import annotations

import math

import pytest

from chunkpilot.contract import metric_names as m
from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.tuner.prometheus import (PrometheusMeasurer, buckets_query, fraction_below, quantile_query,
                                         rate_query, step_moments_query)

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
    assert step_moments_query(sel, 60) == ('sum by (term) (increase(chunkpilot:step_cost_moments_total'
                                           '{namespace="team",service="llm"}[60s]))')


class FakeSource:
    """Answers the measurer's PromQL from a table of per-metric values, as Prometheus would for two pods; records
    every query so the test can check what was asked."""

    selector = 'job="chunkpilot"'

    def __init__(self, values: dict[str, float | None]) -> None:
        self.values, self.asked = values, []

    def scalar(self, promql: str) -> float | None:
        self.asked.append(promql)
        for key, value in self.values.items():
            if key in promql:
                return value
        return None

    def query(self, promql: str) -> list[dict]:
        self.asked.append(promql)
        return []


def test_prefill_capacity_is_what_a_busy_pod_gets_through_times_the_pods():
    values = {f"count(rate({m.PREFILL_BUSY_SECONDS}": 2.0, m.PREFILL_BUSY_SECONDS: 0.5,  # two pods, 0.25 s/s each
              m.PREFILL_COMPUTED_TOKENS: 150.0, m.PREFIX_CACHE_HITS: 50.0}  # prompt tokens/s, both pods together
    src = FakeSource(values)
    slo = SLOTargets(ttft=LatencyTarget(0.99, 5.0), itl=LatencyTarget(0.99, 0.5))
    w = PrometheusMeasurer(src, slo, sleep=lambda s: False).measure(30)
    # (150 + 50) tokens per 0.5 busy second = 400 tokens/s per busy pod, and two pods
    assert w.prefill_capacity == pytest.approx(800.0)
    # the pods are counted over the same window as the rates (a pod that only just appeared has no rate yet)
    assert f'count(rate({m.PREFILL_BUSY_SECONDS}{{job="chunkpilot"}}[30s]))' in src.asked
    for busy in (None, 0.0):  # engines without the counter, or no prompt computed in the window
        src = FakeSource({**values, m.PREFILL_BUSY_SECONDS: busy, f"count(rate({m.PREFILL_BUSY_SECONDS}": 2.0})
        assert PrometheusMeasurer(src, slo, sleep=lambda s: False).measure(30).prefill_capacity is None


def test_non_finite_answers_of_the_real_prometheus_are_no_value(tmp_path):
    """PromQL divides by zero to ±Inf (a ratio over an idle window). Before, +Inf went into the status patch,
    which the API server refuses, and the tuner crash-looped."""
    from chunkpilot.tuner.prometheus import PrometheusSource
    from chunkpilot.lab.prometheus_server import PrometheusServer

    from ..conftest import require_tool

    require_tool("prometheus", "sudo apt-get install prometheus (Debian/Ubuntu), or put it on PATH")
    prom = PrometheusServer(tmp_path / "prom", []).start()
    try:
        source = PrometheusSource(prom.url, 'job="none"')
        queries = ("vector(1)/0", "vector(-1)/0", "vector(0)/0", "1/0", "vector(2.5)", "2.5")
        assert [source.scalar(q) for q in queries] == [None, None, None, None, 2.5, 2.5]
    finally:
        prom.stop()


def test_with_slo_classes_each_class_is_measured_at_its_own_slo_and_the_load_counts_the_unsheddable():
    """spec.sloClasses: each class's latencies at its own quantile, its finished and kept requests by class (the
    engines' exact counts make the goodput); spec.slo is measured on the default class; the guide's load counts
    every class but the sheddable ones (served with what is left, they add no pods)."""
    from chunkpilot.contract.slo import SLOClass, SLOClasses
    from chunkpilot.tuner.prometheus import by_class_query

    classes = SLOClasses((SLOClass("interactive", 10, SLOTargets(ttft=LatencyTarget(0.9, 3.0))),
                          SLOClass("spare", -1, SLOTargets.p99(ttft=60.0))), "interactive")
    src = FakeSource({})
    slo = SLOTargets(ttft=LatencyTarget(0.99, 5.0), itl=LatencyTarget(0.99, 0.5))
    measurer = PrometheusMeasurer(src, slo, sleep=lambda s: False, classes=classes)
    w = measurer.measure(30)
    assert [c.name for c in w.classes] == ["interactive", "spare"]
    classed = 'job="chunkpilot",slo_class="interactive"'
    assert quantile_query(m.TTFT, 0.9, classed, 30) in src.asked  # the class's own quantile
    assert quantile_query(m.TTFT, 0.99, 'job="chunkpilot",slo_class="spare"', 30) in src.asked
    assert quantile_query(m.ITL, 0.99, classed, 30) in src.asked  # spec.slo on the default class
    assert by_class_query(m.SLO_MET, 'job="chunkpilot"', 30) in src.asked
    assert by_class_query(m.REQUEST_SUCCESS, 'job="chunkpilot"', 30) == (
        'sum by (slo_class) (increase(chunkpilot:request_success_total{job="chunkpilot"}[30s]))')
    assert not any(q.startswith("sum by (le)") for q in src.asked)  # no bucket estimate: the counts are exact
    assert rate_query(f"{m.TTFT}_count", 'job="chunkpilot"', 30) in src.asked  # arrivals: all classes
    src.asked.clear()
    src.step_model = lambda seconds: None
    measurer.context(30)
    assert rate_query(f"{m.TTFT}_count", 'job="chunkpilot",slo_class!="spare"', 30) in src.asked
    plain = FakeSource({})
    PrometheusMeasurer(plain, slo, sleep=lambda s: False).measure(30)
    assert not any("slo_class" in q for q in plain.asked)  # without classes: the queries as before
