#!/usr/bin/env bash
# The tests' Kubernetes control plane for humans: etcd, kube-apiserver and kube-controller-manager on loopback
# (no scheduler, no kubelet), until Ctrl-C. Prints the admin kubeconfig to export. Needs scripts/setup.sh,
# scripts/system-deps.sh (etcd) and scripts/kube-tools.sh (the binaries) to have run once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${CHUNKPILOT_VENV:-.venv}/bin/python" -m tests.control_plane "$@"
