"""The Helm chart with the real tools: helm lint/template, kubeconform (with the Kubernetes schemas that
kubernetes-validate ships, since nothing can be downloaded here, and a schema made from our CRD), promtool for the
alerts, and a real Prometheus that scraped a real engine for every PromQL expression of dashboard and rules."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from chunkpilot.engine import metrics as engine_metrics
from chunkpilot.tuner import metrics as tuner_metrics

from ..conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "chunkpilot"
VALUES = sorted((Path(__file__).parent / "values").glob("*.yaml"))
KUBE_VERSIONS = ["1.29.0", "1.33.0"]
GO_TOOLS = "bash scripts/go-tools.sh (builds them with `go install` into ~/.cache/chunkpilot/bin)"
# image.repository has no default (nobody publishes the images): every render names one, as an admin must.
REPOSITORY = ["--set", "image.repository=registry.example/chunkpilot"]


def helm() -> str:
    return require_tool("helm", GO_TOOLS)


def render(values: Path | None = None, *extra: str, kube_version: str = "1.31.0") -> str:
    cmd = [helm(), "template", "cp", str(CHART), "--namespace", "chunkpilot", "--kube-version", kube_version,
           *REPOSITORY, *extra]
    if values:
        cmd += ["-f", str(values)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stdout


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_chart_crd_is_the_committed_crd():
    assert (CHART / "crds" / "inferencedeployments.chunkpilot.io.yaml").read_bytes() == \
        (ROOT / "crds" / "inferencedeployments.chunkpilot.io.yaml").read_bytes(), \
        "copy crds/inferencedeployments.chunkpilot.io.yaml into helm/chunkpilot/crds/"


@pytest.mark.parametrize("values", [None, *VALUES], ids=lambda v: v.stem if v else "default")
def test_helm_lint_strict(values):
    cmd = [helm(), "lint", "--strict", str(CHART), "--kube-version", "1.31.0", *REPOSITORY] + \
        (["-f", str(values)] if values else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_values_schema_rejects_bad_values():
    res = subprocess.run([helm(), "lint", "--strict", str(CHART), "--set", "operator.replicas=-1",
                          "--set", "tuner.prometheusUrl=prometheus:9090"], capture_output=True, text=True)
    assert res.returncode != 0 and "replicas" in res.stdout + res.stderr and "prometheusUrl" in res.stdout + res.stderr


class SchemaStore:
    """kubeconform schema locations. Kubernetes' schemas come from the kubernetes-validate package (nothing can be
    downloaded here); its files point into a shared _definitions.json by absolute `$ref`s kubeconform cannot
    follow, so each kind we render gets a self-contained copy (its definitions inlined). Our CRD's schema is
    written from the chart's crds/ (ours and kopf's peering CRDs)."""

    def __init__(self, root: Path) -> None:
        import kubernetes_validate

        self.src = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
        self.root = root
        (root / "crds").mkdir()
        for path in sorted((CHART / "crds").glob("*.yaml")):  # ours, and kopf's peering CRDs
            for crd in yaml.safe_load_all(path.read_text()):
                for version in crd["spec"]["versions"]:
                    (root / "crds" / f"{crd['spec']['names']['kind'].lower()}_{version['name']}.json").write_text(
                        json.dumps(version["schema"]["openAPIV3Schema"]))

    def prepare(self, text: str, kube_version: str) -> list[str]:
        folder = f"v{kube_version}-local-strict"
        (self.root / folder).mkdir(exist_ok=True)
        defs = None
        for d in docs(text):
            group, _, version = d["apiVersion"].rpartition("/")
            name = f"{d['kind'].lower()}{'-' + group.split('.')[0] if group else ''}-{version}.json"
            target, source = self.root / folder / name, self.src / folder / name
            if target.exists() or not source.exists():
                continue  # not a Kubernetes kind (ours, or the Prometheus Operator's)
            if defs is None:
                defs = json.loads((self.src / folder / "_definitions.json").read_text())["$defs"]
            schema = json.loads(source.read_text().replace('"/api/_definitions.json#/$defs/', '"#/$defs/'))
            schema["$defs"] = defs
            target.write_text(json.dumps(schema))
        return [f"{self.root}/{{{{ .NormalizedKubernetesVersion }}}}-local{{{{ .StrictSuffix }}}}/"
                "{{ .ResourceKind }}{{ .KindSuffix }}.json",
                f"{self.root}/crds/{{{{ .ResourceKind }}}}_{{{{ .ResourceAPIVersion }}}}.json"]


@pytest.fixture(scope="module")
def schemas(tmp_path_factory) -> SchemaStore:
    return SchemaStore(tmp_path_factory.mktemp("schemas"))


def kubeconform(text: str, schemas: SchemaStore, kube_version: str) -> subprocess.CompletedProcess:
    tool = require_tool("kubeconform", GO_TOOLS)
    cmd = [tool, "-strict", "-summary", "-output", "text", "-kubernetes-version", kube_version,
           # No schema for the Prometheus Operator's kinds can be had offline; promtool checks the rules instead.
           "-skip", "ServiceMonitor,PrometheusRule"]
    for loc in schemas.prepare(text, kube_version):
        cmd += ["-schema-location", loc]
    return subprocess.run(cmd + ["-"], input=text, capture_output=True, text=True)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", [None, *VALUES], ids=lambda v: v.stem if v else "default")
def test_rendered_chart_passes_kubeconform_strict(values, kube_version, schemas):
    text = render(values, "--include-crds", kube_version=kube_version)
    res = kubeconform(text, schemas, kube_version)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Invalid: 0, Errors: 0" in res.stdout


def test_samples_pass_kubeconform_with_the_crd_schema(schemas):
    files = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
    samples = "\n---\n".join(p.read_text() for p in files)
    res = kubeconform(samples, schemas, "1.31.0")
    assert res.returncode == 0 and f"Valid: {len(files)}," in res.stdout, res.stdout + res.stderr
    bad = samples.replace("replicas: 2", "replicas: two", 1)
    assert kubeconform(bad, schemas, "1.31.0").returncode != 0  # the CRD schema is really applied


def test_pods_run_restricted_and_the_study_survives_uninstall():
    objs = docs(render())
    for d in (o for o in objs if o["kind"] == "Deployment"):
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]["type"] == \
            "RuntimeDefault"
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == \
                {"drop": ["ALL"]}
            assert c["livenessProbe"] and c["readinessProbe"] and c["resources"]["requests"]
    pvc = next(o for o in objs if o["kind"] == "PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    ext = docs(render(next(v for v in VALUES if v.stem == "external-db")))
    assert not any(o["kind"] == "PersistentVolumeClaim" for o in ext)
    tuner = next(o for o in ext if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("tuner"))
    env = {e["name"]: e for e in tuner["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"] == {"fieldPath": "metadata.name"}  # kopf's peering identity
    assert env["CHUNKPILOT_TUNER_STORAGE"]["valueFrom"]["secretKeyRef"] == {"name": "tuner-db", "key": "url"}
    roles = [o for o in ext if o["kind"] in ("Role", "ClusterRole")]
    assert all("*" not in v for r in roles for rule in r["rules"] for v in rule["verbs"] + rule["resources"])


def rules_file(tmp_path: Path) -> Path:
    objs = docs(render(None, "--set", "monitoring.prometheusRule.enabled=true",
                       "--set", "monitoring.serviceMonitor.enabled=true"))
    rule = next(o for o in objs if o["kind"] == "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    return path


def test_alerts_with_promtool(tmp_path):
    promtool = require_tool("promtool", "sudo apt-get install prometheus")
    rules = rules_file(tmp_path)
    res = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    (tmp_path / "alerts_test.yaml").write_text((Path(__file__).parent / "alerts_test.yaml").read_text())
    res = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def expressions(tmp_path: Path) -> list[str]:
    dash = json.loads((CHART / "files" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load(rules_file(tmp_path).read_text())
    return exprs + [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_every_metric_name_is_defined_in_code(tmp_path):
    rules = yaml.safe_load(rules_file(tmp_path).read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    known = set(engine_metrics.ALL_NAMES) | set(tuner_metrics.ALL_NAMES) | recorded | {"up"}
    for expr in expressions(tmp_path):
        for name in re.findall(r"chunkpilot:[a-z_:]+[a-z0-9_]*", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert name in known or base in known, f"{name} in {expr!r} is not defined by the metrics modules"


def test_every_expression_runs_on_prometheus_that_scraped_an_engine(smollm2_dir, tmp_path):
    require_tool("prometheus", "sudo apt-get install prometheus")
    from chunkpilot.lab.prometheus_server import PrometheusServer

    from ..engine.server_proc import EngineServer, wait_for

    engine = EngineServer(smollm2_dir, tmp_path, "--max-model-len", "512", "--kv-cache-memory-gb", "0.1").wait_ready()
    prom = PrometheusServer(tmp_path / "prom", [engine.url.removeprefix("http://")]).start()
    try:
        for i in range(3):
            httpx.post(engine.url + "/v1/completions", json={"model": "smollm2", "prompt": f"Hello {i}",
                                                               "max_tokens": 4}, timeout=60).raise_for_status()

        def query(q: str) -> dict:
            return httpx.get(prom.url + "/api/v1/query", params={"query": q}, timeout=10).json()
        assert wait_for(lambda: query("chunkpilot:time_to_first_token_seconds_count")["data"]["result"], 30)
        for expr in expressions(tmp_path):
            body = query(expr)
            assert body["status"] == "success", (expr, body)
        # and the engine's series are there under the names the dashboard uses
        # (rate() needs two scrapes of the counter after the requests)
        assert wait_for(lambda: query('sum(rate(chunkpilot:request_success_total[5m])) >= 0')["data"]["result"], 30)
    finally:
        prom.stop()
        engine.stop()


def _args(text: str, component: str) -> list[str]:
    (dep,) = [d for d in docs(text) if d["kind"] == "Deployment" and d["metadata"]["name"].endswith(component)]
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("sets, policy", [
    ([], dict(allowed_host_paths=(), allowed_image_prefixes=None, allowed_priority_classes=(),
              allowed_toleration_keys=("nvidia.com/gpu",))),
    (["--set", "operator.policy.allowedHostPaths={/mnt/models}", "--set", "operator.policy.allowedImagePrefixes={*}",
      "--set", "operator.policy.allowedPriorityClasses={batch}", "--set", "operator.policy.allowedTolerationKeys=null",
      "--set", "operator.engineNetworkPolicy.enabled=false", "--set", "operator.hfEndpoint=http://hub.mirror"],
     dict(allowed_host_paths=("/mnt/models",), allowed_image_prefixes=("*",), allowed_priority_classes=("batch",),
          allowed_toleration_keys=())),
])
def test_the_charts_arguments_are_what_the_commands_accept(monkeypatch, sets, policy):
    """The operator's and the tuner's rendered args, given to the real CLIs (the images' entrypoints are
    `chunkpilot operator run` and `chunkpilot tuner run`), parse into the settings the values say."""
    from typer.testing import CliRunner

    from chunkpilot.cli.main import app
    from chunkpilot.operator import handlers
    from chunkpilot.operator.policy import Policy
    from chunkpilot.tuner import daemon

    text = render(None, *sets)
    seen = {}
    monkeypatch.setattr(handlers, "run", lambda config: seen.setdefault("operator", config))
    monkeypatch.setattr(daemon, "run", lambda cluster, metrics, stop: seen.setdefault("tuner", cluster))
    import signal

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the CLI's SIGTERM handler must not outlive the test
    res = CliRunner().invoke(app, ["operator", "run", *_args(text, "operator")])
    assert res.exit_code == 0, res.output
    engine = seen["operator"].engine
    assert engine.policy == Policy(**policy)
    assert engine.network_policy_namespaces == (() if sets else ("monitoring",))
    assert (engine.default_cpu_request, engine.default_memory_request) == ("1", "4Gi")
    # on by default (the engine's /metrics and /docs answer without the key), Prometheus' namespace admitted
    assert engine.engine_network_policy == (not sets) and engine.hf_endpoint == ("http://hub.mirror" if sets else None)
    tuner_args = [a for a in _args(text, "tuner") if not a.startswith("--metrics-port")] + ["--metrics-port", "0"]
    res = CliRunner().invoke(app, ["tuner", "run", *tuner_args])
    assert res.exit_code == 0, res.output
    assert seen["tuner"].apply_timeout == 30


# -- what a cluster admin meets on the first day (issue: `helm install` for real) --------------------------------------

def helm_fails(*args: str) -> str:
    """helm template's error output for values it must refuse."""
    res = subprocess.run([helm(), "template", "cp", str(CHART), "--namespace", "chunkpilot", "--kube-version", "1.31.0",
                          *args],
                         capture_output=True, text=True)
    assert res.returncode != 0, res.stdout[:500]
    return res.stderr


