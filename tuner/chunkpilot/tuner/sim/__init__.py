"""A virtual-clock model of the engine: the real Scheduler and BlockManager, a fitted step-time cost model.

Public names, loaded lazily (PEP 562): the simulator and the cost that drives it."""

from __future__ import annotations

import importlib

_EXPORTS = {"Simulator": "chunkpilot.tuner.sim.simulator", "FittedCost": "chunkpilot.tuner.sim.costmodel"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'chunkpilot.tuner.sim' has no attribute {name!r}")
