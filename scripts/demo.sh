#!/usr/bin/env bash
# The README's first command: set up (venv, packages, the model; Prometheus via apt when root), then run the demo.
# Extra arguments go to `chunkpilot demo` (e.g. --duration 120).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh
exec "${CHUNKPILOT_VENV:-.venv}/bin/chunkpilot" demo "$@"
