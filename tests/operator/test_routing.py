"""spec.routing (issue 54): what the operator renders for the Gateway API Inference Extension (an InferencePool of
the engine pods, an endpoint picker with a least-privilege Role, an HTTPRoute), and the real parts judging it: the
real API server with GIE v1.5.0's CRDs takes the objects, and the real v1.5.0 endpoint picker, run as the
ServiceAccount the operator made and configured by the ConfigMap it rendered, reads a real chunkpilot engine's
gauges through the pool (tests/cluster/ routes requests through Envoy and the picker on a node)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import httpx
import kubernetes
import pytest
import yaml

from chunkpilot.api import InferenceDeployment
from chunkpilot.api import types as t
from chunkpilot.contract import metric_names as m
from chunkpilot.lab.child_process import free_port, stop_process
from chunkpilot.operator import builders as b
from chunkpilot.operator import gateway, routing

from ..conftest import require_tool
from ..waiting import eventually
from . import gie as gie_parts
from .envoy import Envoy
from .operator_proc import Cluster, operator, sample
from .test_crd_and_builders import K8S_VERSIONS, SMOL


def routed(routing_spec: dict | None = None, **spec: object) -> InferenceDeployment:
    raw = yaml.safe_load(SMOL.read_text())
    raw["metadata"] |= {"namespace": "ml", "uid": "1234-abcd", "generation": 2}
    raw["spec"] |= spec
    raw["spec"]["routing"] = routing_spec if routing_spec is not None else {}
    return InferenceDeployment.model_validate(raw)


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"] if o["kind"] not in ("Deployment", "Service", "ConfigMap") or
            not o["metadata"]["name"].endswith("-epp") else f"epp {o['kind']}": o for o in objects}


# ---- what the builders render ----------------------------------------------------------------------------------
def test_routing_renders_a_pool_of_the_engine_pods_and_its_endpoint_picker():
    obj = routed({"gateway": {"name": "inference-gateway", "namespace": "gw", "sectionName": "http"}})
    name = obj.metadata["name"]
    settings = b.OperatorSettings(epp_image="registry.example/epp:v1.5.0")
    objs = by_kind(b.desired_objects(obj, settings, pool_crd=True))
    pool = objs["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == name
    assert pool["spec"]["selector"]["matchLabels"] == b.selector_labels(name)
    assert pool["spec"]["targetPorts"] == [{"number": b.ENGINE_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {"name": f"{name}-epp", "port": {"number": 9002},
                                                 "failureMode": "FailOpen"}
    # the picker: the admin's image, this pool, the rendered config; one replica (its prefix index is in memory)
    epp = objs["epp Deployment"]
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert container["image"] == "registry.example/epp:v1.5.0" and epp["spec"]["replicas"] == 1
    assert args[args.index("--pool-name") + 1] == name and args[args.index("--pool-namespace") + 1] == "ml"
    assert args[args.index("--config-file") + 1] == "/config/plugins.yaml"
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == f"{name}-epp"
    # a rollout starts the new picker before it stops the old one: no gap without a picker
    assert epp["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    # the picker reads its config once: another config, another pod
    other = by_kind(b.desired_objects(routed({"scorerWeights": {"queue": 1}}), settings, pool_crd=True))
    annotation = [d["spec"]["template"]["metadata"]["annotations"][routing.CONFIG_HASH]
                  for d in (epp, other["epp Deployment"])]
    assert annotation[0] != annotation[1]
    svc = objs["epp Service"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {9002, 9090}
    assert svc["spec"]["selector"] == epp["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"] != b.selector_labels(name)  # the engines' Service does not reach the picker
    # its config: GIE's three scorers with its default weights, and chunkpilot's metric names for the engines
    config = json.loads(objs["epp ConfigMap"]["data"]["plugins.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    (profile,) = config["schedulingProfiles"]
    assert {p["pluginRef"]: p["weight"] for p in profile["plugins"]} == {
        "queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3}
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    assert extractor["defaultEngine"] == "chunkpilot" and extractor["engineConfigs"] == [{
        "name": "chunkpilot", "queuedRequestsSpec": m.NUM_WAITING, "runningRequestsSpec": m.NUM_RUNNING,
        "kvUsageSpec": m.KV_CACHE_USAGE, "loraSpec": "", "cacheInfoSpec": m.CACHE_CONFIG_INFO}]
    # least privilege: reads of the pool, its objectives and its pods, in the resource's namespace alone
    role = objs["Role"]
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in role["rules"])
    assert objs["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": f"{name}-epp", "namespace": "ml"}]
    # the engine pods carry the engine-type label the picker chooses its metric names by
    engine = next(o for o in b.desired_objects(obj, settings, pool_crd=True)
                  if o["kind"] == "Deployment" and o["metadata"]["name"] == name)
    assert engine["spec"]["template"]["metadata"]["labels"][t.ENGINE_TYPE_LABEL] == "chunkpilot"
    assert t.ENGINE_TYPE_LABEL not in engine["spec"]["selector"]["matchLabels"]
    # the Gateway's route to the pool, streaming without the Gateway's request timeout
    route = objs["HTTPRoute"]
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gateway", "namespace": "gw", "sectionName": "http"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}]
    # every object the API server knows the schema of, strictly
    import kubernetes_validate

    for o in objs.values():
        if o["kind"] not in ("InferencePool", "HTTPRoute"):  # GIE's and the Gateway API's CRDs: the test below
            kubernetes_validate.validate(o, K8S_VERSIONS[-1], strict=True)
    # and status says where to send traffic
    st = routing.status(obj, pool_crd=True)
    assert (st.inference_pool, st.endpoint_picker, st.http_route) == (name, f"{name}-epp.ml.svc:9002", name)


def test_a_weight_of_zero_leaves_its_scorer_out_and_no_gateway_no_route():
    obj = routed({"scorerWeights": {"queue": 0, "prefix": 5}})
    objs = by_kind(b.desired_objects(obj, b.OperatorSettings(), pool_crd=True))
    config = json.loads(objs["epp ConfigMap"]["data"]["plugins.yaml"])
    assert {p["pluginRef"]: p["weight"] for p in config["schedulingProfiles"][0]["plugins"]} == {
        "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 5}
    assert "queue-scorer" not in {p["type"] for p in config["plugins"]}
    assert "HTTPRoute" not in objs and routing.status(obj, pool_crd=True).http_route is None
    assert objs["epp Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] == routing.EPP_IMAGE
    assert not [o for o in objs.values() if o["metadata"]["name"].endswith("-gateway")]  # no bundled gateway


def test_the_bundled_gateway_is_envoy_in_front_of_the_picker():
    obj = routed({"bundledGateway": True})
    settings = b.OperatorSettings(envoy_image="registry.example/envoy:v1.40.0")
    objs = b.desired_objects(obj, settings, pool_crd=True)
    config, deploy, svc = [o for o in objs if o["metadata"]["name"] == "smollm2-gateway"]
    assert (config["kind"], deploy["kind"], svc["kind"]) == ("ConfigMap", "Deployment", "Service")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/envoy:v1.40.0"
    assert svc["spec"]["ports"][0]["port"] == b.ENGINE_PORT and svc["spec"]["selector"] == deploy["spec"]["selector"][
        "matchLabels"]
    assert routing.status(obj, pool_crd=True).url == "http://smollm2-gateway.ml.svc:8000/v1"
    boot = yaml.safe_load(config["data"]["envoy.yaml"])
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    address = clusters["ext_proc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "smollm2-epp.ml.svc", "port_value": 9002}
    assert set(clusters) == {"ext_proc", "original_destination_cluster"}  # no way around the picker
    assert deploy["spec"]["template"]["metadata"]["annotations"][routing.CONFIG_HASH] == routing.config_hash(
        config["data"]["envoy.yaml"])
    # the pool's failure mode, for Gateways that can fail open
    closed = by_kind(b.desired_objects(routed({"failureMode": "FailClose"}), settings, pool_crd=True))
    assert closed["InferencePool"]["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    import kubernetes_validate

    for o in (config, deploy, svc):
        kubernetes_validate.validate(o, K8S_VERSIONS[-1], strict=True)
    # the operator deletes the gateway with spec.routing (or the flag) gone
    assert {("v1", "ConfigMap", "smollm2-gateway"), ("apps/v1", "Deployment", "smollm2-gateway"),
            ("v1", "Service", "smollm2-gateway")} <= set(b.optional_children("smollm2"))


def test_without_the_pool_crd_nothing_of_routing_is_rendered_and_status_says_what_to_install():
    obj = routed()
    plain = b.desired_objects(obj, b.OperatorSettings(), pool_crd=False)
    assert {o["kind"] for o in plain} <= {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    assert not [o for o in plain if o["metadata"]["name"].endswith("-epp")]
    st = routing.status(obj, pool_crd=False)
    assert st.inference_pool is None and "InferencePool CRD" in st.message and "v1.5.0" in st.message
    # without spec.routing: no status, no label, whatever the cluster has
    obj.spec.routing = None
    assert routing.status(obj, pool_crd=True) is None
    (engine,) = [o for o in b.desired_objects(obj, b.OperatorSettings(), pool_crd=True) if o["kind"] == "Deployment"]
    assert t.ENGINE_TYPE_LABEL not in engine["spec"]["template"]["metadata"]["labels"]


def test_routing_is_refused_with_disaggregation_and_without_a_scorer():
    with pytest.raises(ValueError, match="routing does not work with disaggregation yet"):
        routed({}, disaggregation={"mode": "on"})
    with pytest.raises(ValueError, match="leaves no scorer"):
        routed({"scorerWeights": {"queue": 0, "kvCache": 0, "prefix": 0}})
    with pytest.raises(ValueError, match="FailOpen"):
        routed({"failureMode": "FailSometimes"})


# ---- on the real API server, with the real endpoint picker and Envoy --------------------------------------------
NS = "routing"
NAME = "chat"
PODS = 3
# each pod's address: loopback ones of their own, so that every engine listens on the pool's port 8000
ENGINE_HOSTS = [f"127.0.0.{i}" for i in range(2, 2 + PODS)]


@pytest.fixture(scope="module")
def gie(control_plane):
    """GIE v1.5.0's CRDs and the Gateway API's HTTPRoute, Established, for this module; the picker's binary."""
    epp = require_tool(gie_parts.EPP, gie_parts.HOW)
    with gie_parts.installed_crds(control_plane):
        yield epp


