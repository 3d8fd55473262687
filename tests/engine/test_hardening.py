"""Hostile input and hostile tenants against the engine (the adversarial review's findings): huge bodies and
prompts, unbounded lists, clients that stop reading, a hung step loop, and one tenant probing another's prefix
cache. Each test failed on the server before these limits existed."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from chunkpilot.engine.core.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

from .server_proc import EngineServer, assert_openai_error, wait_for
from .tiny_models import make_checkpoint

MAX_LEN = 512
# The engine pod's liveness probe gives /health 3 s (operator/builders.py); the server must stay far inside it.
LIVENESS_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    """Two API keys (two tenants), cached-token counts hidden, a small body cap."""
    srv = EngineServer(smollm2_dir, tmp_path_factory.mktemp("logs"), "--max-model-len", str(MAX_LEN),
                       "--max-request-bytes", str(2**20), "--disable-prompt-tokens-details",
                       env={"CHUNKPILOT_API_KEY": "key-a,key-b"}).wait_ready()
    yield srv
    srv.stop()


A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


def post(srv, body, headers=A, path="/v1/completions", **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60, **kw)


def _watch_health(url: str, stop, worst, failures, polls) -> None:
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            r = c.get(url + "/health")
            worst.value = max(worst.value, time.monotonic() - t0)
            polls.value += 1
            if r.status_code != 200:
                failures.value += 1
            time.sleep(0.02)


class HealthWatch:
    """Polls /health from a process of its own while a test attacks the server (in this process, building a 21 MB
    body would hold the GIL and stall the poller itself); `worst` is the slowest answer seen."""

    def __init__(self, url: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._stop, self._worst = ctx.Event(), ctx.Value("d", 0.0)
        self._failures, self._polls = ctx.Value("i", 0), ctx.Value("i", 0)
        self.proc = ctx.Process(target=_watch_health, args=(url, self._stop, self._worst, self._failures,
                                                            self._polls), daemon=True)

    def __enter__(self) -> "HealthWatch":
        self.proc.start()
        assert wait_for(lambda: self._polls.value > 0, 60), "the /health poller did not start"
        return self

    def __exit__(self, *exc) -> None:
        # One more answer after the attack: the poller polled from before it to after it, so any stall of the
        # server in between held up one of its requests and shows in `worst` (how many polls fit in between
        # depends on how fast the attack went, so no count is required).
        at_end = self._polls.value
        self.polled_through = wait_for(lambda: self._polls.value > at_end, 30)
        self._stop.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.worst, self.failures, self.polls = self._worst.value, self._failures.value, self._polls.value


def test_huge_bodies_and_prompts_are_refused_without_stalling_health(server):
    huge = "word " * 4_200_000  # 21 MB, the review's prompt
    with HealthWatch(server.url) as watch:
        # declared Content-Length over the cap: 413 before the body is read
        assert_openai_error(post(server, {"model": "smollm2", "prompt": huge}), 413, "larger than 1048576 bytes")

        # a chunked upload with no Content-Length: the bytes actually streamed count
        def chunks():
            yield b'{"model": "smollm2", "prompt": "'
            for _ in range(300):
                yield b"word " * 2000
            yield b'"}'

        r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={**A, "Content-Type": "application/json"},
                       timeout=60)
        assert_openai_error(r, 413, "--max-request-bytes")
        # under the body cap but longer than max_model_len tokens could spell: refused before tokenizing
        assert_openai_error(post(server, {"model": "smollm2", "prompt": "word " * 180_000}), 400, "characters")
        # 100k chat messages do not fit the body cap; 10k fit it but not max_model_len
        many = [{"role": "user", "content": "hi"}] * 100_000
        assert_openai_error(post(server, {"model": "smollm2", "messages": many}, path="/v1/chat/completions"), 413)
        assert_openai_error(post(server, {"model": "smollm2", "messages": many[:10_000]},
                                 path="/v1/chat/completions"), 400, "10000 entries")
        # a token-id prompt longer than max_model_len
        assert_openai_error(post(server, {"model": "smollm2", "prompt": [1] * 100_000}), 400, "100000 tokens")
    print(f"worst /health answer during the attack: {watch.worst * 1000:.0f} ms")  # printed with pytest -s
    assert watch.polled_through and not watch.failures and watch.worst < LIVENESS_TIMEOUT / 3, vars(watch)
    # and the server still serves
    assert post(server, {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}).json()["usage"]["completion_tokens"] == 2


def test_stop_lists_are_bounded(server):
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
    assert_openai_error(post(server, {**body, "stop": [f"s{i}" for i in range(100_000)]}), 400, "stop")
    assert_openai_error(post(server, {**body, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}), 400, "stop")
    assert_openai_error(post(server, {**body, "stop": "y" * (MAX_STOP_CHARS + 1)}), 400, "stop")
    assert_openai_error(post(server, {**body, "stop_token_ids": list(range(1000))}), 400, "stop_token_ids")
    assert post(server, {**body, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)]}).status_code == 200


def test_tenants_do_not_share_the_prefix_cache_and_usage_hides_cached_tokens(server):
    def hits() -> float:
        return server.metrics()["chunkpilot:prefix_cache_hits_total"]

    prompt = "Tenants must not learn each other's prompts. " * 12  # several full KV blocks

    def run(headers, **extra):
        r = post(server, {"model": "smollm2", "prompt": prompt, "max_tokens": 1, **extra}, headers)
        assert r.status_code == 200, r.text
        assert "prompt_tokens_details" not in r.json()["usage"]

    run(A)
    before = hits()
    run(A)  # the same tenant reuses its own prefix
    assert hits() > before
    before = hits()
    run(B)  # the other tenant finds nothing
    assert hits() == before
    run(A, cache_salt="conversation-2")  # a request's own salt separates it too, as vLLM's cache_salt
    assert hits() == before


def test_finished_but_unread_outputs_do_not_hold_admission_slots(tmp_path):
    """Admission counts what the engine holds. Before, a finished request whose client had not read its output
    yet counted as waiting, and 32 such streams gave everyone 429 on an idle engine."""
    from chunkpilot.engine import EngineConfig
    from chunkpilot.engine.async_engine import AsyncEngine
    from chunkpilot.engine.llm_engine import LLMEngine
    from chunkpilot.engine.metrics import EngineMetrics
    from chunkpilot.engine.core.sampling_params import SamplingParams

    model = make_checkpoint(tmp_path / "tiny", "llama")
    llm = LLMEngine(EngineConfig(model=str(model), max_model_len=128, max_num_seqs=2, token_budget=64, max_chunk=64))
    engine = AsyncEngine(llm, EngineMetrics("tiny", 128), max_waiting=1)
    engine.start()

    async def main():
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        unread = [engine.generate(f"r{i}", [1, 2, 3], params) for i in range(3)]
        for gen in unread:
            await gen.__anext__()  # each read its first token, then stops reading
        # the engine finishes all three; their outputs sit unread in their queues
        assert await asyncio.to_thread(wait_for, lambda: not llm.has_unfinished() and engine.num_waiting == 0, 30)
        fresh = engine.generate("r-new", [4, 5, 6], params)
        outs = [out async for out in fresh]  # admitted, not QueueFullError
        assert outs[-1].finished and outs[-1].num_output_tokens == 3
        for gen in unread:
            await gen.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def tiny_app(tmp_path_factory):
    """The server in-process (starlette's TestClient runs its lifespan) on a tiny random model."""
    from starlette.testclient import TestClient

    from chunkpilot.engine import EngineConfig
    from chunkpilot.engine.serving.server import ServerSettings, build_app

    model = make_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", "llama")
    app = build_app(ServerSettings(EngineConfig(model=str(model), max_model_len=256), served_model_name="tiny",
                                   stream_write_timeout=0.5, stall_timeout=1.0))
    with TestClient(app) as client:
        assert wait_for(lambda: client.get("/ready").status_code == 200, timeout=60)
        yield app, client


def test_a_stream_whose_client_reads_nothing_is_aborted_after_the_write_timeout(tiny_app):
    """The ASGI app is driven directly with a `send` that blocks once the first event is out: a client whose
    socket is full. The stream must end (request aborted, engine slot freed) after the write timeout."""
    app, _ = tiny_app
    engine = app.state.server.engine
    body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 200, "ignore_eos": true, "stream": true}'
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def drive() -> int:
        sent, never = [], asyncio.Event()
        received = False

        async def receive():
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()  # the client never hangs up either

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and len(sent) > 2:
                await never.wait()  # socket full: this write never completes

        await app(scope, receive, send)
        return len(sent)

    started = time.monotonic()
    assert asyncio.run(asyncio.wait_for(drive(), 30)) >= 3
    assert time.monotonic() - started < 20
    assert wait_for(lambda: engine.num_in_flight == 0 and not engine.engine.has_unfinished(), timeout=10)


