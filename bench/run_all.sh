#!/usr/bin/env bash
# Run every benchmark (minutes on 2 CPU cores); results land in bench/results/*.json and *.png.
# Extra arguments (e.g. --device cuda --dtype bfloat16) go to each benchmark.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${CHUNKPILOT_VENV:-.venv}/bin/python
for b in chunk_overhead roofline stall vs_transformers tensor_parallel; do
    echo "== $b"
    "$PY" "bench/$b.py" "$@"
done
# The tuner's benchmarks (simulator; the accuracy check also starts a real server). No device arguments.
for b in sim_accuracy predictor_vs_sim tuner_vs_grid; do
    echo "== $b"
    "$PY" "bench/$b.py"
done
echo "== tuner_vs_grid under contention noise"
"$PY" bench/tuner_vs_grid.py --guidance model --contention 1.0 --out tuner_vs_grid_contention