class Chain:
    """The operator's routing objects for a resource of three pods, each pod a real engine at its own loopback
    address (the pods played as a kubelet would report them), the real picker as the ServiceAccount the operator
    made with the rendered arguments and config, and Envoy in front of it: a Gateway, as GIE's e2e runs one."""

    def __init__(self, k: Cluster, op, engines: list, picker: Picker, envoy: Envoy, gateway: str, mark: int) -> None:
        self.k, self.op, self.engines, self.picker, self.envoy = k, op, engines, picker, envoy
        self.gateway, self.mark = gateway, mark

    def picker_metrics(self) -> dict[str, float]:
        if self.picker.proc.poll() is not None:
            raise AssertionError(f"the endpoint picker exited {self.picker.proc.returncode}:\n{self.diagnose()}")
        return epp_metrics(self.picker.ports["--metrics-port"])

    def served(self) -> list[float]:
        """Each engine's finished requests."""
        return [sum(v for key, v in e.metrics().items() if key.startswith(m.REQUEST_SUCCESS)) for e in self.engines]

    def diagnose(self) -> str:
        return (f"picker:\n{self.picker.log()}\nenvoy:\n{self.envoy.log()}\n"
                f"status: {self.k.status(NS, NAME)}\noperator:\n{self.op.log(2000)}")


