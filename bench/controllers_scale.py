"""The operator and the tuner together on the real API server with N InferenceDeployments (issue 37's scale).

tests/control_plane.py (etcd, kube-apiserver with its audit log, kube-controller-manager; no kubelet: pods are not
run, there is no capacity for 200), the chart's ServiceAccounts and RBAC (`helm template`), both controllers as
the processes the chart runs (`chunkpilot operator run`, `chunkpilot tuner run`), each with its own chart account.
For each N (20, then 200, each in fresh namespaces picked by a glob, all resources created before the controllers
start):
  * time from both controllers' start to every resource reconciled by both: `observedGeneration` current (the
    operator) and `status.tuning` written (the tuner);
  * the API requests each controller makes per minute in the steady state after that (the API server's audit log,
    by user, over `--steady` seconds: by default a little more than the operator's 300-s resync, so it is in),
    after `--settle` seconds in which the tuner's backoff reaches its 60-s cap (2 + 4 + ... + 32 s, then 60);
  * each controller's memory: peak RSS and RSS at the end, and its threads (the tuner runs one per resource).
No pods run, so no engine is scraped: every tuner thread holds (MeasurementsUnavailable) and retries with its
backoff, 2 s doubling to 60 s. The steady state measured is that holding loop's, the tuner's cheapest busy state:
a tuned resource whose pods serve reads and writes about as often (one window a minute).

    python bench/controllers_scale.py [--sizes 20 200] [--settle 130] [--steady 330]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import conditions, pyplot, save

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import install_chart_accounts, install_crd, service_account_user  # noqa: E402
from tests.control_plane import ControlPlane, find_binaries  # noqa: E402
from tests.operator.operator_proc import Cluster, operator, sample, tuner  # noqa: E402

NAMESPACES = 4


def reconciled(k: Cluster, namespaces: list[str], n: int) -> tuple[int, int]:
    """(resources the operator has observed at their generation, resources the tuner has written status for)."""
    items = [o for ns in namespaces for o in k.custom.list_namespaced_custom_object(
        "chunkpilot.io", "v1alpha1", ns, "inferencedeployments")["items"]]
    operator_done = sum(1 for o in items if (o.get("status") or {}).get("observedGeneration")
                        == o["metadata"]["generation"])
    tuner_done = sum(1 for o in items if (o.get("status") or {}).get("tuning"))
    return operator_done, tuner_done


def rss_mib(pid: int) -> tuple[float, int]:
    """(resident MiB, threads) of a live process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"])


def requests_per_minute(events: list[dict], seconds: float) -> dict:
    verbs = Counter(e.get("verb") for e in events)
    return {"total": len(events) * 60 / seconds, "by_verb": {v: c * 60 / seconds for v, c in verbs.most_common()}}


