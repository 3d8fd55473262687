#!/usr/bin/env bash
# The one prepared GPU run: the token budget's bound beside a draft model and the `gpu` tests, then every benchmark
# on CUDA in bfloat16 with GPU-sized settings, on a random-weight model at Llama-3-8B's size made on the machine
# (bench/make_model.py; nothing is downloaded).
# Runs with the repository's .venv when there is one, else with the machine's python3: the device machine has
# torch, transformers, safetensors and tokenizers and can install nothing, so the parts import from their folders
# and what is missing there (pytest, matplotlib) is skipped with a line saying so.
# Output goes to $OUT (the device tool's folder; bench/results when unset): gpu_check.log and gpu_results.tgz, the
# figures to unpack into bench/results/gpu.
# Try it on a CPU: GPU_CHECK_DEVICE=cpu GPU_CHECK_DTYPE=float32 GPU_CHECK_MODEL=tiny bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -x "${CHUNKPILOT_VENV:-.venv}/bin/python" ]; then
    PY=${CHUNKPILOT_VENV:-.venv}/bin/python
else
    PY=python3
    export PYTHONPATH="$PWD/contract:$PWD/engine_image:$PWD/cli:$PWD/loadgen:$PWD/tuner:$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
OUT=${OUT:-bench/results}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
DTYPE=${GPU_CHECK_DTYPE:-bfloat16}
SIZE=${GPU_CHECK_MODEL:-llama3-8b}
export PYTHONUNBUFFERED=1
# figures go under bench/results/gpu (the results page shows them in their own section); the device tool returns
# at most 8 files, so everything lands in one log and one archive, re-packed after each step so a run cut short by
# its time limit still brings back what it finished
export CHUNKPILOT_BENCH_RESULTS=${CHUNKPILOT_BENCH_RESULTS:-$PWD/bench/results/gpu}
mkdir -p "$OUT" "$CHUNKPILOT_BENCH_RESULTS"
LOG="$OUT/gpu_check.log"
pack() { tar czf "$OUT/gpu_results.tgz" -C "$CHUNKPILOT_BENCH_RESULTS" . ; }
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1 | tee "$LOG"
export CHUNKPILOT_BENCH_MODEL=${CHUNKPILOT_BENCH_MODEL:-${TMPDIR:-/tmp}/chunkpilot-bench-$SIZE-$DTYPE}
"$PY" bench/make_model.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" --out "$CHUNKPILOT_BENCH_MODEL" \
    2>&1 | tee -a "$LOG"
