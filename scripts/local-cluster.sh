#!/usr/bin/env bash
# A one-node Kubernetes cluster on this machine, for humans (the local-cluster tests start the same one): etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy and a kubelet on containerd, with the engine
# image (scripts/engine-image.sh) loaded, until Ctrl-C. Prints the admin kubeconfig to export. Needs root and
# scripts/system-deps.sh, scripts/setup.sh and scripts/kube-tools.sh to have run once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${CHUNKPILOT_VENV:-.venv}/bin/python" -m tests.local_cluster "$@"