def test_health_fails_when_a_step_hangs(tiny_app):
    app, client = tiny_app
    llm = app.state.server.engine.engine
    release, real_step = threading.Event(), llm.step

    def hung_step():
        release.wait(30)
        return real_step()

    llm.step = hung_step
    try:
        t = threading.Thread(target=client.post, args=("/v1/completions",),
                             kwargs={"json": {"model": "tiny", "prompt": "hi", "max_tokens": 2}}, daemon=True)
        t.start()
        assert wait_for(lambda: client.get("/health").status_code == 503, timeout=15)
        assert "--stall-timeout" in client.get("/health").json()["reason"]
    finally:
        llm.step = real_step
        release.set()
    t.join(30)
    assert wait_for(lambda: client.get("/health").status_code == 200, timeout=10)


def test_health_fails_after_a_failed_load_so_the_pod_restarts(tmp_path):
    from starlette.testclient import TestClient

    from chunkpilot.engine import EngineConfig
    from chunkpilot.engine.serving.server import ServerSettings, build_app

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    app = build_app(ServerSettings(EngineConfig(model=str(bad)), served_model_name="bad"))
    with TestClient(app) as client:
        assert wait_for(lambda: client.get("/health").status_code == 503, timeout=30)
        assert "failed to load" in client.get("/health").json()["reason"]
        assert client.get("/ready").status_code == 503


