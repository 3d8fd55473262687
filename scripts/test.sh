#!/usr/bin/env bash
# The README's test command: system packages (root: apt), the Python set-up (setup.sh), the Go-built tools, the
# Kubernetes binaries and the cluster's add-ons (CoreDNS, the Prometheus Operator), the Gateway API Inference
# Extension's endpoint picker and CRDs (gateway-tools.sh), the three images for the local
# cluster's pods (root: mmdebstrap), then every test.
# Extra arguments go to pytest. Two workers (pytest-xdist; CHUNKPILOT_TEST_WORKERS=0 for one process): the local
# cluster's modules run on one of them, one after the other (tests/conftest.py's scheduler), and mostly wait on the
# node while the other worker runs the rest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh
bash scripts/go-tools.sh
bash scripts/kube-tools.sh
bash scripts/cluster-tools.sh
bash scripts/gateway-tools.sh
for part in engine operator tuner; do bash scripts/image.sh "$part" >/dev/null; done
exec "${CHUNKPILOT_VENV:-.venv}/bin/python" -m pytest -n "${CHUNKPILOT_TEST_WORKERS:-2}" "$@"
