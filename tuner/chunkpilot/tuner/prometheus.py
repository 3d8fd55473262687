"""Windows measured from Prometheus: PromQL builders (pure), the bucket arithmetic (pure), and the client.

Every query filters by one label selector (e.g. `job="chunkpilot"` locally, `namespace="team",service="llm"` in a
cluster scraped through a ServiceMonitor) and aggregates over all pods, because the SLO is the deployment's, not a
pod's. Metric names come from the engine's metrics module, never typed twice."""

from __future__ import annotations

import math

import requests
from urllib3.util.retry import Retry
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect

from chunkpilot.contract import metric_names as m
from chunkpilot.contract.slo import DEFAULT_QUANTILE, SLOClasses, SLOTargets
from chunkpilot.tuner.interfaces import MeasurementUnavailable
from chunkpilot.tuner.measurement import Window, class_windows
from chunkpilot.tuner.guide import Context
from chunkpilot.tuner.predictor import Load, imbalance_of, prompts_from_buckets
from chunkpilot.tuner.step_model import StepModel, fit_moments


def _w(seconds: float) -> str:
    return f"{max(1, int(round(seconds)))}s"


def quantile_query(metric: str, q: float, selector: str, seconds: float) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{selector}}}[{_w(seconds)}])))"


def buckets_query(metric: str, selector: str, seconds: float) -> str:
    return f"sum by (le) (increase({metric}_bucket{{{selector}}}[{_w(seconds)}]))"


def rate_query(metric: str, selector: str, seconds: float) -> str:
    return f"sum(rate({metric}{{{selector}}}[{_w(seconds)}]))"


def by_class_query(metric: str, selector: str, seconds: float) -> str:
    """A counter's increase over the window, one series per SLO class."""
    return f"sum by ({m.SLO_CLASS_LABEL}) (increase({metric}{{{selector}}}[{_w(seconds)}]))"


def with_class(selector: str, name: str) -> str:
    return f'{selector},{m.SLO_CLASS_LABEL}="{name}"'


def arrivals_by_pod_query(selector: str, seconds: float) -> str:
    """Each pod's arrivals (first tokens) in the window: a picker may load one pod more than the others."""
    return f"sum by (instance) (increase({m.TTFT}_count{{{selector}}}[{_w(seconds)}]))"


def step_moments_query(selector: str, seconds: float) -> str:
    """The window's step-cost sums, every pod's added up: the normal equations of the step-time fit."""
    return (f"sum by ({m.STEP_COST_TERM_LABEL}) (increase({m.STEP_COST_MOMENTS}{{{selector}}}"
            f"[{_w(seconds)}]))")


def fraction_below(buckets: dict[float, float], threshold: float) -> float | None:
    """Share of observations <= threshold from cumulative bucket counts {le: count}, interpolating linearly
    inside the bucket that holds the threshold (what histogram_quantile assumes, inverted)."""
    if not buckets:
        return None
    les = sorted(buckets)
    total = buckets[les[-1]]
    if total <= 0:
        return None
    prev_le, prev_count = 0.0, 0.0
    for le in les:
        count = buckets[le]
        if threshold <= le:
            if math.isinf(le):
                return prev_count / total
            share = (threshold - prev_le) / (le - prev_le) if le > prev_le else 1.0
            return (prev_count + share * (count - prev_count)) / total
        prev_le, prev_count = le, count
    return 1.0


