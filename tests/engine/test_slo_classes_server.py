"""Per-request SLO classes through the real server and SmolLM2 (docs/slo-classes.md), with the official openai
client: how a request picks its class (header, the Inference Extension's objective header, service_tier, the
default) and the refusals (an unknown class 400, above the API key's class 403, a sheddable class past its queue
limit 429 with Retry-After); a higher class preempts a lower one that fills the engine, and no output changes;
the latency series and SLO-met counters by class."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from chunkpilot.contract import metric_names as m
from chunkpilot.contract.slo import SLOClass, SLOClasses, SLOTargets

from .server_proc import EngineServer, wait_for

CLASSES = SLOClasses((
    SLOClass("interactive", 10, SLOTargets.p99(ttft=30.0, itl=5.0)),
    SLOClass("batch", 0, SLOTargets.p99(ttft=300.0, itl=30.0), share=0.2),
    SLOClass("spare", -1, SLOTargets.p99(ttft=600.0), queue_limit=1),
), "interactive")
OPEN, BATCH_KEY = "open-key", "batch-key"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    srv = EngineServer(smollm2_dir, tmp_path_factory.mktemp("logs"), "--slo-classes", CLASSES.to_json(),
                       "--max-num-seqs", "4", "--token-budget", "64", "--max-chunk", "64", "--max-model-len", "512",
                       "--threads", "1", env={"CHUNKPILOT_API_KEY": f"{OPEN},{BATCH_KEY}:batch"}).wait_ready()
    yield srv
    srv.stop()


def client(server, key=OPEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def complete(server, key=OPEN, max_tokens=4, headers=None, service_tier=None):
    """A greedy completion (the legacy completions API has no service_tier parameter in the client: the body)."""
    body = {"service_tier": service_tier} if service_tier else None
    return client(server, key).completions.create(model="smollm2", prompt=PROMPT, max_tokens=max_tokens,
                                                  temperature=0, extra_headers=headers, extra_body=body)


def test_a_request_picks_its_class_and_the_response_says_which(server):
    assert complete(server).service_tier == "interactive"  # the default
    assert complete(server, headers={"x-chunkpilot-slo-class": "batch"}).service_tier == "batch"
    assert complete(server, headers={"x-gateway-inference-objective": "spare"}).service_tier == "spare"
    assert complete(server, service_tier="batch").service_tier == "batch"
    assert complete(server, service_tier="auto").service_tier == "interactive"
    chat = client(server).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=3, temperature=0, stream=True, service_tier="batch")
    tiers = {c.service_tier for c in chat}
    assert tiers == {"batch"}, tiers
    # greedy output does not depend on the class
    texts = {complete(server, max_tokens=8, service_tier=c).choices[0].text for c in CLASSES.names}
    assert len(texts) == 1, texts


def test_an_unknown_class_and_a_class_above_the_key_are_refused_with_what_to_change(server):
    with pytest.raises(openai.BadRequestError) as e:
        complete(server, service_tier="gold")
    err = e.value.body
    assert err["code"] == "unknown_slo_class" and err["param"] == "service_tier"
    assert "interactive, batch, spare" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        complete(server, headers={"x-chunkpilot-slo-class": "gold"})
    assert "header x-chunkpilot-slo-class" in e.value.body["message"]
    with pytest.raises(openai.PermissionDeniedError) as e:
        complete(server, BATCH_KEY, service_tier="interactive")
    assert e.value.body["code"] == "slo_class_not_allowed" and "'batch' or below" in e.value.body["message"]
    assert complete(server, BATCH_KEY).service_tier == "batch"  # the default, capped at the key's class
    assert complete(server, BATCH_KEY, service_tier="spare").service_tier == "spare"  # below it: fine


def stream_in_background(server, n: int, cls: str, max_tokens: int, prompt_of=lambda i: f"{PROMPT} {i}"):
    """`n` greedy streams of class `cls` on threads; each thread's text and the time of its first token."""
    out: list[dict] = [{} for _ in range(n)]

    def one(i):
        text, first = "", None
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, headers={
                "Authorization": f"Bearer {OPEN}", "x-chunkpilot-slo-class": cls}, json={
                "model": "smollm2", "prompt": prompt_of(i), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            out[i]["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first = first or time.monotonic()
                    text += json.loads(line[6:])["choices"][0]["text"]
        out[i].update(text=text, first=first)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, out


def test_a_higher_class_takes_a_slot_from_a_lower_one_and_no_output_changes(server):
    before = server.metrics()[m.PREEMPTIONS]
    threads, batch = stream_in_background(server, 4, "batch", 80)  # every sequence slot
    try:
        assert wait_for(lambda: server.metrics()[m.NUM_RUNNING] == 4, 60)
        start = time.monotonic()
        r = complete(server, max_tokens=4)  # interactive
        took = time.monotonic() - start
        assert r.service_tier == "interactive"
        assert any(t.is_alive() for t in threads), "the batch streams were still running when it was served"
    finally:
        for t in threads:
            t.join(120)
    assert server.metrics()[m.PREEMPTIONS] >= before + 1  # a batch sequence gave its slot
    assert all(b["status"] == 200 for b in batch)
    # the preempted one was recomputed: every batch text equals the same prompt served alone
    for i, b in enumerate(batch):
        alone = client(server).completions.create(model="smollm2", prompt=f"{PROMPT} {i}", max_tokens=80,
                                                  temperature=0, extra_body={"ignore_eos": True})
        assert b["text"] == alone.choices[0].text, i
    print(f"\ninteractive served in {took:.2f} s while four batch streams ran")


def test_a_sheddable_class_past_its_queue_limit_gets_429_with_retry_after(server):
    threads, held = stream_in_background(server, 4, "interactive", 100)  # every slot, not preemptible by spare
    spare = []
    try:
        assert wait_for(lambda: server.metrics()[m.NUM_RUNNING] == 4, 60)
        spare_threads, spare = stream_in_background(server, 1, "spare", 2)  # waits: nothing below it runs
        assert wait_for(lambda: server.metrics()[m.NUM_WAITING] >= 1, 30)
        r = httpx.post(server.url + "/v1/completions", timeout=30, headers={
            "Authorization": f"Bearer {OPEN}", "x-chunkpilot-slo-class": "spare"},
            json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        assert "SLO class 'spare'" in r.json()["error"]["message"] and "queueLimit is 1" in r.json()["error"]["message"]
        # another class is not limited by spare's queue
        assert complete(server, headers={"x-chunkpilot-slo-class": "batch"}, max_tokens=1).service_tier == "batch"
    finally:
        for t in threads:
            t.join(120)
    for t in spare_threads:
        t.join(60)
    assert spare[0]["status"] == 200 and spare[0]["text"]  # the one that waited was served
    rejected = server.metrics()
    assert rejected[m.REQUESTS_REJECTED + str([(m.REASON_LABEL, "class_queue_full")])] >= 1


def test_latency_series_and_slo_met_counters_by_class(server):
    complete(server, service_tier="batch")
    got = server.metrics()
    for cls in CLASSES.names:  # every class's series exists from the start
        assert m.TTFT + "_count" + str([(m.SLO_CLASS_LABEL, cls)]) in got
        assert m.SLO_MET + str([(m.SLO_CLASS_LABEL, cls)]) in got
    assert got[m.TTFT + "_count" + str([(m.SLO_CLASS_LABEL, "batch")])] >= 1
    assert got[m.SLO_MET + str([(m.SLO_CLASS_LABEL, "batch")])] >= 1  # 300 s TTFT, 30 s ITL: kept
    finished = sum(v for k, v in got.items() if k.startswith(m.REQUEST_SUCCESS) and "'batch'" in k)
    assert finished >= got[m.SLO_MET + str([(m.SLO_CLASS_LABEL, "batch")])]


def test_the_tuner_measures_each_class_on_the_real_prometheus(server, tmp_path):
    """The tuner's per-class window (docs/slo-classes.md, "The tuner") from the real Prometheus scraping this
    engine: each class's finished and kept requests (the engine's exact counters), its own latencies."""
    from chunkpilot.lab.prometheus_server import PrometheusServer
    from chunkpilot.tuner.prometheus import PrometheusMeasurer, PrometheusSource

    from ..conftest import require_tool

    require_tool("prometheus", "sudo apt-get install prometheus (Debian/Ubuntu), or put it on PATH")
    prom = PrometheusServer(tmp_path / "prom", [server.url.removeprefix("http://")]).start()
    try:
        source = PrometheusSource(prom.url, 'job="chunkpilot"')
        # a first scrape before the traffic: increase() counts from it
        assert wait_for(lambda: source.query(f'{m.SLO_MET}{{job="chunkpilot"}}'), 30)
        for _ in range(3):
            complete(server, service_tier="batch")
        complete(server)  # interactive
        # until Prometheus scraped every class's last count (the interactive request was the last change)
        got = server.metrics()
        for cls in ("batch", "interactive"):
            scraped = f'sum({m.SLO_MET}{{job="chunkpilot",slo_class="{cls}"}})'
            done = got[m.SLO_MET + str([(m.SLO_CLASS_LABEL, cls)])]
            assert wait_for(lambda: (source.scalar(scraped) or 0) >= done, 30), cls
        window = PrometheusMeasurer(source, CLASSES.get("interactive").slo, sleep=lambda s: False,
                                    classes=CLASSES).measure(60)
        # the chart dashboard's per-class attainment panel shows this engine's classes
        from pathlib import Path

        dash = json.loads((Path(__file__).parents[2] / "helm/chunkpilot/files/dashboard.json").read_text())
        expr = next(p for p in dash["panels"] if p["title"].startswith("SLO classes (deployments"))["targets"][0]
        assert {r["metric"][m.SLO_CLASS_LABEL] for r in source.query(expr["expr"])} == set(CLASSES.names)
    finally:
        prom.stop()
    by = {c.name: c for c in window.classes}
    assert list(by) == CLASSES.names
    # increase() extrapolates every series scraped together by the same factor (the window is longer than the
    # data): the counts at least, and exactly in proportion
    assert by["batch"].finished >= 3 and by["batch"].met == pytest.approx(by["batch"].finished, rel=0.01)
    assert by["interactive"].finished == pytest.approx(by["batch"].finished / 3, rel=0.01)
    assert by["spare"].finished == pytest.approx(0, abs=0.01) and by["spare"].ttft is None  # no traffic
    assert by["batch"].ttft is not None and by["batch"].ttft <= 30.0  # at its own quantile, in seconds
    assert by["batch"].ttft_slo == 300.0 and by["interactive"].itl_slo == 5.0 and by["spare"].sheddable
    assert window.goodput == pytest.approx(sum(c.met for c in window.classes) / 60)