class Picker:
    """The real picker on this host with the rendered Deployment's arguments and config, as the ServiceAccount the
    operator made; start() and stop() (SIGTERM: its gRPC server's graceful stop) as a pod's restart would."""

    def __init__(self, binary: str, args: list[str], config: str, kubeconfig: Path, log_path: Path) -> None:
        self.ports = {flag: free_port() for flag in ("--grpc-port", "--grpc-health-port", "--metrics-port")}
        self.argv = [binary, *picker_argv(args, config, self.ports)]
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "NAMESPACE": NS, "POD_NAME": f"{NAME}-epp-0"}
        self.log_path, self.proc = log_path, None

    def start(self) -> None:
        with open(self.log_path, "a") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def ready(self) -> bool:
        """It found every pod through the pool and reads their gauges."""
        return _answers(self.ports["--metrics-port"]) and \
            epp_metrics(self.ports["--metrics-port"]).get("inference_pool_ready_pods") == PODS

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10)

    def log(self) -> str:
        return self.log_path.read_text()[-3000:]


def picker_argv(args: list[str], config: str, ports: dict[str, int]) -> list[str]:
    """The rendered Deployment's arguments with its ports on free ones (tests run side by side) and its ConfigMap's
    config inline."""
    argv = []
    for i, a in enumerate(args):
        if i and args[i - 1] in ports:
            a = str(ports[args[i - 1]])
        elif i and args[i - 1] == "--config-file":
            a = config
        argv.append("--config-text" if a == "--config-file" else a)
    return argv