def test_an_install_without_an_image_repository_is_refused_naming_the_value():
    """No public registry serves the images: a default that nobody serves would end in ImagePullBackOff and a
    release failed after 5 minutes. The chart refuses at once and says what to set."""
    err = helm_fails()
    assert "image.repository is empty" in err and "--set image.repository=" in err and "docs/helm.md" in err


def test_every_service_monitor_carries_the_release_label_and_the_admins_labels(monkeypatch):
    """kube-prometheus-stack's Prometheus selects monitors by `release: <its release>`. The tuner's ServiceMonitor
    and the engines' (made by the operator, from its arguments) carry it and the admin's extra labels; the tuner's
    keeps its series' own namespace label (honorLabels)."""
    from typer.testing import CliRunner

    from chunkpilot.api.types import InferenceDeployment
    from chunkpilot.cli.main import app
    from chunkpilot.operator import builders, handlers

    text = render(None, "--set", "monitoring.serviceMonitor.enabled=true",
                  "--set", "monitoring.serviceMonitor.labels.team=ml", "--set", "monitoring.prometheusRule.enabled=true")
    objs = docs(text)
    sm = next(o for o in objs if o["kind"] == "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack" and sm["metadata"]["labels"]["team"] == "ml"
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    rule = next(o for o in objs if o["kind"] == "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    args = _args(text, "operator")
    assert "--service-monitor-label=release=kube-prometheus-stack" in args and "--service-monitor-label=team=ml" in args
    seen = {}
    monkeypatch.setattr(handlers, "run", lambda config: seen.setdefault("operator", config))
    import signal

    monkeypatch.setattr(signal, "signal", lambda *a: None)
    res = CliRunner().invoke(app, ["operator", "run", *args])
    assert res.exit_code == 0, res.output
    settings = seen["operator"].engine
    obj = InferenceDeployment.model_validate(yaml.safe_load((ROOT / "crds" / "samples" / "smollm2.yaml").read_text())
                                             | {"metadata": {"name": "llm", "namespace": "team", "uid": "u1"}})
    engine_sm = builders.service_monitor(obj, settings)
    assert engine_sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert engine_sm["metadata"]["labels"]["team"] == "ml"
    assert engine_sm["metadata"]["labels"]["app.kubernetes.io/instance"] == "llm"  # the selector's own labels stay
    # an admin who selects by their own labels only
    text = render(None, "--set", "monitoring.prometheus.release=", "--set", "monitoring.serviceMonitor.enabled=true")
    assert not any(a.startswith("--service-monitor-label") for a in _args(text, "operator"))
    sm = next(o for o in docs(text) if o["kind"] == "ServiceMonitor")
    assert "release" not in sm["metadata"]["labels"]
    res = CliRunner().invoke(app, ["operator", "run", "--service-monitor-label", "no-equals-sign"])
    assert res.exit_code == 2 and "KEY=VALUE" in res.output


def test_the_prometheus_namespace_is_one_value():
    """The engine NetworkPolicy admits the Prometheus namespace the tuner reads from, from one value."""
    text = render(None, "--set", "monitoring.prometheus.namespace=obs")
    assert "--prometheus-url=http://prometheus-operated.obs.svc:9090" in _args(text, "tuner")
    assert "--network-policy-namespace=obs" in _args(text, "operator")
    assert "--network-policy-namespace=monitoring" not in _args(text, "operator")
    text = render(None, "--set", "tuner.prometheusUrl=http://prom.example:9090",
                  "--set", "operator.engineNetworkPolicy.allowNamespaces={gateway}")
    assert "--prometheus-url=http://prom.example:9090" in _args(text, "tuner")
    assert {"--network-policy-namespace=monitoring", "--network-policy-namespace=gateway"} <= set(_args(text, "operator"))


def test_the_tuner_down_alert_is_there_only_when_something_scrapes_the_tuner():
    def alerts(*sets: str) -> set[str]:
        rule = next(o for o in docs(render(None, "--set", "monitoring.prometheusRule.enabled=true", *sets))
                    if o["kind"] == "PrometheusRule")
        return {r.get("alert") for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "ChunkpilotTunerDown" not in alerts()
    assert "ChunkpilotTunerDown" in alerts("--set", "monitoring.serviceMonitor.enabled=true")
    assert "ChunkpilotTunerDown" not in alerts("--set", "monitoring.serviceMonitor.enabled=true",
                                               "--set", "tuner.enabled=false")
    # only that one goes: every other alert stays, the engine one among them
    assert alerts() == alerts("--set", "monitoring.serviceMonitor.enabled=true") - {"ChunkpilotTunerDown"}
    assert "ChunkpilotEngineDown" in alerts()


def test_more_replicas_get_peering_objects_and_one_writer_of_the_study():
    objs = docs(render(None, "--set", "operator.replicas=2"))
    (peering,) = [o for o in objs if o["kind"] == "ClusterKopfPeering"]
    assert peering["metadata"]["name"] == "cp-chunkpilot-operator"
    assert "--peering=cp-chunkpilot-operator" in _args(render(None, "--set", "operator.replicas=2"), "operator")
    ns = docs(render(next(v for v in VALUES if v.stem == "namespaced-ha")))
    assert sorted(o["metadata"]["namespace"] for o in ns if o["kind"] == "KopfPeering") == ["team-a", "team-b"]
    assert not [o for o in docs(render()) if "Peering" in o["kind"]]
    err = helm_fails(*REPOSITORY, "--set", "tuner.replicas=2")
    assert "tuner.replicas > 1 needs tuner.study.existingSecret" in err
    (op,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("operator")]
    assert op["spec"]["strategy"] == {"type": "Recreate"}  # an upgrade never runs old and new side by side


def test_replicas_of_one_deployment_draw_different_peering_priorities():
    """kopf pauses every peer when priorities are equal; identical replicas must not all be 0."""
    from chunkpilot.kube.kopf_process import KopfProcess

    drawn = {KopfProcess(prefix="x", peering="p").priority for _ in range(20)}
    assert len(drawn) == 20 and min(drawn) > 0
    assert KopfProcess(prefix="x").priority == 0 and KopfProcess(prefix="x", peering="p", priority=7).priority == 7


def test_namespace_wildcards_are_refused_naming_the_value():
    err = helm_fails(*REPOSITORY, "--set", "operator.watchNamespaces={team-*}")
    assert "operator.watchNamespaces" in err and "team-*" in err and "exact names" in err


def test_the_pods_user_is_a_value_and_can_be_left_to_the_platform():
    def security(*sets: str) -> list[dict]:
        return [o["spec"]["template"]["spec"]["securityContext"] for o in docs(render(None, *sets))
                if o["kind"] == "Deployment"]
    assert all(s["runAsUser"] == 10001 and s["runAsNonRoot"] for s in security())
    openshift = security("--set", "podSecurityContext.runAsUser=null", "--set", "podSecurityContext.fsGroup=null")
    assert all("runAsUser" not in s and "fsGroup" not in s and s["runAsNonRoot"] for s in openshift)
    assert all(s["runAsUser"] == 1000680000 for s in security("--set", "podSecurityContext.runAsUser=1000680000"))


def test_the_chart_can_be_a_subchart():
    res = subprocess.run([helm(), "lint", "--strict", str(CHART), *REPOSITORY, "--set", "global.imageRegistry=x"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_notes_show_a_sample_that_works_with_the_image():
    """NOTES print crds/samples/smollm2-hf.yaml (a model the engine image downloads, not one it would need baked in)
    and no placeholder URL; tests/cluster/test_helm_install.py reads the NOTES of a real install."""
    assert (CHART / "files" / "sample.yaml").read_bytes() == \
        (ROOT / "crds" / "samples" / "smollm2-hf.yaml").read_bytes(), "copy crds/samples/smollm2-hf.yaml"
    sample = yaml.safe_load((ROOT / "crds" / "samples" / "smollm2-hf.yaml").read_text())
    assert sample["spec"]["model"]["source"].startswith("hf://")
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert '.Files.Get "files/sample.yaml"' in notes and "https://..." not in notes


def test_the_operator_network_policy_lets_its_knob_pushes_out():
    """With networkPolicy.enabled the operator's egress reaches every engine pod's admin port, the one the engine's
    own NetworkPolicy (builders) admits the operator to: before, egress named DNS, the API server and 9090, and
    every push timed out into the minute-long ConfigMap path."""
    from chunkpilot.operator import builders

    (policy,) = [o for o in docs(render(None, "--set", "networkPolicy.enabled=true"))
                 if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-operator")]
    rules = [r for r in policy["spec"]["egress"]
             if {"port": builders.ADMIN_PORT, "protocol": "TCP"} in r.get("ports", [])]
    assert len(rules) == 1, policy["spec"]["egress"]
    (peer,) = rules[0]["to"]
    assert peer["namespaceSelector"] == {}  # engines live in the users' namespaces
    assert peer["podSelector"]["matchLabels"].items() <= builders.labels("any").items()  # every engine pod's labels


def test_an_admin_key_secret_of_the_users_keeps_the_key_across_renders():
    """`helm template` (GitOps) cannot read the kept key back: each render made a new one, locking the operator
    out of the running engines' admin ports. With operator.adminKeySecret the chart renders no key and the
    operator reads the named one; without it, the chart's own Secret as before."""
    def key_env(text):
        deploy = next(o for o in docs(text) if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-operator"))
        env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
        return next(e for e in env if e["name"] == "CHUNKPILOT_OPERATOR_ADMIN_TOKEN_KEY")["valueFrom"]["secretKeyRef"]

    def key_secrets(text):
        return [o for o in docs(text) if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-admin-key")]
    own = render(None)
    assert key_env(own) == {"name": "cp-chunkpilot-operator-admin-key", "key": "key"} and len(key_secrets(own)) == 1
    assert key_secrets(render(None))[0]["data"] != key_secrets(own)[0]["data"]  # what GitOps would get each time
    users = [render(None, "--set", "operator.adminKeySecret=ops-admin-key", "--set",
                    "operator.adminKeySecretKey=value") for _ in range(2)]
    assert users[0] == users[1] and key_secrets(users[0]) == []
    assert key_env(users[0]) == {"name": "ops-admin-key", "key": "value"}
