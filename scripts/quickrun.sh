#!/usr/bin/env bash
# Quick run until the demo exists: set up, then generate with the engine on SmolLM2 (CPU unless a GPU is there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV=${CHUNKPILOT_VENV:-.venv}
MODEL=$("$VENV/bin/chunkpilot" model fetch smollm2)
exec "$VENV/bin/chunkpilot" engine generate --model "$MODEL" --chat --max-tokens 64 "${@:-What is chunked prefill in LLM serving?}"
