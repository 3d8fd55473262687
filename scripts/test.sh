#!/usr/bin/env bash
# The README's test command: system packages (root: apt), the Python set-up (setup.sh), then every test.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh
bash scripts/go-tools.sh
bash scripts/kube-tools.sh
exec "${CHUNKPILOT_VENV:-.venv}/bin/python" -m pytest "$@"
