"""chunkpilot's serving engine: paged KV cache, stall-free chunked prefill, knobs that change while it runs.

The public names load lazily (PEP 562), so the torch-free parts (metrics names, knobs, scheduler, block manager)
can be imported by the tuner and its simulator without pulling in torch."""

from __future__ import annotations

from chunkpilot.contract import lazy

_EXPORTS = {
    "LLM": "chunkpilot.engine.llm",
    "LLMEngine": "chunkpilot.engine.llm_engine",
    "EngineConfig": "chunkpilot.engine.config",
    "SamplingParams": "chunkpilot.engine.core.sampling_params",
    "SchedulerKnobs": "chunkpilot.engine.core.knobs",
    "CompletionOutput": "chunkpilot.engine.core.outputs",
    "RequestOutput": "chunkpilot.engine.core.outputs",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy.exports(__name__, _EXPORTS)
