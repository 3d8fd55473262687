"""A serving load generator (like `vllm bench serve`): workloads, arrivals, streaming client, statistics."""

from chunkpilot.loadgen.runner import BenchmarkConfig, run_benchmark
from chunkpilot.loadgen.stats import RequestRecord, summarize
from chunkpilot.loadgen.workloads import Phase, RequestSpec, build_workload

__all__ = ["BenchmarkConfig", "run_benchmark", "RequestRecord", "summarize", "Phase", "RequestSpec",
           "build_workload"]