def one_size(cp: ControlPlane, accounts: dict, k: Cluster, n: int, settle: float, steady: float,
             work: Path) -> dict:
    tag = f"scale{n}"
    namespaces = [k.namespace(f"{tag}-{j}") for j in range(NAMESPACES)]
    glob = f"{tag}-*"
    try:
        t = time.monotonic()
        for i in range(n):
            k.create(sample(f"s{i:03d}", namespaces[i % NAMESPACES]))
        created_s = time.monotonic() - t
        work.mkdir(parents=True, exist_ok=True)
        with operator(accounts["operator"], work, "--namespace", glob) as op, \
                tuner(accounts["tuner"], work, "--namespace", glob) as tu:
            t0 = time.monotonic()
            first = {"operator": None, "tuner": None}
            while True:
                o, tn = reconciled(k, namespaces, n)
                now = time.monotonic() - t0
                if o == n and first["operator"] is None:
                    first["operator"] = now
                if tn == n and first["tuner"] is None:
                    first["tuner"] = now
                if all(v is not None for v in first.values()):
                    break
                if now > 600 or not (op.alive() and tu.alive()):
                    raise RuntimeError(f"{n}: not reconciled after {now:.0f} s ({o} by the operator, {tn} by the "
                                       f"tuner)\n{op.log()}\n{tu.log()}")
                time.sleep(0.5)
            print(f"{n} resources: the operator reconciled all in {first['operator']:.1f} s, the tuner wrote status "
                  f"for all in {first['tuner']:.1f} s (from start, kopf start-up included)", flush=True)
            start_rss = {"operator": rss_mib(op.proc.pid)[0], "tuner": rss_mib(tu.proc.pid)[0]}
            time.sleep(settle)
            mark = cp.audit_mark()
            t1 = time.monotonic()
            time.sleep(steady)
            seconds = time.monotonic() - t1
            events = cp.audit(since=mark)
            out = {"resources": n, "namespaces": NAMESPACES, "created_s": created_s, "settle_s": settle,
                   "steady_s": seconds}
            for name, proc in (("operator", op), ("tuner", tu)):
                rss, threads = rss_mib(proc.proc.pid)
                mine = [e for e in events if e.get("user", {}).get("username") == service_account_user(name)]
                out[name] = {"all_reconciled_s": first[name], "peak_rss_mib": proc.peak_rss_mib(),
                             "rss_after_reconcile_mib": start_rss[name], "rss_end_mib": rss, "threads": threads,
                             "requests_per_minute": requests_per_minute(mine, seconds)}
                print(f"  {name}: {out[name]['requests_per_minute']['total']:.0f} API requests/min steady, peak RSS "
                      f"{out[name]['peak_rss_mib']:.0f} MiB, {threads} threads", flush=True)
            assert op.stop() == 0 and tu.stop() == 0, (op.log(), tu.log())
        return out
    finally:
        for ns in namespaces:
            k.core.delete_namespace(ns)
        for ns in namespaces:
            k.delete_namespace(ns, timeout=180)


def figure(sizes: list[dict]):
    plt = pyplot()
    if not hasattr(plt, "subplots"):
        return plt
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    ns = [s["resources"] for s in sizes]
    for name, marker in (("operator", "o"), ("tuner", "s")):
        axes[0].plot(ns, [s[name]["all_reconciled_s"] for s in sizes], marker=marker, label=name)
        axes[1].plot(ns, [s[name]["requests_per_minute"]["total"] for s in sizes], marker=marker, label=name)
        axes[2].plot(ns, [s[name]["peak_rss_mib"] for s in sizes], marker=marker, label=name)
    for ax, title in zip(axes, ("all reconciled (s, from start)", "API requests/min, steady", "peak RSS (MiB)")):
        ax.set_title(title)
        ax.set_xlabel("InferenceDeployments")
        ax.legend()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 200])
    ap.add_argument("--settle", type=float, default=130.0,
                    help="seconds after all are reconciled before the steady state is measured")
    ap.add_argument("--steady", type=float, default=330.0,
                    help="seconds of steady state measured (default: past one 300-s operator resync)")
    args = ap.parse_args()
    found = find_binaries()
    if isinstance(found, str):
        sys.exit(found)
    with tempfile.TemporaryDirectory(prefix="chunkpilot-scale-") as tmp, ControlPlane(Path(tmp) / "kube", found) as cp:
        install_crd(cp)
        accounts = install_chart_accounts(cp, Path(tmp))
        k = Cluster(cp.api(pool=16))
        sizes = [one_size(cp, accounts, k, n, args.settle, args.steady, Path(tmp) / f"n{n}") for n in args.sizes]
    growth = None
    if len(sizes) >= 2:
        a, b = sizes[0], sizes[-1]
        growth = {name: {"resources": b["resources"] / a["resources"],
                         "requests_per_minute": b[name]["requests_per_minute"]["total"]
                         / max(a[name]["requests_per_minute"]["total"], 1e-9),
                         "peak_rss": b[name]["peak_rss_mib"] / a[name]["peak_rss_mib"]}
                  for name in ("operator", "tuner")}
    save("controllers_scale", {"conditions": conditions(), "sizes": sizes, "growth": growth}, figure(sizes))


if __name__ == "__main__":
    main()
