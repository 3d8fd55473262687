"""The load generator: statistics on a hand-built trace, workload shapes and arrivals, and a short real run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from chunkpilot.cli.main import app
from chunkpilot.contract.slo import SLOTargets
from chunkpilot.loadgen.stats import RequestRecord, summarize
from chunkpilot.loadgen.workloads import MIXES, SHAPES, Phase, arrivals, build_workload, load_jsonl, scaled

from ..engine.server_proc import EngineServer
from ..engine.tiny_models import make_checkpoint


def rec(kind, start, first, gaps, tokens=None):
    times = [first]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(kind=kind, prompt_tokens=10, start=start, first_token=first, token_times=times,
                         end=times[-1], output_tokens=tokens or len(times))


def test_a_chunk_that_stands_for_several_tokens_splits_its_gap_over_them():
    """The server's running usage says chunk 2 carried three tokens (two without text of their own): its 0.9-s gap
    is three 0.3-s steps, not one 0.9-s gap; without counts (a server that sends none), one token a chunk."""
    r = RequestRecord(kind="chat", prompt_tokens=10, start=0.0, first_token=0.5, token_times=[0.5, 0.8, 1.7, 2.0],
                      token_counts=[1, 2, 5, 6], end=2.0, output_tokens=6)
    assert r.itls == pytest.approx([0.3, 0.3, 0.3, 0.3, 0.3])
    assert [t for t, _ in r.timed_itls()] == [0.8, 1.7, 1.7, 1.7, 2.0]
    assert kept_itl(r, 0.35) and not kept_itl(RequestRecord(**{**r.__dict__, "token_counts": []}), 0.35)


def kept_itl(r: RequestRecord, itl: float) -> bool:
    from chunkpilot.contract.slo import kept

    return kept(SLOTargets.p99(itl=itl), r.ttft, r.itls)


def test_statistics_on_a_hand_built_trace():
    records = [
        rec("chat", 0.0, 0.1, [0.05, 0.05, 0.05]),  # ttft 0.1, itl 0.05, e2e 0.25
        rec("chat", 1.0, 1.3, [0.05, 0.25, 0.05]),  # ttft 0.3, one 0.25 gap, e2e 0.65
        rec("rag", 2.0, 3.0, [0.1, 0.1, 0.1]),  # ttft 1.0, e2e 1.3
        RequestRecord(kind="rag", prompt_tokens=10, start=3.0, error="HTTP 500"),
    ]
    s = summarize(records, SLOTargets.p99(ttft=0.5, itl=0.2), duration=4.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["request_throughput"] == pytest.approx(3 / 4)
    assert s["output_token_throughput"] == pytest.approx(12 / 4)
    # only the first request meets both SLOs: the second has a 0.25 s gap, the third a 1 s TTFT
    assert s["goodput"] == pytest.approx(1 / 4) and s["slo_attainment"] == pytest.approx(1 / 4)
    assert s["ttft_s"]["p50"] == pytest.approx(0.3)
    assert s["ttft_s"]["p90"] == pytest.approx(float(np.percentile([0.1, 0.3, 1.0], 90)))
    itls = [0.05] * 3 + [0.05, 0.25, 0.05] + [0.1] * 3
    assert s["itl_s"]["p99"] == pytest.approx(float(np.percentile(itls, 99)))
    assert s["itl_s"]["mean"] == pytest.approx(sum(itls) / 9)
    assert s["tpot_s"]["p50"] == pytest.approx(float(np.median([0.15 / 3, 0.35 / 3, 0.3 / 3])))
    assert s["e2e_s"]["p50"] == pytest.approx(0.65)
    assert s["by_kind"]["rag"]["completed"] == 1
    assert summarize(records, SLOTargets())["goodput"] > 0  # default duration: first start to last end


def test_phases_shift_rate_and_mix():
    rng = np.random.default_rng(0)
    phases = [Phase(200, 2.0, {"chat": 1.0}), Phase(200, 6.0, {"rag": 1.0})]
    times = [t for t, _ in arrivals(phases, rng)]
    first = sum(1 for t in times if t < 200)
    assert 340 < first < 460 and 1080 < len(times) - first < 1320
    specs = build_workload(phases, vocab_size=1000, seed=1, shapes={k: scaled(v, 0.01, None) for k, v in SHAPES.items()})
    assert {s.kind for s in specs if s.arrival < 200} == {"chat"} and {s.kind for s in specs if s.arrival >= 200} == {"rag"}
    assert all(len(s.prompt) == s.prompt_tokens for s in specs)


def test_burstier_arrivals_have_more_variable_gaps():
    gaps = {}
    for b in (0.25, 1.0, 4.0):
        times = [t for t, _ in arrivals([Phase(2000, 1.0, MIXES["chat"])], np.random.default_rng(3), burstiness=b)]
        d = np.diff(times)
        gaps[b] = d.std() / d.mean()
    assert gaps[0.25] > gaps[1.0] > gaps[4.0]
    with pytest.raises(ValueError, match="burstiness"):
        arrivals([Phase(1, 1, {})], np.random.default_rng(0), burstiness=0)


def test_shapes_respect_scale_and_cap():
    s = scaled(SHAPES["rag"], 0.1, 300)
    assert s.prompt == (204, 300)


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": [1, 2, 3], "kind": "ids"}\n')
    specs = load_jsonl(path, rate=2.0)
    assert [s.kind for s in specs] == ["jsonl", "ids"] and specs[1].prompt_tokens == 3
    assert 0 < specs[0].arrival < specs[1].arrival
    path.write_text('{"max_tokens": 3}\n')
    with pytest.raises(ValueError, match=":1: each line must be a JSON object"):
        load_jsonl(path, rate=None)


def test_short_real_run_writes_json_and_plot(tmp_path):
    model = make_checkpoint(tmp_path / "tiny", "llama")
    srv = EngineServer(str(model), tmp_path, "--max-model-len", "256", name="tiny").wait_ready()
    try:
        out, png = tmp_path / "result.json", tmp_path / "result.png"
        res = CliRunner().invoke(app, [
            "bench", "serve", "--base-url", srv.url, "--model", "tiny", "--model-dir", str(model), "--workload",
            "mixed", "--rate", "20", "--duration", "1", "--prompt-scale", "0.02", "--slo-ttft", "5", "--out",
            str(out), "--plot", str(png), "--label", "smoke",
        ])
        assert res.exit_code == 0, res.output
        data = json.loads(out.read_text())
        s = data["summary"]
        assert s["completed"] == s["requests"] > 5 and s["failed"] == 0
        assert data["conditions"]["knobs"]["token_budget"] == 512 and data["conditions"]["label"] == "smoke"
        assert all(r["output_tokens"] >= 16 and r["ttft"] > 0 for r in data["records"])
        assert png.stat().st_size > 10_000
        res = CliRunner().invoke(app, ["bench", "serve", "--base-url", srv.url, "--model", "tiny"])
        assert res.exit_code == 2 and "--model-dir" in res.output
    finally:
        srv.stop()
