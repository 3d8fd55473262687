"""The knobs admin endpoint (engine/serving/admin.py) on a real `chunkpilot engine serve` process: where the
operator pushes knobs to a ready pod. A token is required, a bad push keeps the last good knobs, and once pushed the
file (the ConfigMap volume, which the kubelet may rewrite late with an older copy) no longer moves them. The token
is checked before the body is read and the body is capped, since the admin port shares the API's event loop."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from chunkpilot.contract.knobs import SchedulerKnobs, write_knobs
from chunkpilot.engine.serving.admin import KNOBS_PATH, MAX_BODY_BYTES, build_admin_app
from chunkpilot.lab.child_process import free_port

from .server_proc import EngineServer, assert_openai_error, wait_for

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def admin_server(smollm2_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("admin")
    knobs, token = d / "knobs.json", d / "token"
    write_knobs(knobs, SchedulerKnobs(256, 64, 1))
    token.write_text(TOKEN + "\n")  # a Secret's value may end in a newline
    port = free_port()
    srv = EngineServer(smollm2_dir, d, "--knobs-file", str(knobs), "--knobs-poll-interval", "0.05",
                       "--admin-port", str(port), "--admin-token-file", str(token),
                       "--max-num-seqs", "8", "--max-model-len", "256").wait_ready()
    srv.admin_url, srv.knobs_path, srv.token_path = f"http://127.0.0.1:{port}/admin/knobs", knobs, token
    yield srv
    srv.stop()


def put(srv, body, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.put(srv.admin_url, json=body, headers=headers, timeout=10)


def current(srv) -> dict:
    return httpx.get(srv.url + "/ready", timeout=10).json()["knobs"]


def test_the_admin_endpoint_refuses_a_missing_or_wrong_token_and_changes_nothing(admin_server):
    before = current(admin_server)
    for token in (None, "wrong", "s3cret"):
        r = put(admin_server, {"token_budget": 128, "max_chunk": 32, "generation": 50}, token)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(admin_server.admin_url, timeout=10).status_code == 401
    assert current(admin_server) == before
    # the admin routes live on their own port only (a NetworkPolicy admits the operator alone to it)
    assert httpx.put(admin_server.url + "/admin/knobs", json={}, timeout=10).status_code == 404
    assert httpx.get(admin_server.admin_url.replace("/admin/knobs", "/v1/models"), timeout=10,
                     headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404


def test_a_bad_push_gets_a_4xx_naming_the_field_and_keeps_the_last_good_knobs(admin_server):
    before = current(admin_server)
    for body, field in [({"token_budget": 16, "max_chunk": 64, "generation": 60}, "max_chunk"),
                        ({"token_budget": 2, "max_chunk": 1, "generation": 60}, "max_num_seqs"),
                        ({"token_budget": "64", "max_chunk": 16, "generation": 60}, "token_budget"),
                        ({"token_budget": 64, "max_chunk": 16, "generation": 60, "extra": 1}, "extra"),
                        ({"token_budget": 64, "max_chunk": 16}, "generation"),
                        ({"token_budget": 64, "max_chunk": 16, "generation": 60, "role": "both"}, "role"),
                        # a role on an engine started without --live-roles: the message says what to change
                        ({"token_budget": 64, "max_chunk": 16, "generation": 60, "role": "prefill"}, "--live-roles")]:
        r = put(admin_server, body)
        assert r.status_code == 400, (body, r.text)
        assert field in r.json()["error"]["message"], (body, r.json())
    assert current(admin_server) == before


def test_a_push_applies_at_once_and_answers_what_the_engine_runs(admin_server):
    r = put(admin_server, {"token_budget": 96, "max_chunk": 32, "generation": 7})
    assert r.status_code == 200, r.text
    assert r.json() == {"token_budget": 96, "max_chunk": 32, "generation": 7}
    assert current(admin_server) == {"token_budget": 96, "max_chunk": 32, "generation": 7}
    m = admin_server.metrics()
    assert m["chunkpilot:scheduler_token_budget"] == 96 and m["chunkpilot:scheduler_generation"] == 7
    got = httpx.get(admin_server.admin_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert got.json() == r.json()
    # generations need not grow: the owner of the knobs may change (spec, tuner), the push says what to run
    assert put(admin_server, {"token_budget": 80, "max_chunk": 16, "generation": 3}).json()["generation"] == 3


def test_after_a_push_a_late_knobs_file_does_not_undo_it(admin_server):
    put(admin_server, {"token_budget": 112, "max_chunk": 48, "generation": 9}).raise_for_status()
    write_knobs(admin_server.knobs_path, SchedulerKnobs(64, 64, 8))  # the kubelet writing an older ConfigMap copy
    assert not wait_for(lambda: current(admin_server)["token_budget"] != 112, timeout=1.0)


def test_a_rotated_token_file_is_used_on_the_next_request(admin_server):
    admin_server.token_path.write_text("rotated")
    try:
        assert put(admin_server, {"token_budget": 64, "max_chunk": 16, "generation": 10}).status_code == 401
        assert put(admin_server, {"token_budget": 64, "max_chunk": 16, "generation": 10},
                   "rotated").status_code == 200
    finally:
        admin_server.token_path.write_text(TOKEN)


# ---- bodies: the token before the body, and a cap on the body ------------------------------------------------
DECLARED = 500_000_000
# How much of a refused body the client may get out before the server hangs up: what the loopback socket buffers
# of both ends hold (a few MiB), with room to spare; far below DECLARED.
SENT_BEFORE_THE_ANSWER = 32 * 2**20
KNOBS_JSON = b'{"token_budget": 72, "max_chunk": 24, "generation": 70}'


class Stream(threading.Thread):
    """A streamed chat completion on the serving port, read line by line into `lines`."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.lines, self.status = url, max_tokens, [], None

    def run(self) -> None:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as res:
            self.status = res.status_code
            for line in res.iter_lines():
                if line.startswith("data: "):
                    self.lines.append(line)

    def finish_reason(self) -> str | None:
        chunks = [json.loads(line[6:]) for line in self.lines if line != "data: [DONE]"]
        return next((c["choices"][0]["finish_reason"] for c in reversed(chunks)
                     if c["choices"] and c["choices"][0]["finish_reason"]), None)


