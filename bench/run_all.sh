#!/usr/bin/env bash
# Run every benchmark docs/results.md shows (about 2.5 hours on 2 CPU cores: the demo runs alone take 35 minutes and
# want the machine to themselves, so they go last), then regenerate docs/results.md from bench/results/*.json.
# Extra arguments (e.g. --device cuda --dtype bfloat16) go to each engine benchmark.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${CHUNKPILOT_VENV:-.venv}/bin/python
for b in chunk_overhead roofline stall vs_transformers tensor_parallel; do
    echo "== $b"
    "$PY" "bench/$b.py" "$@"
done
# The tuner's benchmarks (simulator; the accuracy check also starts a real server). No device arguments.
for b in sim_accuracy predictor_vs_sim autoscale; do
    echo "== $b"
    "$PY" "bench/$b.py"
done
echo "== tuner_vs_grid (model-guided and black-box)"
"$PY" bench/tuner_vs_grid.py --seeds 30
echo "== tuner_vs_grid, model-guided"
"$PY" bench/tuner_vs_grid.py --guidance model --out tuner_vs_grid_model
echo "== tuner_vs_grid under contention noise"
"$PY" bench/tuner_vs_grid.py --guidance model --contention 1.0 --out tuner_vs_grid_contention
echo "== local_cluster (a real kubelet: needs root; three fresh clusters)"
"$PY" bench/local_cluster.py --runs 3
echo "== helm_install (helm install into a real kubelet: needs root; three fresh clusters)"
"$PY" bench/local_cluster.py --suite helm --runs 3
echo "== controllers_scale (the operator and the tuner on a real API server with 20 and 200 resources; ~17 min)"
"$PY" bench/controllers_scale.py
echo "== quantization (float32, int8, int4 side by side; llama.cpp where llama-cpp-python is installed)"
"$PY" bench/quantization.py
echo "== moving a prompt's KV blocks (NIXL read, checksums, local copy)"
"$PY" bench/kv_transfer.py
echo "== what a pull costs the decode steps beside it (one core, as a CPU decode pod has; before, XXH3, paced)"
"$PY" bench/pull_contention.py --seqs 2 --shares 0.25,0.1
echo "== routing through Envoy and the endpoint picker against the Service (a real kubelet: needs root; ~20 min)"
"$PY" bench/routing.py
echo "== per-request SLO classes against FCFS at its best knobs in hindsight (real engines; ~35 min)"
"$PY" bench/slo_classes.py
"$PY" bench/slo_classes.py --predict-only
echo "== prefill/decode disaggregation against the best colocated knobs (goodput, SLOs from this machine's speed)"
"$PY" bench/disaggregation.py --itl-x 3
echo "== the best arms of prefill-heavy traffic again, on a ladder that starts lower (the colocated pairs held no rung above)"
"$PY" bench/disaggregation.py --itl-x 3 --traces prefill_heavy --rates 0.05,0.1,0.15,0.2,0.3 --arms colocated-256,colocated-512,split-0-with-kv --out disaggregation_ladder
echo "== the same predicted by the simulator (seconds; from the run above's lone-request figures and SLOs)"
"$PY" bench/disaggregation.py --predict-only
echo "== speculative decoding (n-gram drafts on and off, batch 1 and 8, outputs that repeat the prompt and ones that do not)"
"$PY" bench/speculative.py
echo "== demo_runs (three demos in a row)"
"$PY" bench/demo_runs.py --runs 3
echo "== demo_runs with a busy minute during each first check (issue 41's recipe)"
"$PY" bench/demo_runs.py --runs 3 --busy 60
"$PY" bench/results_page.py
