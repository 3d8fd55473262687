#!/usr/bin/env bash
# The README's test command: set up (see setup.sh), then run every test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${CHUNKPILOT_VENV:-.venv}/bin/python" -m pytest "$@"
