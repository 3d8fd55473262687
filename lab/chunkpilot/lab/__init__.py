"""What the demo, the benchmarks and the tests run beside the product, and no image ships: child processes
(engines, Prometheus) started and stopped cleanly, and a Prometheus server for local use. The simulator
(`chunkpilot.sim`) and the demo (`chunkpilot.demo`) live in this folder too.

Public names, loaded lazily (PEP 562)."""

from __future__ import annotations

from chunkpilot.contract import lazy

_EXPORTS = {
    "PrometheusServer": "chunkpilot.lab.prometheus_server",
    "free_port": "chunkpilot.lab.child_process", "stop_process": "chunkpilot.lab.child_process",
    "wait_http_ready": "chunkpilot.lab.child_process", "die_with_parent": "chunkpilot.lab.child_process",
    "log_tail": "chunkpilot.lab.child_process",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy.exports(__name__, _EXPORTS)
