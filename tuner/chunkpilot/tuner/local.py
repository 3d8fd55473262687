"""Local mode: the tuning path without a cluster. Knobs go into a plain knobs file that every engine watches
(`chunkpilot engine serve --knobs-file`), Prometheus tells when each engine applied them, and the state goes to a
JSON file and the log instead of the custom resource."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from chunkpilot.contract.knobs import SchedulerKnobs, parse_knobs, write_knobs
from chunkpilot.tuner.config import TuningConfig, build_loop
from chunkpilot.tuner.loop import TunerLoop
from chunkpilot.tuner.metrics import TunerMetrics
from chunkpilot.tuner.prometheus import PrometheusMeasurer, PrometheusSource
from chunkpilot.tuner.space import Knobs
from chunkpilot.tuner.state import TunerState, conditions, dump, status_slo, status_tuning

log = logging.getLogger(__name__)


class FileActuator:
    def __init__(self, path: str | Path, source: PrometheusSource, start: Knobs) -> None:
        self.path = Path(path)
        self.source = source
        try:  # resume from what the engines already run
            k = parse_knobs(self.path.read_bytes())
            self._knobs, self._generation = k.knobs, k.generation
        except (OSError, ValueError):
            self._knobs, self._generation = start, 0
            write_knobs(self.path, SchedulerKnobs.of(start))

    def apply(self, knobs: Knobs) -> int:
        self._generation += 1
        write_knobs(self.path, SchedulerKnobs.of(knobs, self._generation))
        self._knobs = knobs
        log.info("knobs -> token budget %d, max chunk %d (generation %d)", knobs.token_budget, knobs.max_chunk,
                 self._generation)
        return self._generation

    def applied(self, generation: int) -> bool:
        return self.source.all_applied(generation)

    def current(self) -> Knobs:
        return self._knobs


class FilePublisher:
    """Writes what the cluster mode would put in status, as JSON; logs phase changes; updates the metrics."""

    def __init__(self, config: TuningConfig, status_file: str | Path | None, metrics: TunerMetrics | None) -> None:
        self.config = config
        self.status_file = Path(status_file) if status_file else None
        self.metrics = metrics
        self._last = None

    def publish(self, state: TunerState) -> None:
        s = self.config.settings
        slo = status_slo(state.current_window, self.config.slo)
        doc = {"tuning": dump(status_tuning(state, self.config.slo, s.objective)),
               "slo": dump(slo) if slo is not None else None,
               "conditions": [dump(c) for c in conditions(state, self.config.slo)],
               "history": [h.to_dict() for h in state.history]}
        if self.status_file:
            tmp = self.status_file.with_name(f".{self.status_file.name}.tmp")
            tmp.write_text(json.dumps(doc, indent=1, default=str))
            tmp.replace(self.status_file)
        line = (state.phase, state.healthy, state.reason)
        if line != self._last:
            log.info("tuner %s: %s", state.phase, state.reason)
            self._last = line
        if self.metrics is not None:
            ns, _, name = self.config.deployment.rpartition("/")
            self.metrics.update(ns or "local", name, state, self.config.slo, s.objective)


def build_local(config: TuningConfig, *, knobs_file: str | Path, prometheus_url: str, selector: str,
                start: Knobs, status_file: str | Path | None = None, metrics: TunerMetrics | None = None,
                stop: threading.Event | None = None) -> TunerLoop:
    stop = stop or threading.Event()
    source = PrometheusSource(prometheus_url, selector)
    measurer = PrometheusMeasurer(source, config.slo, sleep=stop.wait)  # a stop request ends any wait at once
    return build_loop(config, FileActuator(knobs_file, source, start), measurer,
                      FilePublisher(config, status_file, metrics))
