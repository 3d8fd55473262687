"""chunkpilot's serving engine: paged KV cache, stall-free chunked prefill, knobs that change while it runs."""

from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.knobs import SchedulerKnobs
from chunkpilot.engine.llm import LLM
from chunkpilot.engine.llm_engine import LLMEngine
from chunkpilot.engine.outputs import CompletionOutput, RequestOutput
from chunkpilot.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "SchedulerKnobs",
    "CompletionOutput",
    "RequestOutput",
]
