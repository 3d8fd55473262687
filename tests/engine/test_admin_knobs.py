"""The knobs admin endpoint (engine/admin.py) on a real `chunkpilot engine serve` process: where the operator pushes
knobs to a ready pod. A token is required, a bad push keeps the last good knobs, and once pushed the file (the
ConfigMap volume, which the kubelet may rewrite late with an older copy) no longer moves them."""

from __future__ import annotations

import httpx
import pytest

from chunkpilot.contract.knobs import SchedulerKnobs, write_knobs
from chunkpilot.tuner.child_process import free_port

from .server_proc import EngineServer, wait_for

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
    assert httpx.get(admin_server.admin_url.replace("/admin/knobs", "/v1/models"), timeout=10).status_code == 404


def test_a_bad_push_gets_a_4xx_naming_the_field_and_keeps_the_last_good_knobs(admin_server):
    before = current(admin_server)
    for body, field in [({"token_budget": 16, "max_chunk": 64, "generation": 60}, "max_chunk"),
                        ({"token_budget": 2, "max_chunk": 1, "generation": 60}, "max_num_seqs"),
                        ({"token_budget": "64", "max_chunk": 16, "generation": 60}, "token_budget"),
                        ({"token_budget": 64, "max_chunk": 16, "generation": 60, "extra": 1}, "extra"),
                        ({"token_budget": 64, "max_chunk": 16}, "generation")]:
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
