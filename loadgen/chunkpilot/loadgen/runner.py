"""Run a workload against a server: requests at their arrival times (or at a fixed concurrency), a progress bar,
and the result with the run's conditions."""

from __future__ import annotations

import asyncio
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import httpx
from tqdm.auto import tqdm

from chunkpilot.contract.slo import SLOTargets
from chunkpilot.loadgen.client import send
from chunkpilot.loadgen.stats import RequestRecord, summarize
from chunkpilot.loadgen.workloads import RequestSpec


@dataclass
class BenchmarkConfig:
    base_url: str
    model: str
    requests: list[RequestSpec]
    concurrency: int | None = None  # fixed concurrency instead of arrival times
    slo: SLOTargets = field(default_factory=SLOTargets)
    api_key: str | None = None
    timeout: float = 600.0
    progress: bool = True
    label: str = ""


@dataclass
class BenchmarkResult:
    summary: dict
    records: list[RequestRecord]
    conditions: dict

    def to_json(self) -> dict:
        return {"conditions": self.conditions, "summary": self.summary,
                "records": [asdict(r) | {"ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot} for r in self.records]}


def run_benchmark(config: BenchmarkConfig) -> BenchmarkResult:
    return asyncio.run(run_benchmark_async(config))


async def run_benchmark_async(config: BenchmarkConfig) -> BenchmarkResult:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=config.timeout, limits=limits) as client:
        conditions = await _conditions(client, config)
        bar = tqdm(total=len(config.requests), desc=config.label or "requests", disable=not config.progress)
        start = time.monotonic()

        async def one(spec: RequestSpec) -> RequestRecord:
            rec = await send(client, config.base_url, config.model, spec, config.api_key)
            bar.update(1)
            return rec

        if config.concurrency:
            records = await _fixed_concurrency(config.requests, config.concurrency, one)
        else:
            async def at(spec: RequestSpec) -> RequestRecord:
                await asyncio.sleep(max(0.0, start + spec.arrival - time.monotonic()))
                return await one(spec)

            records = await asyncio.gather(*(at(s) for s in config.requests))
        bar.close()
        duration = time.monotonic() - start
    return BenchmarkResult(summarize(list(records), config.slo, duration=duration), list(records), conditions)


async def _fixed_concurrency(specs, n, one):
    queue: asyncio.Queue = asyncio.Queue()
    for i, s in enumerate(specs):
        queue.put_nowait((i, s))
    results: list = [None] * len(specs)

    async def worker():
        while not queue.empty():
            i, s = queue.get_nowait()
            results[i] = await one(s)

    await asyncio.gather(*(worker() for _ in range(n)))
    return results


async def _conditions(client: httpx.AsyncClient, config: BenchmarkConfig) -> dict:
    """What the numbers depend on: server knobs, machine, workload."""
    knobs = None
    try:
        ready = (await client.get(config.base_url.rstrip("/") + "/ready", timeout=5)).json()
        knobs = ready.get("knobs")
    except (httpx.HTTPError, ValueError):
        pass
    kinds: dict[str, int] = {}
    for s in config.requests:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return {
        "label": config.label, "base_url": config.base_url, "model": config.model, "knobs": knobs,
        "requests": len(config.requests), "kinds": kinds, "concurrency": config.concurrency,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