class PrometheusSource:
    def __init__(self, url: str, selector: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.selector = selector
        # One quick retry: the loop has its own backoff, and a held tuner should say so within seconds.
        self.client = PrometheusConnect(url=self.url, disable_ssl=True,
                                        retry=Retry(total=1, backoff_factor=0.2, status_forcelist=[502, 503, 504]))
        self.timeout = timeout

    def query(self, promql: str) -> list[dict]:
        try:
            return self.client.custom_query(promql, params={"timeout": f"{int(self.timeout)}s"})
        except (requests.RequestException, PrometheusApiClientException) as e:
            raise MeasurementUnavailable(f"Prometheus at {self.url} did not answer: {type(e).__name__}: {e}") from e

    def scalar(self, promql: str) -> float | None:
        """The first sample's value; None when there is none or it is not finite. PromQL divides by zero to ±Inf
        (a ratio over an idle window) and no status field, JSON number or Optuna value can carry that."""
        result = self.query(promql)
        if not result:
            return None
        # an instant vector: [{"metric": ..., "value": [t, "v"]}]; a scalar expression: [t, "v"]
        v = float(result[0]["value"][1] if isinstance(result[0], dict) else result[1])
        return v if math.isfinite(v) else None

    def check(self) -> None:
        series = self.query(f"{m.SCHEDULER_GENERATION}{{{self.selector}}}")
        if not series:
            raise MeasurementUnavailable(
                f"Prometheus at {self.url} has no {m.SCHEDULER_GENERATION} series for {{{self.selector}}}: check the "
                "selector and that the engines are being scraped")

    def step_model(self, seconds: float) -> StepModel | None:
        """The step-time model fitted on the last `seconds` of every pod's steps (None: too few steps, or engines
        that predate the metric)."""
        terms = {s["metric"][m.STEP_COST_TERM_LABEL]: float(s["value"][1])
                 for s in self.query(step_moments_query(self.selector, seconds)) if m.STEP_COST_TERM_LABEL in s["metric"]}
        return fit_moments(terms)

    def generations(self) -> list[int]:
        return [int(float(s["value"][1])) for s in self.query(f"{m.SCHEDULER_GENERATION}{{{self.selector}}}")]

    def all_applied(self, generation: int) -> bool:
        """Every scraped engine exports `generation` (or a newer one): the knobs are in effect everywhere."""
        gens = self.generations()
        return bool(gens) and min(gens) >= generation


class PrometheusMeasurer:
    """Measurer for TunerLoop. `wait` sleeps for real (scrapes need real time to happen)."""

    def __init__(self, source: PrometheusSource, slo: SLOTargets, sleep=None,
                 classes: SLOClasses | None = None) -> None:
        """`classes`: with per-request SLO classes, each class is measured against its own SLOs (Window.classes),
        `slo` on the default class's latencies (a batch class's minute-long TTFTs are no breach of the interactive
        SLO), and the load the guide and the replicas answer counts the non-sheddable classes' arrivals."""
        import time

        self.source = source
        self.slo = slo
        self.classes = classes
        self._sleep = sleep or time.sleep

    def check(self) -> None:
        self.source.check()

    def wait(self, seconds: float) -> None:
        if self._sleep(seconds):  # Event.wait returns True when the tuner is asked to stop
            raise MeasurementUnavailable("the tuner is stopping")

    @property
    def latency_selector(self) -> str:
        """The selector of the latency series the SLO is judged on: with a class, that class's only."""
        sel = self.source.selector
        return sel if self.classes is None else with_class(sel, self.classes.default)

    @property
    def load_selector(self) -> str:
        """The selector of the arrivals the guide's load counts: a sheddable class is served with what is left,
        so it neither makes knobs infeasible nor adds pods."""
        shed = [] if self.classes is None else [c.name for c in self.classes.classes if c.sheddable]
        return ",".join([self.source.selector, *(f'{m.SLO_CLASS_LABEL}!="{name}"' for name in shed)])

    def _buckets(self, metric: str, seconds: float) -> dict[float, float]:
        out = {}
        for s in self.source.query(buckets_query(metric, self.latency_selector, seconds)):
            out[float(s["metric"]["le"])] = float(s["value"][1])
        return out

    def context(self, seconds: float) -> Context | None:
        """The step-time model fitted on this window's steps of every pod and the window's load per pod (the
        guide's input). None when the window holds too few steps or requests."""
        sel, src = self.source.selector, self.source
        model = src.step_model(seconds)
        pods = src.scalar(f"count(count_over_time({m.SCHEDULER_GENERATION}{{{sel}}}[{_w(seconds)}]))")
        arrivals = src.scalar(rate_query(f"{m.TTFT}_count", self.load_selector, seconds)) or 0.0
        mean = _ratio(src.scalar(rate_query(f"{m.REQUEST_PROMPT_TOKENS}_sum", sel, seconds)),
                      src.scalar(rate_query(f"{m.REQUEST_PROMPT_TOKENS}_count", sel, seconds)))
        prompts = prompts_from_buckets(self._buckets(m.REQUEST_PROMPT_TOKENS, seconds), mean or None)
        running = src.scalar(f"sum(avg_over_time({m.NUM_RUNNING}{{{sel}}}[{_w(seconds)}]))") or 0.0
        # speculative decoding: decodes with drafts and their draft tokens per step (0 where it is off)
        steps = src.scalar(rate_query(f"{m.ITERATION_TOKENS}_count", sel, seconds))
        drafting = _ratio(src.scalar(rate_query(m.SPEC_DECODE_DRAFTS, sel, seconds)), steps)
        draft_tokens = _ratio(src.scalar(rate_query(m.SPEC_DECODE_DRAFT_TOKENS, sel, seconds)), steps)
        if model is None or not prompts or not pods or arrivals <= 0:
            return None
        pods = int(round(pods))
        per_pod = [float(r["value"][1]) for r in src.query(arrivals_by_pod_query(self.load_selector, seconds))]
        return Context(model=model, load=Load(request_rate=arrivals / pods, prompts=prompts, running=running / pods,
                                              drafting=drafting, draft_tokens=draft_tokens,
                                              imbalance=imbalance_of(per_pod, pods)), pods=pods)

    def measure(self, seconds: float) -> Window:
        sel, src = self.source.selector, self.source
        q_ttft = self.slo.ttft.quantile if self.slo.ttft else DEFAULT_QUANTILE
        q_itl = self.slo.itl.quantile if self.slo.itl else DEFAULT_QUANTILE
        ttft = src.scalar(quantile_query(m.TTFT, q_ttft, self.latency_selector, seconds))
        itl = src.scalar(quantile_query(m.ITL, q_itl, self.latency_selector, seconds))
        done_rate = src.scalar(rate_query(f"{m.REQUEST_SUCCESS}", sel, seconds)) or 0.0
        # Arrivals: first tokens (the TTFT histogram's count) plus the growth of the waiting queue.
        first = src.scalar(rate_query(f"{m.TTFT}_count", sel, seconds)) or 0.0
        queued = src.scalar(f"sum(delta({m.NUM_WAITING}{{{sel}}}[{_w(seconds)}]))") or 0.0
        running = src.scalar(f"sum(delta({m.NUM_RUNNING}{{{sel}}}[{_w(seconds)}]))") or 0.0
        arrivals = first + max(0.0, queued) / seconds
        tokens = src.scalar(rate_query(m.GENERATION_TOKENS, sel, seconds)) or 0.0
        prompt_mean = _ratio(src.scalar(rate_query(f"{m.REQUEST_PROMPT_TOKENS}_sum", sel, seconds)),
                             src.scalar(rate_query(f"{m.REQUEST_PROMPT_TOKENS}_count", sel, seconds)))
        output_mean = _ratio(src.scalar(rate_query(f"{m.REQUEST_GENERATION_TOKENS}_sum", sel, seconds)),
                             src.scalar(rate_query(f"{m.REQUEST_GENERATION_TOKENS}_count", sel, seconds)))
        # Goodput estimate: Prometheus has no per-request join of TTFT and ITL, so the share of requests within
        # the TTFT SLO times the share of token gaps within the ITL SLO, applied to the completion rate.
        # With classes the engines count who kept their class's SLOs: exact, no estimate.
        classes = self._classes(seconds)
        share = 1.0
        if self.slo.ttft and not classes:
            share *= fraction_below(self._buckets(m.TTFT, seconds), self.slo.ttft.threshold) or 0.0
        if self.slo.itl and not classes:
            share *= fraction_below(self._buckets(m.ITL, seconds), self.slo.itl.threshold) or 0.0
        goodput = sum(c.met for c in classes) / seconds if classes else done_rate * share
        # Prefill capacity of the deployment: the prompt tokens a pod gets through per busy second (computed, plus
        # those found in the prefix cache: demand counts whole prompts too) times the pods that report it over
        # the same window. None when no pod was busy with prompts (or the engines predate the metric).
        busy = src.scalar(rate_query(m.PREFILL_BUSY_SECONDS, sel, seconds))
        through = ((src.scalar(rate_query(m.PREFILL_COMPUTED_TOKENS, sel, seconds)) or 0.0)
                   + (src.scalar(rate_query(m.PREFIX_CACHE_HITS, sel, seconds)) or 0.0))
        pods = src.scalar(f"count(rate({m.PREFILL_BUSY_SECONDS}{{{sel}}}[{_w(seconds)}]))")
        capacity = through / busy * pods if busy and pods else None
        engines = src.scalar(f"count(count_over_time({m.SCHEDULER_GENERATION}{{{sel}}}[{_w(seconds)}]))")
        return Window(seconds=seconds, requests=int(round(done_rate * seconds)), request_rate=arrivals,
                      output_tokens_per_s=tokens, goodput=goodput, ttft=ttft, itl=itl,
                      mean_prompt_tokens=prompt_mean, mean_output_tokens=output_mean,
                      backlog_growth=(queued + running) / seconds, prefill_capacity=capacity,
                      pods=max(1, int(round(engines or 1))), classes=classes)

    def _classes(self, seconds: float):
        """Each class's latencies at its own quantiles, its finished requests and those that kept its SLOs."""
        if self.classes is None:
            return ()
        sel, src = self.source.selector, self.source

        def by_class(metric: str) -> dict[str, float]:
            return {r["metric"].get(m.SLO_CLASS_LABEL, ""): float(r["value"][1])
                    for r in src.query(by_class_query(metric, sel, seconds))}

        finished, met = by_class(m.REQUEST_SUCCESS), by_class(m.SLO_MET)
        measured = {}
        for c in self.classes.classes:
            q_ttft = c.slo.ttft.quantile if c.slo.ttft else DEFAULT_QUANTILE
            q_itl = c.slo.itl.quantile if c.slo.itl else DEFAULT_QUANTILE
            measured[c.name] = dict(
                finished=finished.get(c.name, 0.0), met=met.get(c.name, 0.0),
                ttft=src.scalar(quantile_query(m.TTFT, q_ttft, with_class(sel, c.name), seconds)),
                itl=src.scalar(quantile_query(m.ITL, q_itl, with_class(sel, c.name), seconds)))
        return class_windows(self.classes, measured)


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else 0.0
