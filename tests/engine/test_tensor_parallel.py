"""Tensor parallelism on the CPU with gloo: the ranks' shards compute what one rank computes (logits within 1e-4
on tiny Llama, Llama-3-rope and Qwen2 checkpoints, with KV heads split and replicated and a vocabulary that does
not divide), each rank holds its share of the memory, abort works, and a rank that dies or hangs makes the
server exit non-zero instead of hanging. SmolLM2 at TP=3 against transformers is in test_parity_smollm2.py."""

from __future__ import annotations

import ipaddress
import os
import signal
import stat
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from chunkpilot.engine import LLM, SamplingParams
from chunkpilot.engine.model.model_config import ModelConfig
from chunkpilot.engine.model.tp_shard import check_tensor_parallel, shard_of

from .server_proc import EngineServer, wait_for
from .tiny_models import TEXTS, make_checkpoint

PROMPTS = [TEXTS[0][:9], " ".join(TEXTS), TEXTS[2]]
TOL = 1e-4


def _cfg(heads: int, kv: int, inter: int = 96, vocab: int = 300) -> ModelConfig:
    return ModelConfig.from_dict({"hidden_size": 64, "intermediate_size": inter, "num_attention_heads": heads,
                                  "num_key_value_heads": kv, "num_hidden_layers": 2, "vocab_size": vocab})


def test_shards_split_heads_and_replicate_kv_heads_when_there_are_fewer_than_ranks():
    smol = [shard_of(_cfg(9, 3, 1536, 49152), r, 3) for r in range(3)]
    assert [(s.heads, s.head_start, s.kv_heads, s.kv_head_start, s.intermediate) for s in smol] == [
        (3, 0, 1, 0, 512), (3, 3, 1, 1, 512), (3, 6, 1, 2, 512)]
    # 8 query heads over 4 ranks with 2 KV heads: ranks 0-1 use KV head 0 (query heads 0-3), ranks 2-3 KV head 1
    rep = [shard_of(_cfg(8, 2, 128), r, 4) for r in range(4)]
    assert [(s.head_start, s.kv_heads, s.kv_head_start) for s in rep] == [(0, 1, 0), (2, 1, 0), (4, 1, 1), (6, 1, 1)]
    for s in rep:  # every query head of a rank belongs to the group of its one KV head
        assert {h // (8 // 2) for h in range(s.head_start, s.head_start + s.heads)} == {s.kv_head_start}
    # a vocabulary that does not divide: equal padded slices, the last one shorter in real rows
    v = [shard_of(_cfg(4, 2, vocab=301), r, 2) for r in range(2)]
    assert [(s.vocab_start, s.vocab_rows, s.vocab_end) for s in v] == [(0, 151, 151), (151, 151, 301)]


def test_sizes_that_do_not_divide_are_refused_with_what_to_choose():
    with pytest.raises(ValueError, match=r"does not divide the model's 4 attention heads; choose one of 1, 2, 4"):
        check_tensor_parallel(_cfg(4, 2), 3)
    with pytest.raises(ValueError, match="12 KV heads|KV heads: one must divide the other"):
        check_tensor_parallel(_cfg(12, 3, 96), 2)
    with pytest.raises(ValueError, match="intermediate_size 90"):
        check_tensor_parallel(_cfg(4, 2, 90), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        check_tensor_parallel(_cfg(4, 2), 0)


def _run(folder: Path, tp: int, prompts=PROMPTS, max_tokens: int = 6, **settings):
    """Greedy outputs and every logits tensor rank 0 sampled from."""
    kw = dict(threads=1, dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=4, token_budget=16,
              max_chunk=5) | settings
    llm = LLM(str(folder), tensor_parallel_size=tp, **kw)
    seen: list[torch.Tensor] = []
    real = llm.engine.sampler.sample

    def spy(logits, ids, params, positions=None):
        seen.append(logits.clone())
        return real(logits, ids, params, positions)

    llm.engine.sampler.sample = spy
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.close()
    return [o.token_ids for o in outs], seen


CASES = {
    "llama-2kv": ("llama", {}),  # 4 heads, 2 KV heads: one KV head per rank
    "llama-1kv": ("llama", {"num_key_value_heads": 1}),  # replicated KV head
    "llama3-rope": ("llama3", {}),
    "qwen2-vocab301": ("qwen2", {"vocab_size": 301}),  # q/k/v biases, tied vocab-parallel head, padded slice
    "qwen2-1kv": ("qwen2", {"num_key_value_heads": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_logits_of_one(tmp_path, case):
    arch, sizes = CASES[case]
    folder = make_checkpoint(tmp_path / case, arch, **sizes)
    ids1, logits1 = _run(folder, 1)
    ids2, logits2 = _run(folder, 2)
    assert ids1 == ids2
    assert len(logits1) == len(logits2) > 1
    for a, b in zip(logits1, logits2):
        assert a.shape == b.shape and a.shape[-1] == sizes.get("vocab_size", 300)
        assert (a - b).abs().max().item() < TOL


def test_each_rank_holds_its_share_of_weights_and_kv_cache(tmp_path):
    folder = make_checkpoint(tmp_path / "llama", "llama")
    one = LLM(str(folder), threads=1, block_size=4, num_kv_blocks=128)
    two = LLM(str(folder), tensor_parallel_size=2, threads=1, block_size=4, num_kv_blocks=128)
    try:
        cfg = one.engine.model_config
        whole = one.engine.rank_memory[0]
        ranks = two.engine.rank_memory
        assert [m.rank for m in ranks] == [0, 1]
        # norms are replicated; everything else (embedding and head included: vocab-parallel) is split in two
        norms = 4 * cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)
        for m in ranks:
            assert m.weight_bytes == (whole.weight_bytes - norms) // 2 + norms
            # 2 x layers x (kv_heads / N) x head_dim x 4 bytes x slots
            assert m.kv_cache_bytes == 2 * cfg.num_hidden_layers * (cfg.num_key_value_heads // 2) * cfg.head_dim * 4 * 128 * 4
        assert whole.kv_cache_bytes == 2 * ranks[0].kv_cache_bytes
        assert two.engine.kv_cache.tensor.shape[3] == cfg.num_key_value_heads // 2
    finally:
        two.engine.close()


def test_abort_prefix_cache_and_preemption_under_two_ranks(tmp_path):
    """Aborting frees the request's blocks on every rank's plan; cached prefixes and a pool too small for the
    batch (preemption, then recomputation) still give the single-rank output."""
    folder = make_checkpoint(tmp_path / "llama", "llama")
    long = [" ".join(TEXTS), " ".join(TEXTS) + " again", " ".join(TEXTS[::-1])]
    ref, _ = _run(folder, 1, long, max_tokens=12, max_model_len=160)  # a pool of 128 blocks: no preemption
    llm = LLM(str(folder), tensor_parallel_size=2, threads=1, dtype="float32", block_size=4, num_kv_blocks=48,
              max_num_seqs=4, token_budget=16, max_chunk=5, max_model_len=160)
    try:
        eng = llm.engine
        eng.add_request("gone", long[0], SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(5):
            eng.step()
        eng.abort("gone")
        eng.step()
        assert not eng.has_unfinished() and eng.block_manager.num_free_blocks == 48
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        first = [o.token_ids for o in llm.generate(long, params)]
        assert eng.scheduler.num_preemptions > 0, "48 blocks of 4 cannot hold three ~120-token sequences at once"
        hits = eng.block_manager.prefix_hits
        second = [o.token_ids for o in llm.generate(long, params)]
        assert eng.block_manager.prefix_hits > hits
        assert first == second == ref
    finally:
        llm.engine.close()


def test_offline_a_killed_rank_raises_instead_of_hanging(tmp_path):
    """The offline LLM must not take its caller's process down: the next step raises RankFailedError."""
    import os

    from chunkpilot.engine.execution.tp_worker import RankFailedError

    folder = make_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(folder), tensor_parallel_size=2, threads=1, block_size=4, num_kv_blocks=128)
    try:
        (worker,) = llm.engine.worker_pids
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1|collective failed"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=50, ignore_eos=True))
        assert time.monotonic() - started < 30
    finally:
        llm.engine.close()
    assert not _tp_children(), "a failed engine's workers are reaped"
    # the failed engine left the process group: another one starts and runs in this process
    again, _ = _run(folder, 2, PROMPTS[:1], max_tokens=2)
    assert len(again[0]) == 2


def _tp_children() -> list[int]:
    """This process's tensor-parallel workers still in the process table (running or zombie)."""
    import os

    out = []
    for pid in _worker_pids(os.getpid()):
        try:
            if b"chunkpilot.engine.execution.tp_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except FileNotFoundError:
            pass
    return out


def test_a_failed_start_leaves_no_workers_behind(tmp_path):
    folder = make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="the KV cache holds 8 tokens"):  # every rank agrees, then refuses
        LLM(str(folder), tensor_parallel_size=2, threads=1, block_size=4, num_kv_blocks=2)
    assert not _tp_children()


def _exposed_listeners(pid: int) -> set[tuple[str, int]]:
    """The TCP sockets `pid` listens on at an address other than loopback: what another pod could connect to."""
    conns = psutil.Process(pid).net_connections(kind="inet")
    return {(c.laddr.ip, c.laddr.port) for c in conns
            if c.status == psutil.CONN_LISTEN and not ipaddress.ip_address(c.laddr.ip).is_loopback}


def test_rank_zero_unpickles_nothing_and_the_group_is_private_to_the_pod(tmp_path, monkeypatch):
    """The review's attack: processes that reach the pod's address join the rendezvous as ranks before the real
    workers have loaded, and their gather_object payload (a pickle) runs code in rank 0, the HTTP server's process.
    Now: no rendezvous or group socket on a non-loopback address, the store in a 0700 directory, and nothing that
    reaches rank 0 goes through pickle."""
    import torch.distributed.distributed_c10d as c10d

    from chunkpilot.engine.parallel import tp_group

    def refuse(*args, **kwargs):
        raise AssertionError("the tensor-parallel group pickled or unpickled a message")

    monkeypatch.setattr(c10d, "_tensor_to_object", refuse)
    monkeypatch.setattr(c10d, "_object_to_tensor", refuse)
    made = []
    real_mkdtemp = tp_group.tempfile.mkdtemp
    monkeypatch.setattr(tp_group.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    folder = make_checkpoint(tmp_path / "llama", "llama")
    before = _exposed_listeners(os.getpid())
    llm = LLM(str(folder), tensor_parallel_size=2, threads=1, block_size=4, num_kv_blocks=128)
    try:
        (directory,) = made
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        (worker,) = llm.engine.worker_pids
        assert _exposed_listeners(os.getpid()) - before == set()
        assert _exposed_listeners(worker) == set()
        outs = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(outs[0].token_ids) == 4
        assert [m.rank for m in llm.engine.rank_memory] == [0, 1]
    finally:
        llm.engine.close()
    assert not os.path.exists(directory)


def test_a_step_plan_crosses_as_integers_and_anything_else_is_refused():
    from chunkpilot.engine.parallel.step_plan import KEEPALIVE, PlannedChunk, StepPlan, decode_message, encode_message

    plan = StepPlan([PlannedChunk(7, [5], [0, 1], True), PlannedChunk(9, [5, 6, 7], [0], True, 2),
                     PlannedChunk(0, [1, 2, 3], [2], False)], 1)
    for message in (plan, KEEPALIVE, None):
        wire = encode_message(message)
        assert wire.dtype == torch.long
        assert decode_message(wire) == message
    for bad in ([], [9], [1, 0], [2, 0, 1, 0, 0, 5, 0], [2, 2, 1, 0, 1, 0, 0], [2, 0, 1, 0, 2, 0, 0],
                [2, 0, 0, 4], [2, -1, 0], [2, 0, 1, 0, 1, 1, 1, 0, 5]):  # last: as many drafts as tokens
        with pytest.raises(ValueError):
            decode_message(torch.tensor(bad, dtype=torch.long))


def _worker_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tp") / "llama", "llama")


def _serve(tiny, tmp_path, *args):
    return EngineServer(str(tiny), tmp_path, "--tensor-parallel-size", "2", "--threads", "1", "--max-num-seqs", "4",
                        "--token-budget", "16", "--max-chunk", "16", *args, name="tiny").wait_ready()


def test_server_under_two_ranks_serves_retunes_exports_ranks_and_stops_cleanly(tiny, tmp_path):
    from chunkpilot.contract.knobs import SchedulerKnobs
    from chunkpilot.contract.knobs import write_knobs

    knobs = tmp_path / "knobs.json"
    write_knobs(knobs, SchedulerKnobs(16, 16, 1))
    server = _serve(tiny, tmp_path, "--knobs-file", str(knobs))
    try:
        workers = _worker_pids(server.proc.pid)
        assert len(workers) == 1
        # nothing but the HTTP port (bound where --host says) for another pod to reach
        assert _exposed_listeners(server.proc.pid) == set() and _exposed_listeners(workers[0]) == set()
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": TEXTS[0], "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        m = server.metrics()
        assert m["chunkpilot:tensor_parallel_size"] == 2
        assert m["chunkpilot:rank_kv_cache_bytes[('rank', '0')]"] == m["chunkpilot:rank_kv_cache_bytes[('rank', '1')]"] > 0
        assert m["chunkpilot:rank_weight_bytes[('rank', '1')]"] > 0
        # hot knobs under TP: the scheduler is rank 0's alone, the workers follow its plans
        write_knobs(knobs, SchedulerKnobs(8, 3, 2))
        assert wait_for(lambda: server.metrics()["chunkpilot:scheduler_generation"] == 2, 10)
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": " ".join(TEXTS),
                                                             "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert server.stop(signal.SIGTERM) == 0
        assert wait_for(lambda: not Path(f"/proc/{workers[0]}").exists() or _zombie(workers[0]), 10)
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_rank_makes_the_engine_exit_non_zero(tiny, tmp_path):
    server = _serve(tiny, tmp_path)
    try:
        (worker,) = _worker_pids(server.proc.pid)
        import os

        os.kill(worker, signal.SIGKILL)
        code = server.proc.wait(timeout=20)  # the watchdog polls every 0.5 s
        assert code == 1, server.log()
        assert "rank 1" in server.log() and "exited with status -9" in server.log()
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)


def _kill_all(server, worker: int | None) -> None:
    """A stopped worker survives its engine (it watches its parent only when it runs): kill both."""
    import os

    try:
        if worker is not None:
            os.kill(worker, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if server.proc.poll() is None:
        server.stop(signal.SIGKILL)


def test_a_hung_rank_makes_the_engine_exit_non_zero_within_its_timeout(tiny, tmp_path):
    import os

    server = _serve(tiny, tmp_path, "--tensor-parallel-timeout", "3")
    (worker,) = _worker_pids(server.proc.pid)
    try:
        # idle for longer than the timeout: the workers wait for the next plan as long as it takes
        time.sleep(6)
        assert server.proc.poll() is None, server.log()
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": TEXTS[0], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200
        os.kill(worker, signal.SIGSTOP)  # alive, but never answers a collective again
        started = time.monotonic()
        try:
            httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": TEXTS[1], "max_tokens": 4},
                       timeout=60)
        except httpx.HTTPError:
            pass  # the connection drops when the engine exits
        code = server.proc.wait(timeout=60)
        assert code == 1, server.log()
        assert time.monotonic() - started < 45
        # the request's step, or a keep-alive that came first
        assert "collective failed" in server.log() or "keep-alive failed" in server.log()
        assert wait_for(lambda: _zombie(worker), 10), "the engine kills the hung rank on its way out"
    finally:
        _kill_all(server, worker)


def test_a_rank_hung_while_idle_makes_the_engine_exit_non_zero_without_a_request(tiny, tmp_path):
    # no request at all: only the idle keep-alives can find a worker that stopped answering
    import os

    server = _serve(tiny, tmp_path, "--tensor-parallel-timeout", "3")
    worker = None
    try:
        (worker,) = _worker_pids(server.proc.pid)
        os.kill(worker, signal.SIGSTOP)
        started = time.monotonic()
        code = server.proc.wait(timeout=60)
        assert code == 1, server.log()
        # a keep-alive every quarter of the timeout, each waiting up to the timeout: about 4 s
        assert time.monotonic() - started < 20
        assert "keep-alive failed" in server.log(), server.log()
        assert wait_for(lambda: _zombie(worker), 10), "the engine kills the hung rank on its way out"
    finally:
        _kill_all(server, worker)
