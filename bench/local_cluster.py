"""A cluster admin's first-day timings on a real node (tests/local_cluster.py: kubelet, containerd, kube-proxy).

Two suites, each the local-cluster tests that time themselves, run `--runs` times in a fresh cluster each:
  pods  (tests/cluster/test_real_pods.py -> bench/results/local_cluster.json): apply -> pod scheduled -> Ready ->
        first streamed token through the Service; a knob change in the ConfigMap -> the engine applying it (the
        kubelet's volume sync, at its default settings); delete -> pod gone;
  helm  (tests/cluster/test_helm_install.py -> bench/results/helm_install.json): `helm install --wait` -> operator
        and tuner Ready; -> the first token of the first InferenceDeployment; -> the first knobs the tuner pod chose
        applied by the engine (apply, scrape through the ServiceMonitor, a trial, the kubelet's volume sync).
Needs root and what those tests need (scripts/system-deps.sh, kube-tools.sh, cluster-tools.sh, image.sh).

    python bench/local_cluster.py --runs 3
    python bench/local_cluster.py --suite helm --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import conditions, save

ROOT = Path(__file__).resolve().parents[1]
SUITES = {  # name: (results name, test file, the env var it writes its timings to, phases, title)
    "pods": ("local_cluster", "tests/cluster/test_real_pods.py", "CHUNKPILOT_CLUSTER_TIMINGS",
             {"apply_to_scheduled_s": "apply → scheduled", "apply_to_ready_s": "apply → Ready",
              "apply_to_first_token_s": "apply → first token", "status_to_configmap_s": "tuner write → ConfigMap",
              "write_to_engine_s": "tuner write → engine applied", "write_to_ack_s": "tuner write → acknowledged",
              "delete_to_pod_deletion_s": "delete → pod deleted (garbage collector)",
              "delete_to_pod_gone_s": "delete → pod gone",
              "container_kill_to_current_knobs_s": "container killed → current knobs",
              "configmap_invalid_json_to_put_back_s": "ConfigMap invalid JSON → put back",
              "configmap_out_of_bounds_to_put_back_s": "ConfigMap out of bounds → put back",
              "configmap_undecided_to_put_back_s": "ConfigMap undecided knobs → put back",
              "broken_model_to_status_s": "truncated model → error in status",
              "unreadable_model_to_status_s": "unreadable model folder → error in status",
              "operator_kill_to_reconciled_s": "operator killed → reconciling",
              "tuner_kill_to_status_s": "tuner killed → status written",
              "prometheus_back_to_tuning_s": "Prometheus back → Tuning True",
              "apiserver_outage_s": "API server and etcd out (30 s + restart)",
              "apiserver_back_to_both_controllers_s": "API server back → both controllers"},
             "One node, real kubelet: first-day timings"),
    "helm": ("helm_install", "tests/cluster/test_helm_install.py", "CHUNKPILOT_HELM_TIMINGS",
             {"install_to_ready_s": "helm install → operator, tuner Ready",
              "apply_to_first_token_s": "apply → first token",
              "install_to_first_token_s": "helm install → first token",
              "install_to_tuned_knobs_s": "helm install → tuned knobs applied"},
             "helm install on a real node"),
}


def one_run(i: int, test: str, env_var: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timings.json"
        env = dict(os.environ, **{env_var: str(out)})
        res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", test],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        print(res.stdout[-1500:], flush=True)
        timings = json.loads(out.read_text()) if out.exists() else {}
    return {"run": i, "passed": res.returncode == 0, **timings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--suite", choices=sorted(SUITES), default="pods")
    args = parser.parse_args()
    name, test, env_var, phases, title = SUITES[args.suite]
    runs = [one_run(i + 1, test, env_var) for i in range(args.runs)]
    medians = {k: statistics.median(r[k] for r in runs if k in r) for k in phases if any(k in r for r in runs)}
    result = {"conditions": conditions(
        kubelet="v1.34.4 defaults (syncFrequency 1m, ConfigMap change detection Watch)",
        runtime="containerd 1.6 + runc 1.1 (Debian bookworm), CNI bridge, kube-proxy iptables",
        model="SmolLM2-135M-Instruct from a hostPath, CPU, one replica",
        **({"chart": "helm/chunkpilot with the locally built images, Prometheus Operator v0.85.0, CoreDNS, local "
                     "volumes"} if args.suite == "helm" else {})), "runs": runs, "medians": medians}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    keys = [k for k in phases if k in medians]
    for j, r in enumerate(runs):
        ax.scatter([r.get(k, float("nan")) for k in keys], range(len(keys)), label=f"run {r['run']}",
                   marker="o" if r["passed"] else "x")
    ax.set_yticks(range(len(keys)), [phases[k] for k in keys])
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.legend(fontsize=8)
    save(name, result, fig)
    for k in keys:
        print(f"{phases[k]:>28}: median {medians[k]:.1f} s ({', '.join(f'{r[k]:.1f}' for r in runs if k in r)})")
    if not all(r["passed"] for r in runs):
        raise SystemExit("a run failed: see its output above")


if __name__ == "__main__":
    main()
