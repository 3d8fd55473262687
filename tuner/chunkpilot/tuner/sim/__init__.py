"""A virtual-clock model of the engine: the real Scheduler and BlockManager, a fitted step-time cost model."""
