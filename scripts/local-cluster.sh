#!/usr/bin/env bash
# A one-node Kubernetes cluster on this machine, for humans (the local-cluster tests start the same one): etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, a kubelet on containerd and CoreDNS, with the
# engine image (scripts/image.sh engine) loaded, until Ctrl-C; `--chart` also loads the operator and tuner images
# and runs the Prometheus Operator, for `helm install` (docs/helm.md). Prints the admin kubeconfig to export. Needs
# root and scripts/system-deps.sh, setup.sh, kube-tools.sh and cluster-tools.sh to have run once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${CHUNKPILOT_VENV:-.venv}/bin/python" -m tests.local_cluster "$@"
