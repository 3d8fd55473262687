"""OpenAI response bodies (whole and streamed chunks) built from the engine's incremental outputs.

`stream` is what `server._start` returns: the first output, already awaited, and the generator for the rest.
"""

from __future__ import annotations

import time
from dataclasses import replace

from chunkpilot.engine.core.outputs import RequestOutput, TokenLogprob
from chunkpilot.engine.model.tokenizer import Tokenizer
from chunkpilot.engine.serving.protocol import ChatCompletionRequest, CompletionRequest


async def _outputs(stream):
    first, gen = stream
    try:
        yield first
        if not first.finished:
            async for out in gen:
                yield out
    finally:
        await gen.aclose()


def _usage(out: RequestOutput, details: bool) -> dict:
    usage = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
             "total_tokens": out.num_prompt_tokens + out.num_output_tokens}
    if details:  # off with --disable-prompt-tokens-details: the count tells what the prefix cache holds
        usage["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
    return usage


def _usage_options(body: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(the last chunk carries the usage, every chunk does: vLLM's continuous_usage_stats, with include_usage)."""
    o = body.stream_options
    return bool(o and o.include_usage), bool(o and o.include_usage and o.continuous_usage_stats)


def _finish(out: RequestOutput) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(out.finish_reason) if out.finished else None


def _completion_logprobs(lps: list[TokenLogprob], tok, offset: int = 0) -> dict | None:
    tokens = [tok.decode([lp.token_id], skip_special_tokens=False) for lp in lps]
    offsets = []
    for t in tokens:  # character offset of each token in the completion text
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{tok.decode([t], skip_special_tokens=False): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(lps: list[TokenLogprob], tok) -> dict:
    def entry(t: int, v: float) -> dict:
        s = tok.decode([t], skip_special_tokens=False)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


async def _collect(stream) -> tuple[str, list[TokenLogprob], RequestOutput]:
    text, lps, last = "", [], None
    async for out in _outputs(stream):
        text += out.new_text
        lps.extend(out.new_logprobs)
        last = out
    return text, lps, last


async def completion_full(stream, rid: str, model: str, tok: Tokenizer, details: bool = True) -> dict:
    text, lps, last = await _collect(stream)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": _completion_logprobs(lps, tok) if lps else None,
                         "finish_reason": _finish(last)}],
            "usage": _usage(last, details)}


async def completion_chunks(stream, rid: str, model: str, body: CompletionRequest, tok: Tokenizer,
                            details: bool = True):
    include_usage, continuous = _usage_options(body)
    created, last, offset = int(time.time()), None, 0
    async for out in _outputs(stream):
        last = out
        if not out.new_text and not out.finished and not out.new_logprobs:
            continue
        lp = _completion_logprobs(out.new_logprobs, tok, offset) if out.new_logprobs else None
        offset += sum(len(t) for t in lp["tokens"]) if lp else 0
        chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                 "choices": [{"index": 0, "text": out.new_text, "logprobs": lp, "finish_reason": _finish(out)}]}
        if include_usage:
            chunk["usage"] = _usage(out, details) if continuous else None
        yield chunk
    if include_usage and last is not None:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": _usage(last, details)}


async def chat_full(stream, rid: str, model: str, tok: Tokenizer, details: bool = True) -> dict:
    text, lps, last = await _collect(stream)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": _chat_logprobs(lps, tok) if lps else None, "finish_reason": _finish(last)}],
            "usage": _usage(last, details)}


async def chat_chunks(stream, rid: str, model: str, body: ChatCompletionRequest, tok: Tokenizer,
                      details: bool = True):
    include_usage, continuous = _usage_options(body)
    created, last = int(time.time()), None

    def chunk(delta: dict, finish=None, logprobs=None, out: RequestOutput | None = None) -> dict:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = _usage(out, details) if continuous and out is not None else None
        return c

    # with continuous usage the role chunk counts too, as vLLM's does: the prompt, no completion token yet
    yield chunk({"role": "assistant", "content": ""}, out=replace(stream[0], num_output_tokens=0))
    async for out in _outputs(stream):
        last = out
        if not out.new_text and not out.finished and not out.new_logprobs:
            continue
        lp = _chat_logprobs(out.new_logprobs, tok) if out.new_logprobs else None
        yield chunk({"content": out.new_text} if out.new_text else {}, _finish(out), lp, out)
    if include_usage and last is not None:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": _usage(last, details)}

