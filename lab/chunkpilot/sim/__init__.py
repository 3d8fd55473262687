"""A virtual-clock model of the engine: the real Scheduler and BlockManager, a fitted step-time cost model.

Public names, loaded lazily (PEP 562): the simulator and the cost that drives it."""

from __future__ import annotations

from chunkpilot.contract import lazy

_EXPORTS = {"Simulator": "chunkpilot.sim.simulator", "FittedCost": "chunkpilot.sim.costmodel"}
__all__ = list(_EXPORTS)


__getattr__ = lazy.exports(__name__, _EXPORTS)
