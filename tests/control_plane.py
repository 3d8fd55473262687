"""A real Kubernetes control plane on loopback: etcd, kube-apiserver and kube-controller-manager.

The operator and tuner tests run against this, not an emulator: a real API server is what refuses a float
`timeoutSeconds`, runs the CRD's schema defaults and CEL rules, prunes unknown fields, owns fields for server-side
apply, expires watches, and (with the controller manager) creates ReplicaSets and Pods, garbage-collects owned
objects and deletes namespaces. What is missing is a scheduler and a kubelet: Pods stay Pending, and a test that
needs ready pods writes pod status itself (and says so).

Binaries: etcd from Debian's `etcd-server`; kube-apiserver and kube-controller-manager built once by
`scripts/kube-tools.sh` into the cache. Humans get the same cluster with `bash scripts/local-apiserver.sh`.

Every request is written to an audit log (metadata level), so tests can see which identity used which verb on
which resource: the chart's RBAC is checked against what the processes really do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from chunkpilot.lab.child_process import die_with_parent, free_port, log_tail, stop_process

KUBE_VERSION = os.environ.get("CHUNKPILOT_KUBE_VERSION", "v1.34.4")
CACHE = Path(os.environ.get("CHUNKPILOT_CACHE", Path.home() / ".cache" / "chunkpilot"))
HOW = ("bash scripts/system-deps.sh (Debian etcd-server) and bash scripts/kube-tools.sh (builds kube-apiserver "
       "and kube-controller-manager into ~/.cache/chunkpilot/kube)")
ADMIN_TOKEN = "chunkpilot-test-admin"
# The node's components, each as the identity a kubeadm cluster gives it (the bootstrap RBAC binds these users;
# the Node authorizer scopes the kubelet to its own node and pods). tests/local_cluster.py uses them.
COMPONENT_TOKENS = {"kube-scheduler": ("system:kube-scheduler", ""), "kube-proxy": ("system:kube-proxy", ""),
                    "kubelet": ("system:node:chunkpilot-node", "system:nodes")}
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata"}]}


def find_binaries() -> dict[str, str] | str:
    """The binaries' paths, or a sentence saying what is missing and how to get it."""
    found = {"etcd": shutil.which("etcd"), "openssl": shutil.which("openssl")}
    for name in ("kube-apiserver", "kube-controller-manager"):
        path = CACHE / "kube" / KUBE_VERSION / name
        found[name] = str(path) if path.is_file() and os.access(path, os.X_OK) else None
    missing = [n for n, p in found.items() if p is None]
    how = HOW + (" and apt-get install openssl" if "openssl" in missing else "")
    return f"{', '.join(missing)} not found: run {how}" if missing else found


