"""Disaggregation as pods run it, on this machine: `chunkpilot engine serve --role prefill` and `--role decode` as
real processes, the blocks moved by NIXL over UCX, clients on the official `openai` client. The output equals the
offline engine's (colocated) token for token; a prefill process killed with SIGKILL while requests are in flight
loses none of them; the decode pod's pool returns to empty."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from chunkpilot.engine import LLM, SamplingParams
from chunkpilot.engine import metrics as names

from .server_proc import EngineServer, wait_for

MAX_LEN = 512
ARGS = ("--max-model-len", str(MAX_LEN), "--max-num-seqs", "8", "--token-budget", "128", "--max-chunk", "64",
        "--kv-cache-memory-gb", "0.1", "--dtype", "float32")
# distinct long prompts (each well past the threshold) and their offline greedy outputs
TOPICS = ["schedulers", "key-value caches", "prefix caching", "token budgets", "chunked prefill", "leases"]


def long_prompt(topic: str) -> str:
    return (f"A field guide to {topic}. " + "Every engine step first gives each running sequence one token, then "
            "spends what is left of the budget on prompt chunks. " * 6 + f"In short, {topic} are")


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("disagg")
    prefill = EngineServer(smollm2_dir, logs, "--role", "prefill", "--kv-lease-seconds", "5", *ARGS)
    decode = None
    try:
        prefill.wait_ready()
        decode = EngineServer(smollm2_dir, logs, "--role", "decode", "--prefill-peers", f"127.0.0.1:{prefill.port}",
                              "--disagg-threshold", "32", *ARGS).wait_ready()
        yield prefill, decode
    finally:
        for srv in (decode, prefill):
            if srv is not None:
                srv.stop(timeout=20)


@pytest.fixture(scope="module")
def offline(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8, token_budget=128, max_chunk=64)
    return {t: llm.generate(long_prompt(t), SamplingParams(max_tokens=8, temperature=0.0))[0].text for t in TOPICS}


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

    threads = [threading.Thread(target=run, args=(t,)) for t in TOPICS]
    for t in threads:
        t.start()
        time.sleep(0.05)
    # once the prefill pod has served some of them, and the rest are queued on it or on their way
    wait_for(lambda: _served(prefill) >= 1, timeout=30)
    prefill.proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert results == offline
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
