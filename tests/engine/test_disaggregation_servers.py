"""Disaggregation as pods run it, on this machine: `chunkpilot engine serve --role prefill` and `--role decode` as
real processes, the blocks moved by NIXL over UCX, clients on the official `openai` client. The output equals the
offline engine's (colocated) token for token; the two swap roles while they serve (--live-roles, as the operator
starts mode auto's pods) and lose no request; a prefill process killed with SIGKILL while requests are in flight
loses none of them; the decode pod's pool returns to empty."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from chunkpilot.engine import LLM, SamplingParams
from chunkpilot.engine import metrics as names

from chunkpilot.lab.child_process import free_port

from .server_proc import EngineServer, wait_for

MAX_LEN = 512
ARGS = ("--max-model-len", str(MAX_LEN), "--max-num-seqs", "8", "--token-budget", "128", "--max-chunk", "64",
        "--kv-cache-memory-gb", "0.1", "--dtype", "float32")
# distinct long prompts (each well past the threshold) and their offline greedy outputs
TOPICS = ["schedulers", "key-value caches", "prefix caching", "token budgets", "chunked prefill", "leases"]
# the role swap's own prompts (the decode pod's prefix cache holds those the tests before it pulled)
SWAP_TOPICS = ["block tables", "step loops", "role switches", "acknowledgements"]


def long_prompt(topic: str) -> str:
    return (f"A field guide to {topic}. " + "Every engine step first gives each running sequence one token, then "
            "spends what is left of the budget on prompt chunks. " * 6 + f"In short, {topic} are")


TOKEN = "admin-token"


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    """Two live-roles engines, each the other's prefill peer, as mode auto's pods are (each resolves the prefill
    Service, which names whichever pods are prefill now): one starts as prefill, one as decode."""
    logs = tmp_path_factory.mktemp("disagg")
    token = logs / "token"
    token.write_text(TOKEN)
    ports = {role: free_port() for role in ("prefill", "decode")}
    admins = {role: free_port() for role in ports}
    started = []
    try:
        for role, other in (("prefill", "decode"), ("decode", "prefill")):
            srv = EngineServer(smollm2_dir, logs, "--role", role, "--live-roles", "--prefill-peers",
                               f"127.0.0.1:{ports[other]}", "--kv-lease-seconds", "5", "--disagg-threshold", "32",
                               "--admin-port", str(admins[role]), "--admin-token-file", str(token), *ARGS,
                               port=ports[role])
            srv.admin_url = f"http://127.0.0.1:{admins[role]}/admin/knobs"
            started.append(srv)
        for srv in started:
            srv.wait_ready()
        yield tuple(started)
    finally:
        for srv in reversed(started):
            srv.stop(timeout=20)


@pytest.fixture(scope="module")
def offline(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8, token_budget=128, max_chunk=64)
    return {t: llm.generate(long_prompt(t), SamplingParams(max_tokens=8, temperature=0.0))[0].text
            for t in TOPICS + SWAP_TOPICS}


def complete(url: str, topic: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    text = ""
    for chunk in client.completions.create(model="smollm2", prompt=long_prompt(topic), max_tokens=8, temperature=0.0,
                                           stream=True):
        text += chunk.choices[0].text
    return text


def test_streams_through_a_decode_pod_equal_colocated_and_move_blocks_by_nixl(servers, offline):
    prefill, decode = servers
    assert wait_for(lambda: _peer_known(decode), timeout=30), decode.log()
    for topic in TOPICS[:2]:
        assert complete(decode.url, topic) == offline[topic]
    m = decode.metrics()
    assert m[names.KV_TRANSFERS + "[('outcome', 'ok')]"] == 2, decode.log()
    assert m[names.KV_TRANSFER_BYTES] > 0
    assert prefill.metrics()[names.REMOTE_PREFILLS_SERVED] == 2
    # the leases were released on acknowledgement, not left to expire
    assert wait_for(lambda: prefill.metrics()[names.KV_LEASES_HELD] == 0, timeout=5)
    assert wait_for(lambda: decode.metrics()[names.KV_CACHE_USAGE] == 0, timeout=5)


def test_idle_engines_spin_no_core(servers):
    """NIXL's progress thread loops without pause unless paced: a decode pod pinned to one core lost two thirds of
    it (nixl_transport.py). Idle, each engine uses a small share of a core (a spinning thread: a whole one, or at
    least half of one with the suite's two workers sharing two cores)."""
    def cpu_seconds(pid: int) -> float:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    for srv in servers:
        before, t0 = cpu_seconds(srv.proc.pid), time.monotonic()
        time.sleep(2.0)  # measuring a rate over an interval, not waiting for a state
        share = (cpu_seconds(srv.proc.pid) - before) / (time.monotonic() - t0)
        assert share < 0.3, (srv.log(), share)


def switch_role(srv: EngineServer, role: str) -> None:
    """The operator's push: the knobs the pod runs, with its new role; the answer is the acknowledgement."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    knobs = httpx.get(srv.admin_url, headers=auth, timeout=10).json()
    r = httpx.put(srv.admin_url, json={**knobs, "role": role, "generation": knobs["generation"] + 1}, headers=auth,
                  timeout=10)
    assert r.status_code == 200 and r.json()["role"] == role, r.text


def test_the_pods_swap_roles_while_serving_and_lose_no_request(servers, offline):
    """Prefill becomes decode and decode prefill, no restart, while streams run on the decode pod: every stream
    ends equal to offline; then the old prefill pod serves clients through the old decode pod's prefill. Swapped
    back at the end (the kill test below takes the first server as the prefill pod)."""
    prefill, decode = servers
    assert wait_for(lambda: _peer_known(decode), timeout=30), decode.log()
    pids = {srv.proc.pid for srv in servers}
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def run(url: str, topic: str) -> None:
        try:
            results[topic] = complete(url, topic)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    base = _served(prefill)
    threads = [threading.Thread(target=run, args=(decode.url, t)) for t in SWAP_TOPICS[:3]]
    for t in threads:
        t.start()
    wait_for(lambda: _served(prefill) > base, timeout=30)  # some went to the prefill pod, some are on their way
    switch_role(decode, "prefill")  # the client Service drops it first in a cluster; here its streams keep running
    switch_role(prefill, "decode")
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert results == {t: offline[t] for t in SWAP_TOPICS[:3]}
    # the roles as the engines report them, and the old decode pod now computing prompts for the old prefill pod
    assert decode.metrics()[names.DISAGG_ROLE + "[('role', 'prefill')]"] == 1
    assert prefill.metrics()[names.DISAGG_ROLE + "[('role', 'decode')]"] == 1
    served = _served(decode)
    assert wait_for(lambda: _peer_known(prefill), timeout=30), prefill.log()
    assert complete(prefill.url, SWAP_TOPICS[3]) == offline[SWAP_TOPICS[3]]
    assert _served(decode) == served + 1, decode.log()
    assert {srv.proc.pid for srv in servers} == pids  # no restart
    switch_role(prefill, "prefill")
    switch_role(decode, "decode")
    for srv in servers:  # every lease settled, every block of the switched streams given back
        assert wait_for(lambda: srv.metrics()[names.KV_LEASES_HELD] == 0, timeout=10), srv.log()
    assert wait_for(lambda: _peer_known(decode), timeout=30)


def test_a_prefill_process_killed_under_load_loses_no_request(servers, offline):
    prefill, decode = servers
    assert wait_for(lambda: _peer_known(decode), timeout=30)
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def run(topic: str) -> None:
        try:
            results[topic] = complete(decode.url, topic)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    base = _served(prefill)
    threads = [threading.Thread(target=run, args=(t,)) for t in TOPICS]
    for t in threads:
        t.start()
        time.sleep(0.05)
    # once the prefill pod has served some of them, and the rest are queued on it or on their way
    wait_for(lambda: _served(prefill) > base, timeout=30)
    prefill.proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert results == {t: offline[t] for t in TOPICS}
    m = decode.metrics()
    assert sum(v for k, v in m.items() if k.startswith(names.KV_FALLBACKS)) >= 1, decode.log()
    assert wait_for(lambda: decode.metrics()[names.KV_CACHE_USAGE] == 0, timeout=10)


def _peer_known(decode: EngineServer) -> bool:
    """The decode pod's last poll found the prefill pod, so long prompts go there."""
    return decode.metrics().get(names.PREFILL_PEERS_READY, 0) >= 1


def _served(prefill: EngineServer) -> float:
    try:
        return prefill.metrics().get(names.REMOTE_PREFILLS_SERVED, 0)
    except Exception:  # noqa: BLE001 - killed meanwhile
        return 1
