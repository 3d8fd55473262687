#!/usr/bin/env bash
# The README's test command: system packages (root: apt), the Python set-up (setup.sh), the Go-built tools and
# Kubernetes binaries, the engine image for the local cluster's pods (root: mmdebstrap), then every test.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh
bash scripts/go-tools.sh
bash scripts/kube-tools.sh
bash scripts/engine-image.sh >/dev/null
exec "${CHUNKPILOT_VENV:-.venv}/bin/python" -m pytest "$@"
