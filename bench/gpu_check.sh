#!/usr/bin/env bash
# The one prepared GPU run: the `gpu` tests, then every benchmark on CUDA in bfloat16 with GPU-sized settings.
# Output goes to $OUT (the device tool's folder) or bench/results.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${CHUNKPILOT_VENV:-.venv}/bin/python
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
"$PY" -m pytest -m gpu -q tests 2>&1 | tee "$OUT/gpu_tests.log"
for b in "chunk_overhead --tokens 8192 --chunk 512" "roofline --prefill-tokens 4096" \
         "stall --chat 32 --long 8 --long-tokens 4096 --budget 256,512" "vs_transformers --batch-sizes 8,16,32,64"; do
    "$PY" bench/${b%% *}.py ${b#* } --device cuda --dtype bfloat16 2>&1 | tee -a "$OUT/bench.log"
done
cp bench/results/*.json "$OUT"/ 2>/dev/null || true
