"""The live terminal view (rich): latency percentiles against the SLOs, knobs per replica, trials, best so far."""

from __future__ import annotations

import math

from rich.table import Table

from chunkpilot.demo.run import GROUPS, DemoRun
from chunkpilot.contract import metric_names as m
from chunkpilot.tuner import MeasurementUnavailable, PrometheusSource, quantile_query


def _fmt(v: float | None, slo: float | None = None) -> str:
    if v is None or math.isnan(v):
        return "-"
    text = f"{v:.2f}s"
    if slo is not None:
        return f"[{'green' if v <= slo else 'red'}]{text}[/]"
    return text


def snapshot(run: DemoRun) -> dict:
    """What the view shows, read from Prometheus (last 30 s) and the tuner's state."""
    out = {"groups": {}}
    for group in GROUPS:
        src = PrometheusSource(run.prometheus.url, f'job="chunkpilot-{group}"', timeout=3)
        row = {}
        try:
            row["ttft"] = src.scalar(quantile_query(m.TTFT, 0.99, src.selector, 30))
            row["itl"] = src.scalar(quantile_query(m.ITL, 0.99, src.selector, 30))
            row["knobs"] = [(int(float(b["value"][1])), int(float(c["value"][1])), int(float(g["value"][1])))
                            for b, c, g in zip(src.query(f"{m.SCHEDULER_TOKEN_BUDGET}{{{src.selector}}}"),
                                               src.query(f"{m.SCHEDULER_MAX_CHUNK}{{{src.selector}}}"),
                                               src.query(f"{m.SCHEDULER_GENERATION}{{{src.selector}}}"))]
            row["done"] = src.scalar(f"sum({m.REQUEST_SUCCESS}{{{src.selector}}})")
        except MeasurementUnavailable:
            pass
        out["groups"][group] = row
    return out


def table(run: DemoRun, snap: dict, elapsed: float) -> Table:
    c = run.config
    t = Table(title=f"chunkpilot demo - {elapsed:.0f}/{c.duration:.0f}s - SLO: TTFT p99 <= {c.ttft_slo:g}s, "
                    f"ITL p99 <= {c.itl_slo:g}s (last 30 s)")
    for col in ("group", "TTFT p99", "ITL p99", "knobs per replica (budget/chunk gen)", "finished"):
        t.add_column(col)
    for group in GROUPS:
        row = snap["groups"].get(group, {})
        knobs = ", ".join(f"{b}/{ch} g{g}" for b, ch, g in row.get("knobs", [])) or "-"
        done = row.get("done")
        t.add_row(group, _fmt(row.get("ttft"), c.ttft_slo), _fmt(row.get("itl"), c.itl_slo), knobs,
                  "-" if done is None else f"{done:.0f}")
    st = run.tuner.state if run.tuner else None
    if st is not None:
        best = st.best
        best_text = (f"{best.knobs.token_budget}/{best.knobs.max_chunk} (objective {best.objective:.2f}, "
                     f"{'feasible' if best.feasible else 'least violating'})") if best else "-"
        t.caption = f"tuner: {st.phase}, {st.trial} trials, best {best_text}. {st.reason}"
    return t
