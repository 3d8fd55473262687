"""The demo's measured check on the real engines: the busiest phase's rate on both groups at once for
CHECK_SECONDS, the tuned group at the knobs the sizing counts on, the fixed group at its start-up knobs; each
group's ITL p99 from the load generator's own records (per request, as the demo's attainment judges it), and the tuned group's steps
against the probe fit's prediction (the contention the busy phase adds, measured rather than assumed)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import numpy as np

from chunkpilot.contract import metric_names as m
from chunkpilot.contract.step_cost import FEATURES, moments_matrix
from chunkpilot.loadgen.runner import BenchmarkConfig, run_benchmark_async
from chunkpilot.loadgen.workloads import build_workload
from chunkpilot.tuner import Knobs, PrometheusSource, StepModel, step_moments_query

from chunkpilot.demo.host import Busy
from chunkpilot.demo.sizing import COUNTED_QUANTILE, START_QUANTILE, Check

CHECK_SECONDS = 40.0
CHECK_SEED = 7  # other requests than the main run's, the same shapes and rate


def itl_p99(records, quantile: float) -> float | None:
    """Each request's own ITL p99 (as the demo's attainment judges a request; a failed request counts as a breach),
    at the request ranking at `quantile`. A p99 pooled over every gap of the window would hide a stall: one
    unchunked long prompt stalls only the few streams decoding at the time, a small share of all gaps but a large
    share of requests."""
    per_request = [float(np.percentile(r.itls, 99)) if r.ok else np.inf for r in records if r.itls or not r.ok]
    return float(np.quantile(per_request, quantile, method="higher")) if per_request else None


def share_over(records, slo: float) -> float | None:
    """The share of requests whose own ITL p99 broke `slo` (a failed request counts as over)."""
    judged = [r for r in records if r.itls or not r.ok]
    return sum(1 for r in judged if not r.ok or float(np.percentile(r.itls, 99)) > slo) / len(judged) if judged else None


def measured_over_predicted(model: StepModel, terms: dict[str, float]) -> float | None:
    """Seconds the steps in these moments took over what `model` predicts for the same steps (from the normal
    equations alone: Σy / Σβᵀx)."""
    full = moments_matrix(terms)
    n = full.shape[0] - 1
    predicted = float(np.array([model.coefficients[f] for f in FEATURES]) @ full[0, :n])
    return float(full[0, n]) / predicted if predicted > 0 and full[0, 0] > 0 else None


class EngineCheck:
    """measure(config, knobs, predicted_itl) -> Check, on the demo's engines (see chunkpilot.demo.sizing.size)."""

    def __init__(self, groups: dict[str, list[str]], apply_knobs, prometheus_url: str, model: StepModel,
                 seconds: float = CHECK_SECONDS, cores: set[int] | None = None) -> None:
        self.groups, self.apply_knobs, self.model, self.seconds = groups, apply_knobs, model, seconds
        self.cores = cores  # the engines' cores, where other programs' time is measured (None: every CPU)
        self.source = PrometheusSource(prometheus_url, 'job="chunkpilot-tuned"')

    def __call__(self, config, knobs: Knobs, predicted_itl: float) -> Check:
        self.apply_knobs(knobs)
        phase = max(config.phases(), key=lambda p: p.rate)
        specs = build_workload([replace(phase, duration=self.seconds)], vocab_size=49152,
                               seed=config.seed + CHECK_SEED, shapes=config.shapes())
        records: dict[str, list] = {g: [] for g in self.groups}

        def one(group: str, url: str) -> None:
            result = asyncio.run(run_benchmark_async(BenchmarkConfig(base_url=url, model="smollm2", requests=specs,
                                                                     progress=False, timeout=120)))
            records[group].extend(result.records)  # list.extend is atomic; joined before it is read

        t0 = time.monotonic()
        busy = Busy(self.cores)
        threads = [threading.Thread(target=one, args=(g, u), daemon=True) for g, us in self.groups.items() for u in us]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        others = busy.share()
        time.sleep(2.5)  # the last steps reach Prometheus
        terms = {s["metric"][m.STEP_COST_TERM_LABEL]: float(s["value"][1])
                 for s in self.source.query(step_moments_query(self.source.selector, time.monotonic() - t0 + 1))
                 if m.STEP_COST_TERM_LABEL in s["metric"]}
        return Check(knobs=knobs, itl_slo=config.itl_slo, counted_itl=itl_p99(records["tuned"], COUNTED_QUANTILE),
                     start_itl=itl_p99(records["fixed"], START_QUANTILE), predicted_itl=predicted_itl,
                     contention=measured_over_predicted(self.model, terms),
                     start_over_share=share_over(records["fixed"], config.itl_slo), busy=others, rate=config.rate)