def test_a_model_that_fails_to_load_ends_the_engine_process_with_the_error_last(smollm2_dir, tmp_path):
    """In a pod (--exit-on-load-failure, set by the operator) a truncated weights file ends the process with
    status 1 at once, the error as the last log line (the container's termination message), instead of the
    start-up probe failing for up to its whole timeout."""
    import shutil

    from .server_proc import EngineServer

    bad = tmp_path / "truncated"
    shutil.copytree(smollm2_dir, bad)
    weights = sorted(bad.glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])  # a copy cut off a third of the way
    server = EngineServer(str(bad), tmp_path, "--exit-on-load-failure", "--log-level", "info")  # uvicorn's lines too
    try:
        assert server.proc.wait(timeout=120) == 1, server.log()
        last = server.log().strip().splitlines()[-1]
        assert "model failed to load from" in last and str(bad) in last and "exiting" in last, server.log()
    finally:
        server.stop()


def test_drain_covers_requests_still_being_tokenized_and_refuses_them_after_the_grace(tmp_path):
    """A request admitted before SIGTERM but still in the tokenizer gets the grace period too; one that comes
    out of it after the grace period is refused (503), not submitted where nobody would abort it."""
    from chunkpilot.engine import EngineConfig
    from chunkpilot.engine.async_engine import AsyncEngine, EngineUnavailableError
    from chunkpilot.engine.llm_engine import LLMEngine
    from chunkpilot.engine.metrics import EngineMetrics
    from chunkpilot.engine.core.sampling_params import SamplingParams

    model = make_checkpoint(tmp_path / "tiny", "llama")
    llm = LLMEngine(EngineConfig(model=str(model), max_model_len=128, max_num_seqs=2, token_budget=64, max_chunk=64))
    release, real = threading.Event(), llm.make_sequence

    def slow_tokenizer(*args, **kwargs):
        release.wait(30)
        return real(*args, **kwargs)

    llm.make_sequence = slow_tokenizer
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def within_grace():
        engine = AsyncEngine(llm, EngineMetrics("tiny", 128))
        engine.start()
        try:
            outs = asyncio.ensure_future(_collect(engine.generate("a", [1, 2, 3], params)))
            await asyncio.sleep(0)  # admitted: now tokenizing
            drain = asyncio.ensure_future(engine.drain(30))
            await asyncio.sleep(0.3)
            assert not drain.done()  # it waits for the request in the tokenizer
            release.set()
            assert (await outs)[-1].num_output_tokens == 2  # served, not aborted
            await asyncio.wait_for(drain, 10)
        finally:
            engine.stop()

    async def after_grace():
        release.clear()
        engine = AsyncEngine(llm, EngineMetrics("tiny", 128))
        engine.start()
        try:
            outs = asyncio.ensure_future(_collect(engine.generate("b", [1, 2, 3], params)))
            await asyncio.sleep(0)
            await engine.drain(0)
            release.set()
            with pytest.raises(EngineUnavailableError, match="shutting down"):
                await asyncio.wait_for(outs, 10)
        finally:
            engine.stop()

    asyncio.run(asyncio.wait_for(within_grace(), 60))
    asyncio.run(asyncio.wait_for(after_grace(), 60))


async def _collect(gen):
    return [out async for out in gen]
