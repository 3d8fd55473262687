"""The step loop's metrics come from the engine's one typed object per step (chunkpilot.engine.core.stats), and the
server reads the engine only through AsyncEngine's facade.

The stand-in engine below is the whole surface the step loop may use of LLMEngine: if AsyncEngine reached for
anything else (the scheduler's queues, the block manager's counters), this test would fail with an
AttributeError in the loop."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.contract.metric_names import (KV_CACHE_USAGE, NUM_RUNNING, NUM_WAITING, PREEMPTIONS,
                                              PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES)
from chunkpilot.contract.step_cost import step_features
from chunkpilot.engine.async_engine import AsyncEngine
from chunkpilot.engine.core.knobs import KnobHolder
from chunkpilot.engine.core.stats import SchedulerStats, StepStats
from chunkpilot.engine.metrics import EngineMetrics

ENGINE = Path(__file__).resolve().parents[2] / "engine_image" / "chunkpilot" / "engine"


class ScriptedEngine:
    """Steps through `script` (one SchedulerStats after each step), then has nothing left to do."""

    def __init__(self, script: list[SchedulerStats]) -> None:
        self.knobs = KnobHolder(SchedulerKnobs(token_budget=64, max_chunk=32))
        self.script, self.done = list(script), threading.Event()
        self.current = SchedulerStats(StepStats(), 0, 0, 0.0, 0, 0, 0)
        self.num_waiting = 0

    def has_unfinished(self) -> bool:
        if not self.script:
            self.done.set()
        return bool(self.script)

    def step(self) -> list:
        self.current = self.script.pop(0)
        return []

    def stats(self) -> SchedulerStats:
        return self.current

    def close(self, force: bool = False) -> None:
        pass


def test_counters_follow_the_engines_totals_and_gauges_its_last_state():
    prefill, decode = step_features([(0, 40, False)]), step_features([(40, 1, True)] * 3)
    steps = [SchedulerStats(StepStats(num_tokens=40, num_prefill_tokens=40, features=prefill), 1, 2, 0.25, 32, 16, 0),
             SchedulerStats(StepStats(num_tokens=3, num_decodes=3, features=decode), 3, 0, 0.5, 32, 16, 1),
             SchedulerStats(StepStats(num_tokens=9, num_decodes=2, num_prefill_tokens=7, features=prefill),
                            2, 1, 0.75, 48, 24, 2)]
    engine = ScriptedEngine(steps)
    metrics = EngineMetrics("m", 128)
    loop = AsyncEngine(engine, metrics)  # type: ignore[arg-type]: the stand-in is the facade's whole surface
    loop.start()
    try:
        # done is set by the loop's own check after its last step was recorded: the reads below see every step
        assert engine.done.wait(10), "the step loop did not run the script"
        assert loop.error is None, loop.error
        read = lambda name: metrics.registry.get_sample_value(name, {"model_name": "m"})  # noqa: E731
        assert read(PREFIX_CACHE_QUERIES) == 48 and read(PREFIX_CACHE_HITS) == 24  # totals, counted once
        assert read(PREEMPTIONS) == 2
        assert (read(NUM_RUNNING), read(NUM_WAITING), read(KV_CACHE_USAGE)) == (2, 1, 0.75)
        assert metrics.registry.get_sample_value("chunkpilot:iteration_tokens_total_count", {"model_name": "m"}) == 3
    finally:
        loop.stop()


def test_the_server_reads_the_engine_only_through_its_facade():
    """The server (its routes, the prefill role's included), async_engine.py and the decode side of disaggregation
    name none of LLMEngine's parts (its scheduler, block manager, runner,
    workers, last step) and the server never reaches through AsyncEngine to the LLMEngine behind it."""
    inner = {"scheduler", "block_manager", "runner", "last_step", "worker", "_workers", "_live"}
    for name in ("serving/server.py", "serving/kv_routes.py", "async_engine.py", "kv_transfer/decode_side.py"):
        tree = ast.parse((ENGINE / name).read_text())
        attrs = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
        assert not [a.attr for a in attrs if a.attr in inner - ({"_live"} if name == "async_engine.py" else set())]
        if name == "serving/server.py":
            through = [ast.unparse(a) for a in attrs
                       if a.attr == "engine" and isinstance(a.value, ast.Attribute) and a.value.attr == "engine"]
            chained = [ast.unparse(a) for a in attrs if isinstance(a.value, ast.Attribute) and a.value.attr == "engine"
                       and isinstance(a.value.value, ast.Attribute) and a.value.value.attr == "engine"]
            assert not through and not chained, through + chained
