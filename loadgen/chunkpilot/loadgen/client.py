"""One streamed request against an OpenAI-compatible completions endpoint, timed chunk by chunk."""

from __future__ import annotations

import json
import time

import httpx

from chunkpilot.loadgen.stats import RequestRecord
from chunkpilot.contract.slo import CLASS_HEADERS
from chunkpilot.loadgen.workloads import RequestSpec


async def send(client: httpx.AsyncClient, base_url: str, model: str, spec: RequestSpec,
               api_key: str | None = None) -> RequestRecord:
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            # every chunk's usage: how many tokens a chunk stands for (stats.RequestRecord.timed_itls)
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if spec.slo_class:
        headers[CLASS_HEADERS[0]] = spec.slo_class
    rec = RequestRecord(kind=spec.kind, prompt_tokens=spec.prompt_tokens, start=time.monotonic())
    try:
        async with client.stream("POST", base_url.rstrip("/") + "/v1/completions", json=body, headers=headers) as res:
            if res.status_code != 200:
                rec.error = f"HTTP {res.status_code}: {(await res.aread())[:200]!r}"
                return rec
            async for line in res.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "stream error")
                    return rec
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        if rec.first_token is None:
                            rec.first_token = now
                        rec.token_times.append(now)
                        if chunk.get("usage"):
                            rec.token_counts.append(chunk["usage"]["completion_tokens"])
            rec.end = time.monotonic()
            if rec.first_token is None:
                rec.first_token = rec.end  # every token was held back (e.g. a stop string): counts at the end
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec
