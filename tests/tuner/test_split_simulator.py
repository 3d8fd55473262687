"""The simulator's prefill/decode split (sim/split.py) and its transfer cost (sim/transfer.py), seeded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from chunkpilot.loadgen.workloads import RequestSpec
from chunkpilot.sim.calibrate import lone_figures, rescaled
from chunkpilot.sim.costmodel import CostModel, default
from chunkpilot.sim.simulator import Simulator
from chunkpilot.sim.split import SplitFleet, colocated
from chunkpilot.sim.transfer import MIB, TransferCost, from_bench
from chunkpilot.sim.transfer import default as default_transfer
from chunkpilot.tuner.space import Knobs

COST = CostModel(overhead=0.01, prefill_tokens=0.001, decode_seqs=0.002, kv_reads=0.0)
FREE = TransferCost(overhead_s=0.0, read_s_per_mib=0.0, checksum_s_per_mib=0.0, bytes_per_token=46080.0)
DECODE, PREFILL = Knobs(80, 64), Knobs(1040, 1024)


def trace(n: int = 40, seed: int = 0) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.exponential(1.0)
        p = int(rng.integers(16, 1024))
        out.append(RequestSpec("x", [7] * p, int(rng.integers(4, 40)), t, p))
    return out


def test_infinite_threshold_is_the_colocated_simulation_exactly():
    reqs = trace()
    for decodes in (1, 2):
        fleet = SplitFleet(default(), reqs, Knobs(272, 256), PREFILL, prefill=1, decode=decodes, threshold=math.inf)
        split = fleet.run()
        alone = colocated(default(), reqs, Knobs(272, 256), engines=decodes)
        assert fleet.routed == {"local": len(reqs)}
        assert [(r.start, r.token_times, r.end) for r in split] == [(r.start, r.token_times, r.end) for r in alone]
    # and one decode engine is the plain Simulator on the whole trace, float for float
    one = SplitFleet(default(), reqs, Knobs(272, 256), PREFILL, threshold=math.inf).run()
    assert [r.token_times for r in one] == [r.token_times for r in Simulator(default(), reqs, Knobs(272, 256)).run()]


def test_threshold_zero_sends_every_prompt_to_the_prefill_engine():
    reqs = trace()
    fleet = SplitFleet(default(), reqs, DECODE, PREFILL, threshold=0, prefill_max_waiting=1000)
    records = fleet.run()
    assert fleet.routed == {"remote": len(reqs)} and not fleet.fallbacks
    assert all(r.ok and r.output_tokens == s.max_tokens for r, s in zip(records, reqs))
    # the decode engine computed no prompt token: every prefill ran on the prefill engine
    assert not fleet.decodes[0].prefill_busy
    assert sum(n for _, _, n in fleet.prefills[0].prefill_busy) == sum(s.prompt_tokens for s in reqs)
    # a prompt at the threshold stays local, one token above it goes
    at = SplitFleet(COST, [RequestSpec("x", [7] * 64, 3, 0.0, 64), RequestSpec("x", [7] * 65, 3, 0.0, 65)],
                    DECODE, PREFILL, threshold=64)
    at.run()
    assert at.routed == {"local": 1, "remote": 1}


def test_the_pull_delays_the_second_token_by_its_modelled_seconds():
    # A lone 100-token prompt: the prefill engine computes it in one step (0.01 + 100 x 0.001 s) and the first
    # token leaves then; the pull's seconds come between it and the first decode step (0.01 + 0.002 s).
    lone = [RequestSpec("x", [7] * 100, 5, 0.0, 100)]
    slow = TransferCost(overhead_s=0.05, read_s_per_mib=0.02, checksum_s_per_mib=0.01, bytes_per_token=46080.0)
    pull = 0.05 + 7 * 16 * 46080 / MIB * 0.03  # 100 tokens fill 7 blocks of 16: whole blocks move
    assert slow.seconds(100) == pytest.approx(pull)
    got = {}
    for name, cost in (("free", FREE), ("slow", slow)):
        r = SplitFleet(COST, lone, DECODE, PREFILL, threshold=0, transfer=cost, pull_share=1.0).run()[0]
        got[name] = r
        assert r.ttft == pytest.approx(0.11)  # the first token is the prefill engine's
    assert got["slow"].itls[0] - got["free"].itls[0] == pytest.approx(pull)
    assert got["free"].itls[0] == pytest.approx(0.012)
    assert got["slow"].itls[1:] == pytest.approx(got["free"].itls[1:])


def test_with_kv_the_first_token_waits_for_the_pull_and_the_first_gap_is_a_decode_step():
    # The lone request above under --first-token with-kv: the engine holds the first token until the pull ends,
    # so TTFT grows by the pull's seconds and the gap to the second token is one decode step (0.01 + 0.002 s);
    # early is as before: TTFT the prefill's, the pull in the first gap. The last token comes at the same time.
    lone = [RequestSpec("x", [7] * 100, 5, 0.0, 100)]
    slow = TransferCost(overhead_s=0.05, read_s_per_mib=0.02, checksum_s_per_mib=0.01, bytes_per_token=46080.0)
    pull = slow.seconds(100)
    early, with_kv = (SplitFleet(COST, lone, DECODE, PREFILL, threshold=0, transfer=slow, first_token=mode,
                                 pull_share=1.0).run()[0] for mode in ("early", "with-kv"))
    assert early.ttft == pytest.approx(0.11) and early.itls[0] == pytest.approx(pull + 0.012)
    assert with_kv.ttft == pytest.approx(0.11 + pull)
    assert with_kv.itls[0] == pytest.approx(0.012)
    assert with_kv.itls[1:] == pytest.approx(early.itls[1:])
    assert with_kv.end == pytest.approx(early.end) and with_kv.output_tokens == early.output_tokens == 5
    # a request that ends with its first token gets it at once (no pull follows)
    one = SplitFleet(COST, [RequestSpec("x", [7] * 100, 1, 0.0, 100)], DECODE, PREFILL, threshold=0, transfer=slow,
                     first_token="with-kv").run()[0]
    assert one.ttft == pytest.approx(0.11) and one.output_tokens == 1
    with pytest.raises(ValueError, match="first_token"):
        SplitFleet(COST, lone, DECODE, PREFILL, first_token="late")


def test_with_kv_a_fallback_sends_the_first_token_before_the_local_prefill():
    # No running slot when the first token comes (a local request holds the only one): the prompt is prefilled on
    # the decode engine, and the held first token goes out when that is decided, before the local prefill's tokens
    busy = [RequestSpec("x", [7] * 16, 100, 0.0, 16), RequestSpec("x", [7] * 300, 4, 0.01, 300)]
    got = {}
    for mode in ("early", "with-kv"):
        fleet = SplitFleet(COST, busy, DECODE, PREFILL, threshold=100, first_token=mode,
                           sim_options={"max_num_seqs": 1})
        got[mode] = fleet.run()[1]
        assert fleet.fallbacks == {"no_room": 1} and got[mode].ok and got[mode].output_tokens == 4
    prefilled = got["early"].first_token  # the prefill engine's step end
    assert got["with-kv"].first_token > prefilled  # at the decode engine's next step boundary
    assert got["with-kv"].first_token < got["with-kv"].token_times[1]
    assert got["with-kv"].token_times[1:] == pytest.approx(got["early"].token_times[1:])


def test_a_pull_on_a_shared_core_slows_the_decodes_it_overlaps():
    # One request decodes alone; a second is prefilled remotely meanwhile. With the pull's CPU time taken from the
    # step loop (one core), the decode step in flight grows by the pull's seconds; with a core to spare it does not.
    reqs = [RequestSpec("x", [7] * 16, 60, 0.0, 16), RequestSpec("x", [7] * 512, 3, 0.05, 512)]
    gaps = {}
    for share in (0.0, 1.0):
        cost = TransferCost(0.3, 0.0, 0.0, 46080.0, step_loop_share=share)
        records = SplitFleet(COST, reqs, DECODE, PREFILL, threshold=100, transfer=cost, pull_share=1.0).run()
        gaps[share] = max(records[0].itls)
    assert gaps[0.0] == pytest.approx(0.012)
    assert gaps[1.0] == pytest.approx(0.012 + 0.3)


def test_a_paced_pull_lasts_longer_and_stretches_each_step_beside_it_by_its_share_at_most():
    # The same two requests, the pull's 0.3 s of work paced at a quarter of the wall time (the engine's default
    # --pull-share on the CPU): it lasts 1.2 s, and each decode step beside it (0.012 s alone) grows by a third at
    # most, not by the whole pull; the work is all lost to the steps in the end, none more.
    reqs = [RequestSpec("x", [7] * 16, 200, 0.0, 16), RequestSpec("x", [7] * 512, 3, 0.05, 512)]
    cost = TransferCost(0.3, 0.0, 0.0, 46080.0, step_loop_share=1.0)
    fleet = SplitFleet(COST, reqs, DECODE, PREFILL, threshold=100, transfer=cost, pull_share=0.25)
    records = fleet.run()
    assert fleet.decodes[0].transfers == [(512, pytest.approx(1.2))]
    assert max(records[0].itls) == pytest.approx(0.012 * 4 / 3)
    assert sum(records[0].itls) - 0.012 * len(records[0].itls) == pytest.approx(0.3, rel=0.05)
    with pytest.raises(ValueError, match="pull_share"):
        SplitFleet(COST, reqs, DECODE, PREFILL, pull_share=0.0)


def test_a_saturated_prefill_engine_sends_requests_back_to_local_prefill():
    # Ten long prompts at once to one prefill engine that is saturated above one waiting request: the first two
    # go to it, the rest are prefilled on the decode engine, and every one is answered in full.
    burst = [RequestSpec("x", [7] * 300, 4, 0.0, 300) for _ in range(10)]
    fleet = SplitFleet(COST, burst, DECODE, PREFILL, threshold=100, prefill_max_waiting=1)
    records = fleet.run()
    assert fleet.routed == {"remote": 2, "saturated": 8}
    assert all(r.ok and r.output_tokens == 4 for r in records)
    assert sum(n for _, _, n in fleet.decodes[0].prefill_busy) == 8 * 300
    # no running slot on the decode engine when the first token comes (a local request holds its only one): the
    # prompt is prefilled there after all, its first token included, and the answer is whole
    busy = [RequestSpec("x", [7] * 16, 100, 0.0, 16), RequestSpec("x", [7] * 300, 4, 0.01, 300)]
    full = SplitFleet(COST, busy, DECODE, PREFILL, threshold=100, sim_options={"max_num_seqs": 1})
    done = full.run()
    assert full.routed == {"local": 1, "remote": 1} and full.fallbacks == {"no_room": 1}
    assert [r.output_tokens for r in done] == [100, 4] and all(r.ok for r in done)
    assert sum(n for _, _, n in full.decodes[0].prefill_busy) == 16 + 300 + 1  # the prompt and its first token


def test_transfer_cost_from_the_benchs_json(tmp_path):
    rows = [{"tokens": t, "bytes": t * 1000, "nixl_s": 0.002 + t * 1000 / MIB * 0.5,
             "checksum_s": t * 1000 / MIB * 0.25} for t in (256, 1024, 4096)]
    cost = from_bench({"conditions": {"device": "cpu", "dtype": "float32"}, "rows": rows}, step_loop_share=0.5)
    assert cost.bytes_per_token == 1000.0 and cost.step_loop_share == 0.5
    assert cost.read_s_per_mib == pytest.approx(0.5) and cost.checksum_s_per_mib == pytest.approx(0.25)
    assert cost.overhead_s == pytest.approx(0.002)
    assert "cpu float32" in cost.note
    assert TransferCost.load(cost.save(tmp_path / "t.json")) == cost
    with pytest.raises(ValueError, match="no rows"):
        from_bench({"rows": []})
    with pytest.raises(ValueError, match="step_loop_share"):
        TransferCost(0.0, 0.0, 0.0, 1.0, step_loop_share=2.0)
    # the shipped default is the committed bench's fit: SmolLM2's 46080 bytes a token, about 35 ms per 1024 tokens
    measured = json.loads((Path(__file__).parents[2] / "bench/results/kv_transfer.json").read_text())
    row = next(r for r in measured["rows"] if r["tokens"] == 1024)
    assert default_transfer().bytes_per_token == row["bytes"] / 1024
    assert default_transfer().seconds(1024) == pytest.approx(row["nixl_s"] + row["checksum_s"], rel=0.05)


def test_the_cost_rescaled_to_a_lone_engine_gives_its_figures():
    # bench/disaggregation.py's one-core engines: a lone 1024-token prompt's TTFT and a lone decode's gap
    one_core = rescaled(default(), 3.3, 0.076)
    ttft, itl = lone_figures(one_core, 1024, 32, Knobs(272, 256))
    assert ttft == pytest.approx(3.3) and itl == pytest.approx(0.076)
    assert one_core.prefill_tokens / default().prefill_tokens > 2  # a prompt token costs more on one core
    assert "rescaled" in one_core.note
    with pytest.raises(ValueError, match="no positive rescaling"):
        rescaled(default(), 0.01, 10.0)  # a prompt faster than its decodes: no cost of this shape
