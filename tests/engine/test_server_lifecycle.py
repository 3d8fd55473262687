"""Server behaviour around the requests: API keys, a full queue, SIGTERM draining, and schemathesis fuzzing
the server's own OpenAPI schema for 5xx answers."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from .server_proc import EngineServer, wait_for
from .tiny_models import make_checkpoint

LONG = {"model": "smollm2", "prompt": "Count: 1, 2, 3,", "max_tokens": 300, "ignore_eos": True, "stream": True}


def stream_in_thread(url: str, body: dict, headers: dict | None = None):
    """Read an SSE stream on a thread; returns (thread, chunks list, state dict). Setting state["stop"] makes the
    reader hang up (the server then aborts the request)."""
    chunks: list[dict] = []
    state: dict = {}

    def run():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers or {}, timeout=120) as r:
                state["status"] = r.status_code
                for line in r.iter_lines():
                    if state.get("stop"):
                        return
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                    elif line == "data: [DONE]":
                        state["done"] = True
        except httpx.HTTPError as e:
            state["error"] = repr(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, chunks, state


@pytest.fixture(scope="module")
def keyed(smollm2_dir, tmp_path_factory):
    """One running sequence at most and one waiting: the third concurrent request overflows."""
    srv = EngineServer(smollm2_dir, tmp_path_factory.mktemp("logs"), "--max-num-seqs", "1", "--token-budget", "16",
                       "--max-chunk", "16", "--max-waiting", "1", "--max-model-len", "512", "--grace-period", "1",
                       env={"CHUNKPILOT_API_KEY": "s3cret"}).wait_ready()
    yield srv
    srv.stop()


def test_api_key_is_required_on_the_api_only(keyed):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.post(keyed.url + "/v1/completions", json={"model": "smollm2", "prompt": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(keyed.url + path).status_code == 200
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
    assert client.completions.create(model="smollm2", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_full_queue_answers_429_with_retry_after(keyed):
    auth = {"Authorization": "Bearer s3cret"}
    running = stream_in_thread(keyed.url, LONG, auth)
    assert wait_for(lambda: len(running[1]) >= 1)
    waiting = stream_in_thread(keyed.url, LONG, auth)
    assert wait_for(lambda: keyed.metrics()["chunkpilot:num_requests_waiting"] == 1, timeout=10)
    r = httpx.post(keyed.url + "/v1/completions", json={**LONG, "stream": False}, headers=auth, timeout=30)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    rejected = keyed.metrics()["chunkpilot:requests_rejected_total[('reason', 'queue_full')]"]
    assert rejected == 1
    for t, _, state in (running, waiting):  # hang up: the later tests get the CPU back
        state["stop"] = True
        t.join(30)
    assert wait_for(lambda: keyed.metrics()["chunkpilot:num_requests_running"] == 0, timeout=10)


def test_sigterm_drains_in_flight_requests_then_exits_0(smollm2_dir, tmp_path):
    # A grace period no drain reaches (on a shared 2-core host 150 tokens can take more than a minute, and a 60-s
    # period once cut the stream): this test is about draining; what outlives the grace period is the next test's.
    srv = EngineServer(smollm2_dir, tmp_path, "--max-model-len", "256", "--grace-period", "600").wait_ready()
    body = {**LONG, "max_tokens": 150}  # long enough to still be streaming while the test checks the drain
    t, chunks, state = stream_in_thread(srv.url, body)
    assert wait_for(lambda: len(chunks) >= 2)
    srv.proc.send_signal(signal.SIGTERM)
    # While draining the pod may still be an endpoint: the port stays open, liveness holds, readiness drops,
    # and new work is refused with a proper error.
    assert wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 503, timeout=10), srv.log()
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    t.join(600)
    assert srv.proc.wait(600) == 0, srv.log()
    assert state.get("done") and chunks[-1].get("choices") and chunks[-1]["choices"][0]["finish_reason"] == "length", \
        (chunks[-1], srv.log())
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 140


def test_sigterm_aborts_what_outlives_the_grace_period_with_an_error_event(smollm2_dir, tmp_path):
    srv = EngineServer(smollm2_dir, tmp_path, "--max-model-len", "512", "--grace-period", "1").wait_ready()
    t, chunks, state = stream_in_thread(srv.url, {**LONG, "max_tokens": 450})
    whole: dict = {}
    t2 = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
        srv.url + "/v1/completions", json={**LONG, "stream": False, "max_tokens": 450}, timeout=60)), daemon=True)
    t2.start()
    assert wait_for(lambda: len(chunks) >= 2 and srv.metrics()["chunkpilot:num_requests_running"] == 2)
    started = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0, srv.log()
    assert time.monotonic() - started < 15
    t.join(10)
    t2.join(10)
    # the non-streaming request gets a 503 that says to retry, not a dropped connection
    assert whole["r"].status_code == 503 and "retry" in whole["r"].json()["error"]["message"], whole
    assert not any(c.get("choices") and c["choices"][0]["finish_reason"] == "length" for c in chunks)
    # not a bare EOF: the client is told why, in OpenAI's error body, and the stream ends with [DONE]
    assert chunks[-1]["error"]["type"] == "service_unavailable" and "retry" in chunks[-1]["error"]["message"]
    assert state.get("done"), state


def test_schemathesis_finds_no_server_errors(tmp_path):
    """Fuzz every operation of the server's own OpenAPI schema (bounded) against a tiny random model, which
    makes each generation fast; the check is only that nothing answers 5xx."""
    st = shutil.which("schemathesis") or shutil.which("st", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert st, "schemathesis is a dev dependency: pip install -e '.[dev]'"
    model = make_checkpoint(tmp_path / "tiny", "llama")
    srv = EngineServer(str(model), tmp_path, "--max-model-len", "128", name="tiny").wait_ready()
    try:
        res = subprocess.run(
            # --max-time bounds the run (schemathesis generates thousands of cases a minute here)
            [st, "run", srv.url + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", "50",
             "--seed", "7", "--request-timeout", "60", "--max-time", "25", "--workers", "1"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,  # its cache folder goes there
        )
        assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
        counts = re.search(r"(\d+) generated, (\d+) passed", res.stdout)
        assert counts and int(counts[1]) > 100 and counts[1] == counts[2], res.stdout[-3000:]
    finally:
        srv.stop()


def test_a_dead_step_loop_fails_health_and_requests_instead_of_hanging(tmp_path):
    """In-process (starlette's TestClient runs the app and its lifespan): make the step loop die, then every
    request must get 503 at once and /health must fail, so the liveness probe restarts the pod."""
    from starlette.testclient import TestClient

    from chunkpilot.engine import EngineConfig
    from chunkpilot.engine.serving.server import ServerSettings, build_app

    model = make_checkpoint(tmp_path / "tiny", "llama")
    app = build_app(ServerSettings(EngineConfig(model=str(model), max_model_len=128), served_model_name="tiny"))
    with TestClient(app) as client:
        assert wait_for(lambda: client.get("/ready").status_code == 200)
        state = app.state.server

        def broken_step():
            raise RuntimeError("simulated device failure")

        state.engine.engine.step = broken_step
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert client.post("/v1/completions", json=body).status_code == 503  # refused up front now
        assert client.get("/health").status_code == 503
        assert client.get("/ready").status_code == 503


def test_a_client_that_leaves_while_queued_is_aborted(keyed):
    auth = {"Authorization": "Bearer s3cret"}
    running = stream_in_thread(keyed.url, LONG, auth)
    assert wait_for(lambda: len(running[1]) >= 1)
    with pytest.raises(httpx.ReadTimeout):  # queued behind the running stream; the client gives up
        httpx.post(keyed.url + "/v1/completions", json={**LONG, "stream": False}, headers=auth, timeout=1.0)
    # without the abort it would wait (and hold its queue slot) until the 300-token stream ends
    assert wait_for(lambda: keyed.metrics()["chunkpilot:num_requests_waiting"] == 0, timeout=5)
    assert running[0].is_alive(), "the running stream should still be going"
    running[2]["stop"] = True
    running[0].join(30)