@pytest.fixture(scope="module")
def chain(gie, control_plane, chart_accounts, smollm2_dir, tmp_path_factory):
    from ..engine.server_proc import EngineServer

    work = tmp_path_factory.mktemp("routing")
    k = Cluster(control_plane.api())
    k.namespace(NS)
    engines = [EngineServer(smollm2_dir, work, port=b.ENGINE_PORT, host=h) for h in ENGINE_HOSTS]
    picker = envoy = None
    with operator(chart_accounts["operator"], work) as op:
        try:
            k.create(sample(NAME, NS, replicas=PODS, tuning={"mode": "off"},
                            routing={"gateway": {"name": "inference-gateway"}}))
            assert eventually(lambda: k.get("deployments", NS, f"{NAME}-epp") and k.get("configmaps", NS, f"{NAME}-epp"),
                              60), op.log()
            # the engine pods, played as a kubelet would report them: Running, Ready, each at its engine's address
            selector = ",".join(f"{key}={v}" for key, v in b.selector_labels(NAME).items())
            assert eventually(lambda: len(k.core.list_namespaced_pod(NS, label_selector=selector).items) == PODS, 60)
            for e in engines:
                e.wait_ready()
            for pod, host in zip(k.core.list_namespaced_pod(NS, label_selector=selector).items, ENGINE_HOSTS):
                now = pod.metadata.creation_timestamp.strftime("%Y-%m-%dT%H:%M:%SZ")
                k.core.patch_namespaced_pod_status(pod.metadata.name, NS, {"status": {
                    "phase": "Running", "podIP": host, "podIPs": [{"ip": host}],
                    "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}})
            deploy = k.get("deployments", NS, f"{NAME}-epp")
            args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
            config = k.get("configmaps", NS, f"{NAME}-epp")["data"]["plugins.yaml"]
            kubeconfig = control_plane.service_account_kubeconfig(NS, f"{NAME}-epp", work / "epp.kubeconfig")
            mark = control_plane.audit_mark()
            picker = Picker(gie, args, config, kubeconfig, work / "epp.log")
            picker.start()
            # the bundled gateway's configuration, with the picker at this host's address for its Service's name
            listen, admin = free_port(), free_port()
            envoy = Envoy(work, gateway.envoy_config(
                listen, admin, gateway.Upstream(("127.0.0.1",), picker.ports["--grpc-port"])), admin)
            c = Chain(k, op, engines, picker, envoy, f"http://127.0.0.1:{listen}/v1", mark)
            assert eventually(lambda: c.picker_metrics() is not None and picker.ready(), 60), c.diagnose()
            yield c
        finally:
            if envoy is not None:
                envoy.stop()
            if picker is not None:
                picker.stop()
            for e in engines:
                e.stop()
            k.delete_namespace(NS)
        assert op.alive(), op.log()


def _answers(port: int) -> bool:
    try:
        epp_metrics(port)
        return True
    except httpx.HTTPError:
        return False


def epp_metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text):
        for s in fam.samples:
            if s.labels.get("name") == NAME:
                out[s.name] = s.value
    return out


def test_the_operator_makes_every_routing_object_and_says_where_to_send_traffic(chain):
    k = chain.k
    # the real API server took them, the InferencePool and HTTPRoute by their CRDs' schemas
    assert k.custom.get_namespaced_custom_object(*POOL)["spec"]["endpointPickerRef"]["name"] == f"{NAME}-epp"
    assert k.custom.get_namespaced_custom_object(*ROUTE)["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    assert k.status(NS, NAME).get("routing") == {"inferencePool": NAME, "endpointPicker": f"{NAME}-epp.{NS}.svc:9002",
                                                 "httpRoute": NAME, "message": ""}  # no url: no bundled gateway
    selector = ",".join(f"{key}={v}" for key, v in b.selector_labels(NAME).items())
    assert all(p.metadata.labels[t.ENGINE_TYPE_LABEL] == "chunkpilot"
               for p in k.core.list_namespaced_pod(NS, label_selector=selector).items)


def test_the_picker_reads_chunkpilots_gauges_through_the_pool(chain, control_plane):
    """While a request runs on one engine, the picker's pool averages follow chunkpilot's gauges (its metric names,
    mapped by the rendered config; a wrong name fails this, checked)."""
    seen = threading.Event()

    def stream_until_seen():
        # streamed, and closed once the picker saw it: the engine aborts the rest (waiting for 400 tokens on a busy
        # CPU took about 100 s of this test)
        with httpx.stream("POST", f"{chain.engines[0].url}/v1/completions", timeout=120, json={
                "model": "smollm2", "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as r:
            for _ in r.iter_lines():
                if seen.is_set():
                    return

    stream = threading.Thread(target=stream_until_seen)
    stream.start()
    try:
        assert eventually(lambda: chain.picker_metrics().get("inference_pool_average_running_requests", 0) > 0
                          and chain.picker_metrics().get("inference_pool_average_kv_cache_utilization", 0) > 0,
                          60), chain.diagnose()
    finally:
        seen.set()
        stream.join()
    # the operator's Role was enough: the picker was refused nothing
    refused = [e["requestURI"] for e in control_plane.audit(f"system:serviceaccount:{NS}:{NAME}-epp", chain.mark)
               if (e.get("responseStatus") or {}).get("code") == 403]
    assert not refused, refused


SYSTEM = ("You are the support assistant of a company that rents bicycles in twelve cities. Answer in one short "
          "sentence, politely, and never invent prices; the rental desk opens at eight and closes at six, helmets "
          "are free, children under ten ride with an adult, and a lost key costs one day of rental. ") * 3


def test_requests_through_the_gateway_that_share_a_prefix_go_to_one_pod(chain):
    """Envoy asks the picker for every request; requests with one long system prompt all land on one pod, whose
    prefix cache then holds it (its hits count it), where a Service would spread them over the three."""
    import openai

    client = openai.OpenAI(base_url=chain.gateway, api_key="unused", max_retries=0, timeout=60)
    before = chain.served()
    hits = [e.metrics().get(m.PREFIX_CACHE_HITS, 0) for e in chain.engines]
    questions = ["Can my child ride alone?", "Are helmets extra?", "When do you open?", "I lost my key.",
                 "Do you close at noon?", "What does a day cost?"]
    for q in questions:
        out = client.completions.create(model="smollm2", prompt=f"{SYSTEM}\nQuestion: {q}\nAnswer:", max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text and out.usage.completion_tokens == 4, out
    got = [a - b_ for a, b_ in zip(chain.served(), before)]
    assert sorted(got) == [0, 0, len(questions)], (got, chain.diagnose())
    pod = got.index(len(questions))
    gained = [e.metrics().get(m.PREFIX_CACHE_HITS, 0) - h for e, h in zip(chain.engines, hits)]
    assert gained[pod] >= (len(questions) - 1) * 64, gained  # the shared prompt, from its cache, every time but once
    # a stream through the gateway: the picker passes the SSE body through, and the usage chunk at its end
    chunks = list(client.completions.create(model="smollm2", prompt=f"{SYSTEM}\nQuestion: Hi\nAnswer:",
                                            max_tokens=4, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4, chunks[-1]


def test_a_destination_the_client_sends_is_dropped_before_anything_reads_it(chain):
    """Only the picker says where a request goes: a client's own x-gateway-destination-endpoint (here the picker's
    metrics port, which would answer 404) is removed before routing."""
    r = httpx.post(f"{chain.gateway}/completions", timeout=60, headers={
        gateway.DESTINATION_HEADER: f"127.0.0.1:{chain.picker.ports['--metrics-port']}"},
        json={"model": "smollm2", "prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, (r.status_code, r.text)


def test_the_picker_restarted_under_load_loses_no_request(chain):
    """Requests stream through the gateway while the picker stops (SIGTERM: its gRPC server's graceful stop) and,
    two seconds later, starts again, as its pod would on a restart: Envoy holds the requests that find no picker
    and tries it again, so none fails. With no picker for longer than Envoy holds a request, it answers 500 (the
    test's last part; GIE's FailClose, the only mode Envoy has in FULL_DUPLEX_STREAMED)."""
    import time

    with gie_parts.SteadyLoad(chain.gateway) as load:
        assert eventually(lambda: len(load.results) >= 4, 60), load.results
        chain.picker.stop()
        during = len(load.results)
        time.sleep(2)
        chain.picker.start()
        assert eventually(chain.picker.ready, 60), chain.diagnose()
        assert eventually(lambda: len(load.results) >= during + 6, 60), load.results
    assert not load.failed(), (load.failed(), len(load.results), chain.diagnose())
    # no picker for good: each request is held about gateway.HOLD_SECONDS, then refused
    chain.picker.stop()
    try:
        started = time.monotonic()
        refused = httpx.post(f"{chain.gateway}/completions", timeout=120,
                             json={"model": "smollm2", "prompt": "Hello", "max_tokens": 1})
        held = time.monotonic() - started
        assert refused.status_code == 500 and held >= gateway.HOLD_SECONDS / 3, (refused.status_code, held)
    finally:
        chain.picker.start()
    assert eventually(chain.picker.ready, 60), chain.diagnose()


def test_routing_removed_takes_every_routing_object_with_it(chain):
    k = chain.k
    k.patch(NAME, {"spec": {"routing": None}}, NS)

    def gone(fn, *args) -> bool:
        try:
            fn(*args)
        except kubernetes.client.ApiException as e:
            return e.status == 404
        return False
    assert eventually(lambda: gone(k.custom.get_namespaced_custom_object, *POOL)
                      and gone(k.custom.get_namespaced_custom_object, *ROUTE)
                      and gone(k.core.read_namespaced_service_account, f"{NAME}-epp", NS)
                      and k.get("deployments", NS, f"{NAME}-epp") is None
                      and "routing" not in k.status(NS, NAME), 60), (k.status(NS, NAME), chain.op.log())


POOL = ("inference.networking.k8s.io", "v1", NS, "inferencepools", NAME)
ROUTE = ("gateway.networking.k8s.io", "v1", NS, "httproutes", NAME)
