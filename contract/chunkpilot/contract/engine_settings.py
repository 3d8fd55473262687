"""The engine settings more than one part declares, one value each: the engine's EngineConfig, the CLI's options,
the CRD's defaults and the tuner's default search bounds all read them here (they used to disagree: maxNumSeqs
was 32 on the command line and 64 in the CRD)."""

# Start-up knobs: vLLM's chunked-prefill default budget, with chunks as large as the budget.
TOKEN_BUDGET = 512
MAX_CHUNK = 512
# Sequences running at once in one engine; every running sequence needs one token of the budget per step, so no
# token budget (start-up, knobs file or tuning bound) may be below it.
MAX_NUM_SEQS = 32
# The tuner's default search bounds (MIN, MAX): the budget from twice the default MAX_NUM_SEQS, the chunk from one
# KV block pair; 8192 is as far as a step on one GPU usefully goes for prefill.
TUNING_BUDGET_BOUNDS = (64, 8192)
TUNING_CHUNK_BOUNDS = (32, 8192)
# Weight-only quantization methods (chunkpilot.engine.quantization): the engine's --quantization, the CRD's
# model.quantization (with "none") and the demo's flag. int8 and int4 run on the CPU, fp8 on Hopper GPUs.
QUANTIZATION_METHODS = ("int8", "int4", "fp8")
CPU_QUANTIZATION_METHODS = ("int8", "int4")
# Speculative decoding (chunkpilot.engine.speculative): the engine's --speculative-config and the CRD's
# engine.speculative. Methods, the most draft tokens a decode may verify, and the default count (2: on the CPU's
# GEMMs 3 rows cost what 1 does and 4 cost twice as much, measured with SmolLM2's layers).
SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
NUM_SPECULATIVE_TOKENS = 2
PROMPT_LOOKUP = (1, 4)  # the n-gram lookup's shortest and longest context (vLLM's prompt_lookup_min/max)