def test_an_unauthenticated_huge_body_is_refused_before_it_is_read_while_streams_go_on(admin_server):
    before = current(admin_server)
    stream = Stream(admin_server.url, max_tokens=48)
    stream.start()
    assert wait_for(lambda: len(stream.lines) >= 3, timeout=60), "the stream did not start"
    sent = 0

    def body():
        nonlocal sent
        chunk = b" " * 2**20
        while sent < SENT_BEFORE_THE_ANSWER:
            sent += len(chunk)
            yield chunk

    for token in (None, "wrong"):
        sent = 0
        headers = {"Content-Length": str(DECLARED), "Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            r = httpx.put(admin_server.admin_url, content=body(), headers=headers, timeout=60)
        except httpx.TransportError as e:  # the body ran out (shorter than declared): the server was still reading
            pytest.fail(f"no answer after {sent} of {DECLARED} unauthenticated body bytes: {e!r}")
        assert_openai_error(r, 401, "bearer token")
        assert r.headers["www-authenticate"] == "Bearer" and r.headers["connection"] == "close"
        assert sent < SENT_BEFORE_THE_ANSWER, f"the server read {sent} bytes of an unauthenticated body"
    streamed_at_the_answers = len(stream.lines)
    stream.join(300)
    assert not stream.is_alive(), f"the stream stalled after {len(stream.lines)} chunks"
    assert stream.status == 200 and stream.lines[-1] == "data: [DONE]" and stream.finish_reason() == "length"
    assert streamed_at_the_answers < len(stream.lines), "the refusals should come while the stream still runs"
    assert current(admin_server) == before


def test_an_authenticated_body_over_the_cap_gets_413_and_changes_nothing(admin_server):
    before = current(admin_server)
    # valid knobs, padded past the cap with JSON whitespace: refused for its size alone
    padded = KNOBS_JSON + b" " * MAX_BODY_BYTES
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    r = httpx.put(admin_server.admin_url, content=padded, headers=headers, timeout=10)
    assert_openai_error(r, 413, f"larger than {MAX_BODY_BYTES} bytes", "admin endpoint", "token_budget")
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == 413
    assert current(admin_server) == before


def test_a_chunked_authenticated_body_over_the_cap_gets_413_and_changes_nothing(admin_server):
    before = current(admin_server)

    def chunks():  # no Content-Length: the cap counts the bytes that arrive
        yield KNOBS_JSON
        for _ in range(8):
            yield b" " * 1024

    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    r = httpx.put(admin_server.admin_url, content=chunks(), headers=headers, timeout=10)
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert_openai_error(r, 413, f"larger than {MAX_BODY_BYTES} bytes", "admin endpoint")
    assert current(admin_server) == before


# ---- the token middleware alone, on the ASGI interface -------------------------------------------------------
def call(app, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[bytes, bytes]]:
    """Send one PUT to the ASGI app with a body it must never ask for; the answer's status and headers."""
    sent = []

    async def receive():
        raise AssertionError("the body was read before the token was checked")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "PUT", "scheme": "http",
             "path": KNOBS_PATH, "raw_path": KNOBS_PATH.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-length", str(DECLARED).encode()), *headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"])


def test_the_token_middleware_answers_without_reading_the_body(tmp_path):
    token = tmp_path / "token"
    app = build_admin_app(token, holder=lambda: None, on_push=lambda _k: None)
    status, headers = call(app, [])
    assert status == 503 and headers[b"connection"] == b"close"  # no token file: fail closed
    token.write_text(TOKEN)
    for given in ([], [(b"authorization", b"Bearer wrong")], [(b"authorization", TOKEN.encode())],
                  [(b"authorization", b"Basic " + TOKEN.encode())]):
        status, headers = call(app, given)
        assert (status, headers[b"www-authenticate"], headers[b"connection"]) == (401, b"Bearer", b"close"), given
    # the right token passes on to the body limit, which refuses the declared size unread
    assert call(app, [(b"authorization", f"bearer  {TOKEN} ".encode())])[0] == 413
