"""A real one-node Kubernetes cluster on this machine: tests/control_plane.py's etcd, kube-apiserver and
kube-controller-manager, plus kube-scheduler, kube-proxy (iptables mode) and a kubelet running pods through
containerd and runc, networked by the CNI bridge plugin. Nothing is stood in for: pods are scheduled, their images
unpacked, their probes run by the kubelet, their ConfigMap volumes synced by it, their Services routed by
kube-proxy.

Needs root (containerd, runc, iptables, mounts). Binaries: containerd, runc, the CNI plugins and catatonit from
Debian (scripts/system-deps.sh); kube-scheduler, kube-proxy and kubelet v1.34.4 built by scripts/kube-tools.sh;
the engine image built by scripts/engine-image.sh. Humans get the same cluster with `bash scripts/local-cluster.sh`.

Images are imported once into containerd's content store under the cache ($CHUNKPILOT_CACHE/containerd; the image
names carry the hash of what built them), so a test session does not re-import the 6 GB engine image; every
container there is removed when the cluster starts and stops. One local cluster runs at a time on a machine (the
store and containerd's socket are shared).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from chunkpilot.tuner.child_process import free_port, stop_process

from .control_plane import CACHE, KUBE_VERSION, ControlPlane, find_binaries

ROOT = Path(__file__).resolve().parents[1]
NODE = "chunkpilot-node"
POD_CIDR = "10.244.0.0/24"
BRIDGE = "chunkpilot0"
DEBIAN = ("containerd", "ctr", "runc", "catatonit", "iptables")
CNI_DIR = Path("/usr/lib/cni")
HOW = ("run as root: bash scripts/system-deps.sh (Debian containerd, runc, containernetworking-plugins, catatonit, "
       "mmdebstrap), bash scripts/kube-tools.sh (kubelet, kube-scheduler, kube-proxy) and bash scripts/engine-image.sh")


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
    missing = [n for n, p in found.items() if p is None]
    return f"{', '.join(missing)} not found: {HOW}" if missing else found


def engine_image() -> tuple[str, Path] | str:
    """(image name, OCI tarball) of the engine image scripts/engine-image.sh built for the current code, or why not.
    The script is idempotent and quick when nothing changed, so it is run here to pick up code changes."""
    res = subprocess.run(["bash", str(ROOT / "scripts" / "engine-image.sh")], capture_output=True, text=True)
    tarball = Path(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else None
    if res.returncode != 0 or tarball is None or not tarball.is_file():
        return f"scripts/engine-image.sh failed ({HOW}):\n{res.stderr[-3000:]}"
    return (CACHE / "images" / "engine.name").read_text().strip(), tarball


def pause_image(workdir: Path, catatonit: str) -> tuple[str, Path]:
    """The sandbox image, from scripts/pause-image/Dockerfile and Debian's catatonit (one static binary)."""
    digest = hashlib.sha256(Path(catatonit).read_bytes() + (ROOT / "scripts/pause-image/Dockerfile").read_bytes())
    name = f"docker.io/chunkpilot/pause:local-{digest.hexdigest()[:12]}"
    out = workdir / "pause.tar"
    rootfs = workdir / "pause-rootfs"
    rootfs.mkdir()
    shutil.copy(catatonit, rootfs / "pause")
    tool = ["python3", str(ROOT / "scripts" / "oci_image.py")]
    subprocess.run([*tool, "layer", str(rootfs), str(workdir / "pause-layer.tar")], check=True, capture_output=True)
    subprocess.run([*tool, "image", "--dockerfile", str(ROOT / "scripts/pause-image/Dockerfile"), "--name", name,
                    "--out", str(out), str(workdir / "pause-layer.tar")], check=True, capture_output=True)
    return name, out


def primary_ip() -> str:
    """The address the node reports (the one the default route leaves by), else loopback."""
    try:
        out = subprocess.run(["ip", "-4", "-j", "route", "get", "192.0.2.255"], capture_output=True, text=True)
        return json.loads(out.stdout)[0]["prefsrc"]
    except (OSError, ValueError, IndexError, KeyError):
        return "127.0.0.1"


class LocalCluster(ControlPlane):
    """`with LocalCluster(images=[(name, tarball)]) as c:`; `c.kubeconfig` is an admin kubeconfig. The node is Ready
    and the images are in containerd when it returns."""

    def __init__(self, workdir: Path | None = None, binaries: dict[str, str] | None = None,
                 images: list[tuple[str, Path]] = ()) -> None:
        found = binaries or find_node_binaries()
        if isinstance(found, str):
            raise FileNotFoundError(found)
        super().__init__(workdir, found)
        self.images = list(images)
        self.containerd_root = CACHE / "containerd"
        # State and socket at fixed paths, as /run/containerd is: a containerd started after a killed run finds
        # that run's shims (which outlive it) there and reattaches, so remove_containers can stop their containers.
        self.containerd_run = Path("/run/chunkpilot-containerd")
        self.sock = self.containerd_run / "containerd.sock"
        self.node_ip = primary_ip()
        self.pause = ""

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
        wanted = [(self.pause, pause_tar), *self.images]
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

    def _start(self) -> None:
        super()._start()
        self.start_containerd()
        self.start_scheduler()
        self.start_proxy()
        self.start_kubelet()
        self._wait(self.node_ready, "kubelet", 120)

    def stop(self) -> None:
        stop_process(self.procs.pop("kubelet", None), grace=15)
        if "containerd" in self.procs:
            self.remove_containers()
        for name in ("kube-proxy", "kube-scheduler", "containerd"):
            stop_process(self.procs.pop(name, None), grace=15)
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

    def pod_log(self, namespace: str, pod: str, chars: int = 4000) -> str:
        """The container logs the kubelet wrote for a pod (no kubelet client certificate for `kubectl logs`)."""
        out = []
        for f in sorted((self.workdir / "pod-logs").glob(f"{namespace}_{pod}_*/*/*.log")):
            out.append(f"--- {f.parent.name}/{f.name}\n{f.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)


def main() -> None:
    """`bash scripts/local-cluster.sh`: the tests' one-node cluster, with the engine image loaded, until Ctrl-C."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="where certs, etcd data, logs and admin.kubeconfig go")
    args = parser.parse_args()
    image = engine_image()
    if isinstance(image, str):
        raise SystemExit(image)
    with LocalCluster(args.workdir, images=[image]) as c:
        c.serve_until_interrupted(
            f"one-node cluster {KUBE_VERSION}: kube-apiserver at {c.url}, node {NODE} ({c.node_ip})\n"
            f"  export KUBECONFIG={c.kubeconfig}\n  engine image: {image[0]} (imagePullPolicy: IfNotPresent)\n"
            f"  logs in {c.workdir}\nCtrl-C stops it and removes its pods.")


if __name__ == "__main__":
    main()
