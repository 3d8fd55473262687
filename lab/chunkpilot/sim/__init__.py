"""A virtual-clock model of the engine: the real Scheduler and BlockManager, a fitted step-time cost model.

Public names, loaded lazily (PEP 562): the simulator and the cost that drives it, the prefill/decode split and
the KV transfer's cost."""

from __future__ import annotations

from chunkpilot.contract import lazy

_EXPORTS = {"Simulator": "chunkpilot.sim.simulator", "FittedCost": "chunkpilot.sim.costmodel",
            "SplitFleet": "chunkpilot.sim.split", "TransferCost": "chunkpilot.sim.transfer"}
__all__ = list(_EXPORTS)


__getattr__ = lazy.exports(__name__, _EXPORTS)