# A draft model on the GPU: the token budget's bound is read once the draft's weights and KV pool are loaded, so it
# is below the bound without a draft, and a budget pushed up to it runs a full step without running out of memory
# (a draft at SmolLM2's size, llama-125m, for the 8B model; each engine in a process of its own, so the first one's
# memory is surely gone). GPU_CHECK_ONLY=draft_fit runs only this step; another GPU_CHECK_ONLY name skips it.
DRAFT_FIT_PY=$(cat <<'EOF'
import sys

import torch

from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.engine import EngineConfig, SamplingParams
from chunkpilot.engine.llm_engine import LLMEngine

model, dtype, draft = sys.argv[1:4]
spec = {"model": draft, "num_speculative_tokens": 3} if draft != "-" else None
engine = LLMEngine(EngineConfig(model=model, device="cuda", dtype=dtype, speculative_config=spec))
bound = engine.max_token_budget
free = torch.cuda.mem_get_info()[0]
print(f"draft_fit: {'with' if spec else 'without'} a draft, the token budget's bound is {bound} (activations fit: "
      f"{engine.worker.activation_fit}; {free / 2**30:.1f} GiB free)", file=sys.stderr)
if spec is None:
    print(bound)
    sys.exit(0)
engine.knobs.set(SchedulerKnobs(bound, bound, 1))  # what an admin push up to the bound installs
room = engine.max_model_len - 16  # room for the decodes and their drafts
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
for i in range(-(-bound // room)):  # prompts enough to fill one step of `bound` tokens
    ids = torch.randint(1, 300, (min(room, bound - i * room),)).tolist()
    engine.submit(engine.make_sequence(f"fill-{i}", ids, params))
torch.cuda.reset_peak_memory_stats()
steps = []
try:
    while engine.has_unfinished():
        engine.step()
        steps.append(engine.last_step)
except torch.cuda.OutOfMemoryError as e:
    print(f"draft_fit: FAIL: a step at the bound {bound} ran out of memory: {e}")
    sys.exit(1)
full = max(s.num_tokens for s in steps)
peak = torch.cuda.max_memory_allocated() / 2**30
total = torch.cuda.get_device_properties(0).total_memory / 2**30
drafts = sum(s.num_drafts for s in steps)
print(f"draft_fit: {len(steps)} steps, the largest {full} tokens, {drafts} with drafts; peak allocated {peak:.1f} "
      f"of {total:.1f} GiB")
if full != bound or drafts == 0:
    print(f"draft_fit: FAIL: no step of {bound} tokens, or none drafted: the check did not run what it checks")
    sys.exit(1)
EOF
)
if [ "$DEVICE" = cuda ] && { [ -z "${GPU_CHECK_ONLY:-}" ] || [ "$GPU_CHECK_ONLY" = draft_fit ]; }; then
    DRAFT_MODEL=${TMPDIR:-/tmp}/chunkpilot-bench-llama-125m-$DTYPE
    "$PY" bench/make_model.py --size llama-125m --device "$DEVICE" --dtype "$DTYPE" --out "$DRAFT_MODEL" \
        2>&1 | tee -a "$LOG"
    NO_DRAFT=$("$PY" -c "$DRAFT_FIT_PY" "$CHUNKPILOT_BENCH_MODEL" "$DTYPE" - 2>>"$LOG" \
        | grep -x "[0-9][0-9]*" | tail -1)
    "$PY" -c "$DRAFT_FIT_PY" "$CHUNKPILOT_BENCH_MODEL" "$DTYPE" "$DRAFT_MODEL" 2>&1 | tee -a "$LOG" \
        | tee "$CHUNKPILOT_BENCH_RESULTS/draft_fit.log"
    WITH_DRAFT=$(sed -n 's/.*with a draft, the token budget.s bound is \([0-9]*\).*/\1/p' \
        "$CHUNKPILOT_BENCH_RESULTS/draft_fit.log")
    if [ -n "$NO_DRAFT" ] && [ -n "$WITH_DRAFT" ] && [ "$WITH_DRAFT" -lt "$NO_DRAFT" ]; then
        echo "draft_fit: the bound with a draft ($WITH_DRAFT) is below the one without ($NO_DRAFT)" | tee -a "$LOG"
    else
        echo "draft_fit: FAIL: the bound with a draft (${WITH_DRAFT:-none}) is not below the one without" \
            "(${NO_DRAFT:-none})" | tee -a "$LOG"
    fi | tee -a "$CHUNKPILOT_BENCH_RESULTS/draft_fit.log"
    pack
fi
[ "${GPU_CHECK_ONLY:-}" = draft_fit ] && exit 0
# only the files that hold gpu tests: collecting the others needs packages the device's python may not have
GPU_TESTS=$(grep -rl --include='test_*.py' "pytest.mark.gpu" tests)
if "$PY" -c "import pytest" 2>/dev/null; then
    "$PY" -m pytest -m gpu -q -p no:cacheprovider $GPU_TESTS 2>&1 | tee -a "$LOG" | tee "$CHUNKPILOT_BENCH_RESULTS/gpu_tests.log"
else
    echo "pytest is not installed for $PY: the gpu tests did not run" | tee -a "$LOG"
fi
pack
# prefill/decode disaggregation (issue 53): NIXL reads between two device pools, against a local copy and the
# checksums (the gpu test above checks the bytes); GPU_CHECK_ONLY=disaggregation runs the gpu tests and this only
if [ -z "${GPU_CHECK_ONLY:-}" ] || [ "$GPU_CHECK_ONLY" = disaggregation ]; then
    "$PY" bench/kv_transfer.py --device "$DEVICE" --dtype "$DTYPE" --tokens 1024,4096,16384 2>&1 | tee -a "$LOG"
    pack
fi
[ "${GPU_CHECK_ONLY:-}" = disaggregation ] && exit 0
# weight-only fp8 against bfloat16 on the same model (issue 39): decode ms/token, prefill, batch 16, weights, the
# perplexity ratio (on random weights, what fp8's rounding moves, not a language model's quality)
if [ "$DEVICE" = cuda ]; then
    "$PY" bench/quantization.py --device cuda --methods fp8 --model "$CHUNKPILOT_BENCH_MODEL" 2>&1 | tee -a "$LOG"
    pack
fi
# GPU_CHECK_ONLY=quantization stops here (a session whose device time is short, with a GPU for that issue)
[ "${GPU_CHECK_ONLY:-}" = quantization ] && exit 0
for b in "chunk_overhead --tokens 8192 --chunk 512" "roofline --prefill-tokens 4096" \
         "stall --chat 32 --long 8 --long-tokens 4096 --budget 256,512" "vs_transformers --batch-sizes 8,16,32,64"; do
    "$PY" bench/${b%% *}.py ${b#* } --device "$DEVICE" --dtype "$DTYPE" 2>&1 | tee -a "$LOG"
    pack
done
# where a decode step's time goes (torch.profiler), at batch 1 and 32: the first GPU run found cuDNN attention
# taking most of it
for batch in 1 32; do
    "$PY" bench/gpu_profile.py --steps 8 --batch $batch --device "$DEVICE" --dtype "$DTYPE" \
        > "$CHUNKPILOT_BENCH_RESULTS/profile_batch$batch.txt" 2>&1
    head -2 "$CHUNKPILOT_BENCH_RESULTS/profile_batch$batch.txt" | tee -a "$LOG"
done
pack