class ControlPlane:
    """Start with `with ControlPlane() as cp:`; `cp.kubeconfig` is an admin kubeconfig (TLS verified)."""

    def __init__(self, workdir: Path | None = None, binaries: dict[str, str] | None = None) -> None:
        found = binaries or find_binaries()
        if isinstance(found, str):
            raise FileNotFoundError(found)
        self.bin = found
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="chunkpilot-kube-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.etcd_port, self.etcd_peer_port, self.port = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.audit_log = self.workdir / "audit.log"

    # -- processes -----------------------------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        # own process group: a Ctrl-C in the terminal reaches the script, which stops them in order
        with open(self.workdir / f"{name}.log", "a") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=die_with_parent, env=env)
        self.procs[name] = proc
        return proc

    def log(self, name: str, chars: int = 3000) -> str:
        return log_tail(self.workdir / f"{name}.log", chars)

    def _prepare(self) -> None:
        w = self.workdir
        if not (w / "sa.key").exists():
            subprocess.run([self.bin["openssl"], "genrsa", "-out", str(w / "sa.key"), "2048"], check=True, capture_output=True)
        (w / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n' + "".join(
            f'chunkpilot-test-{c},{user},{c}-uid' + (f',"{groups}"' if groups else "") + "\n"
            for c, (user, groups) in COMPONENT_TOKENS.items()))
        (w / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))

    def start_etcd(self) -> None:
        e = f"http://127.0.0.1:{self.etcd_port}"
        p = f"http://127.0.0.1:{self.etcd_peer_port}"
        self._spawn("etcd", [self.bin["etcd"], "--data-dir", str(self.workdir / "etcd"), "--listen-client-urls", e,
                             "--advertise-client-urls", e, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                             "--initial-cluster", f"default={p}", "--log-level", "warn"])
        self._wait(lambda: urllib.request.urlopen(f"{e}/health", timeout=2).status == 200, "etcd", 30)

    def apiserver_address_args(self) -> list[str]:
        """Where the API server listens and what it advertises: loopback only, no endpoints for the `kubernetes`
        Service (no pod runs here); the local cluster's pods reach it through that Service instead."""
        return ["--bind-address=127.0.0.1", "--endpoint-reconciler-type=none"]

    def start_apiserver(self) -> None:
        w = self.workdir
        self._spawn("kube-apiserver", [
            self.bin["kube-apiserver"], f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            *self.apiserver_address_args(), f"--secure-port={self.port}",
            f"--cert-dir={w / 'certs'}", "--service-cluster-ip-range=10.96.0.0/16",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={w / 'sa.key'}", f"--service-account-signing-key-file={w / 'sa.key'}",
            f"--token-auth-file={w / 'tokens.csv'}", "--authorization-mode=Node,RBAC",
            f"--audit-policy-file={w / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json", "--audit-log-mode=blocking", "--profiling=false"])
        self._wait(self._readyz, "kube-apiserver", 90)
        self._write_kubeconfig(self.kubeconfig, "admin", ADMIN_TOKEN)

    def start_controller_manager(self) -> None:
        w = self.workdir
        self._spawn("kube-controller-manager", [
            self.bin["kube-controller-manager"], f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}", f"--authorization-kubeconfig={self.kubeconfig}",
            "--controllers=*", "--leader-elect=false", f"--service-account-private-key-file={w / 'sa.key'}",
            f"--root-ca-file={self.ca_file}", "--use-service-account-credentials=false",
            f"--secure-port={free_port()}", "--bind-address=127.0.0.1", "--profiling=false"])

    def _readyz(self) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the CA is only known once it answers
        req = urllib.request.Request(f"{self.url}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        return urllib.request.urlopen(req, timeout=2, context=ctx).status == 200

    def _wait(self, check, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")
            try:
                if check():
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{name} not ready after {timeout:.0f}s:\n{self.log(name)}")

    @property
    def ca_file(self) -> Path:
        # The apiserver's self-generated serving cert covers 127.0.0.1 and the file also holds its CA.
        return self.workdir / "certs" / "apiserver.crt"

    def start(self) -> ControlPlane:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self._prepare()
        self.start_etcd()
        self.start_apiserver()
        self.start_controller_manager()
        # The controller manager is up when it made the default ServiceAccount (Pods need one to be admitted).
        import kubernetes

        core = kubernetes.client.CoreV1Api(self.api())

        def default_account() -> bool:
            return bool(core.list_namespaced_service_account("default").items)
        self._wait(default_account, "kube-controller-manager", 90)

    def stop(self) -> None:
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            stop_process(self.procs.pop(name, None), grace=15)

    def component_kubeconfig(self, component: str) -> Path:
        """A kubeconfig for one of COMPONENT_TOKENS' components, acting as its own user."""
        user = COMPONENT_TOKENS[component][0]
        return self._write_kubeconfig(self.workdir / f"{component}.kubeconfig", user, f"chunkpilot-test-{component}")

    def serve_until_interrupted(self, banner: str) -> None:
        """For the scripts humans run: print `banner`, then wait for Ctrl-C or for one of the processes to exit."""
        print(banner, flush=True)
        try:
            while all(p.poll() is None for p in self.procs.values()):
                time.sleep(1)
            print("a cluster process exited; see its log", flush=True)
        except KeyboardInterrupt:
            pass

    def kill_apiserver(self) -> None:
        """SIGKILL, no clean shutdown: what a crashed control-plane node looks like to clients."""
        stop_process(self.procs.pop("kube-apiserver", None), grace=5, sig=signal.SIGKILL)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- clients ------------------------------------------------------------------------------------------------

    def _write_kubeconfig(self, path: Path, user: str, token: str, namespace: str = "default") -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": user,
            "clusters": [{"name": "local", "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "local", "user": user, "namespace": namespace}}]}))
        return path

    def api(self, kubeconfig: Path | None = None, pool: int = 8):
        import kubernetes

        conf = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(str(kubeconfig or self.kubeconfig), client_configuration=conf)
        conf.connection_pool_maxsize = pool
        return kubernetes.client.ApiClient(conf)

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path | None = None) -> Path:
        """A kubeconfig that acts as the ServiceAccount, with a token from the TokenRequest API (as a pod's
        projected token would be)."""
        import kubernetes

        core = kubernetes.client.CoreV1Api(self.api())
        token = core.create_namespaced_service_account_token(
            name, namespace, {"spec": {"expirationSeconds": 24 * 3600}}).status.token
        return self._write_kubeconfig(path or self.workdir / f"{namespace}-{name}.kubeconfig",
                                      f"system:serviceaccount:{namespace}:{name}", token, namespace)

    def audit_mark(self) -> int:
        """A position in the audit log, for `audit(since=...)`: what happened after it."""
        return self.audit_log.stat().st_size if self.audit_log.exists() else 0

    def audit(self, user: str | None = None, since: int = 0) -> list[dict]:
        """Audit events (one per finished request) after `since`, optionally only those of one user. The log is
        written before each response is sent (blocking mode), so a request a client saw answered is in it."""
        out = []
        if not self.audit_log.exists():
            return out
        with open(self.audit_log, "rb") as f:
            f.seek(since)
            for line in f.read().splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue  # the line being written
                if user is None or ev.get("user", {}).get("username") == user:
                    out.append(ev)
        return out

    @staticmethod
    def writes(events: list[dict], resource: str, name: str | None = None) -> list[dict]:
        """The writes among audit events, to one resource (e.g. "configmaps"), optionally one object."""
        return [e for e in events if e.get("verb") in ("create", "update", "patch", "delete")
                and (e.get("objectRef") or {}).get("resource") == resource
                and not (e.get("objectRef") or {}).get("subresource")
                and (name is None or (e.get("objectRef") or {}).get("name") == name)]

def main() -> None:
    """`bash scripts/local-apiserver.sh`: the same control plane as the tests, until Ctrl-C."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="where certs, etcd data, logs and admin.kubeconfig go")
    args = parser.parse_args()
    with ControlPlane(args.workdir) as cp:
        cp.serve_until_interrupted(f"kube-apiserver {KUBE_VERSION} at {cp.url}\n  export KUBECONFIG={cp.kubeconfig}\n"
                                   f"  logs and audit log in {cp.workdir}\nCtrl-C stops it.")


if __name__ == "__main__":
    main()
