"""Every engine setting, declared once: its name, type, default, environment variable, help, which part of the
engine reads it, and whether the operator sets it. `chunkpilot engine serve`/`generate` build their options from
this table, `EngineConfig` and `ServerSettings` take their defaults from it (a test holds their fields to it), the
operator renders its env through `Setting.env` and refuses the options it owns from `option_strings`. Torch-free
and CLI-free: the operator image carries this package, not the engine or the CLI.

The plain constants below are the values more than one part shares (the CRD's defaults and the tuner's default
search bounds read them too)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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
# Weight-only quantization methods (chunkpilot.engine.model.quantization): the engine's --quantization, the CRD's
# model.quantization (with "none") and the demo's flag. int8 and int4 run on the CPU, fp8 on Hopper GPUs.
QUANTIZATION_METHODS = ("int8", "int4", "fp8")
CPU_QUANTIZATION_METHODS = ("int8", "int4")
# Speculative decoding (chunkpilot.engine.speculation.speculative): the engine's --speculative-config and the CRD's
# engine.speculative. Methods, the most draft tokens a decode may verify, and the default count (2: on the CPU's
# GEMMs 3 rows cost what 1 does and 4 cost twice as much, measured with SmolLM2's layers).
SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
NUM_SPECULATIVE_TOKENS = 2
PROMPT_LOOKUP = (1, 4)  # the n-gram lookup's shortest and longest context (vLLM's prompt_lookup_min/max)

# Prefill/decode disaggregation (chunkpilot.engine.kv_transfer): an engine's roles, the KV transports it can pull
# blocks with, and the defaults the CRD's spec.disaggregation shares. A decode (or both) engine sends a prompt to a
# prefill pod when more than DISAGG_THRESHOLD of its tokens are not in its own prefix cache; a prefill pod holds the
# blocks it computed for LEASE_SECONDS at most, until the decode pod acknowledges them. A prompt a prefill pod failed
# goes to PREFILL_RETRIES other prefill pods at most before it is prefilled locally: one, because a second failure
# in a row says more about the fleet (or the prompt) than about one pod, and each try costs the TTFT a prefill.
ROLES = ("both", "prefill", "decode")
# The roles a live-roles engine (--live-roles) switches between while it serves, by a knobs push or file
LIVE_ROLES = ("prefill", "decode")
KV_TRANSPORTS = ("nixl",)
# When a decode engine sends the first token of a prompt a prefill pod computed: at once, or once the blocks are here
FIRST_TOKEN_MODES = ("early", "with-kv")
DISAGG_THRESHOLD = 256
KV_LEASE_SECONDS = 10.0
PREFILL_MAX_WAITING = 8
PREFILL_RETRIES = 1
# The largest share of the wall time a decode pod's pull works on the CPU (kv_transfer/pacing.py): at 0.25 the p99 of
# the decode steps beside one pull a second was 6 % over theirs alone, against 50 % for a whole read
# (bench/pull_contention.py), for a pull 4x as long
PULL_SHARE = 0.25

ENV_PREFIX = "CHUNKPILOT_"

# Who reads a setting: the engine's EngineConfig, the server's ServerSettings, or the process that listens (uvicorn).
Layer = Literal["engine", "server", "listen"]


@dataclass(frozen=True)
class Setting:
    name: str  # the field of EngineConfig/ServerSettings and the option's stem
    kind: type  # int, float, str, bool or Path; with default None the value is optional
    default: Any
    help: str
    layer: Layer
    operator: bool = False  # the operator sets it on every engine pod: a spec may not set it through extraArgs
    generate: bool = False  # `chunkpilot engine generate` has it too
    decls: tuple[str, ...] = ()  # option strings when not `--name-with-dashes` (aliases, on/off pairs)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def param_decls(self) -> tuple[str, ...]:
        """What the CLI declares: a bool without its own declarations gets the `--x/--no-x` pair, as typer would."""
        if self.decls:
            return self.decls
        if self.kind is bool:
            return (f"{self.option}/--no-{self.option[2:]}",)
        return (self.option,)

    @property
    def option_strings(self) -> tuple[str, ...]:
        """Every string that names this option on a command line (aliases and `--no-` forms included)."""
        return tuple(s for decl in self.param_decls for s in decl.split("/"))


COMPILE_HELP = ("Compile the forward of small steps (decodes) with torch.compile at start-up, on the CPU with one "
                "rank: faster decodes, minutes longer start-up (measured on the results page, docs/results.md; "
                "inductor's cache in TORCHINDUCTOR_CACHE_DIR makes later starts shorter).")

SETTINGS: tuple[Setting, ...] = (
    Setting("model", Path, ..., "Hugging Face model folder (PVC, host path or baked into the image; see "
            "`chunkpilot model fetch`).", "engine", operator=True, generate=True),
    Setting("host", str, "0.0.0.0", "Address to listen on.", "listen", operator=True),
    Setting("port", int, 8000, "Port for the API, /health, /ready and /metrics.", "listen", operator=True),
    Setting("served_model_name", str, None, "Model name clients send (default: the folder's name).", "server",
            operator=True),
    Setting("api_key", str, None, "Require `Authorization: Bearer KEY` on /v1/*; several keys separated by commas "
            "are several tenants, whose prompts never share prefix-cache blocks. Prefer the env var (a Secret) to "
            "the flag.", "server", operator=True),
    Setting("knobs_file", Path, None, "Scheduler knobs JSON {token_budget, max_chunk, generation}, watched and "
            "applied while serving.", "server", operator=True),
    Setting("knobs_poll_interval", float, 0.2, "Seconds between reads of the knobs file.", "server"),
    Setting("admin_port", int, None, "Port of the knobs admin endpoint (PUT/GET /admin/knobs), where the operator "
            "pushes knobs; needs --admin-token-file. Once a push is applied the knobs file is read again only at "
            "the next start.", "server", operator=True),
    Setting("admin_token_file", Path, None, "File holding the admin endpoint's bearer token (a Secret volume), read "
            "on every request.", "server", operator=True),
    Setting("token_budget", int, TOKEN_BUDGET, "Initial tokens per step, decodes first, then prefill chunks (the "
            "knobs file overrides it).", "engine", operator=True, generate=True),
    Setting("max_chunk", int, MAX_CHUNK, "Initial largest prefill chunk per sequence per step (the knobs file "
            "overrides it).", "engine", operator=True, generate=True),
    Setting("max_num_seqs", int, MAX_NUM_SEQS, "Cap on running sequences; token budgets below it are refused.",
            "engine", operator=True, generate=True),
    Setting("max_token_budget", int, None, "Largest token budget a knobs file may set (default: what the GPU's "
            "memory leaves room for, at most max-num-seqs x max-model-len); larger ones are refused and the last "
            "good knobs stay.", "engine"),
    Setting("max_waiting", int, 256, "Requests allowed to wait; beyond it HTTP 429 with Retry-After.", "server"),
    Setting("max_model_len", int, None, "Prompt + output limit (default: the model's, capped at 8192).", "engine",
            operator=True),
    Setting("block_size", int, 16, "Tokens per KV-cache block.", "engine"),
    Setting("kv_cache_memory_gb", float, None, "CPU: memory for the KV cache (default 1 GB).", "engine"),
    Setting("gpu_memory_utilization", float, 0.85, "GPU: fraction of the card for weights + KV cache.", "engine",
            operator=True),
    Setting("enable_prefix_caching", bool, True, "Reuse KV blocks of shared prompt prefixes.", "engine",
            operator=True),
    Setting("dtype", str, "auto", "float32 | bfloat16 | float16 | auto (float32 on CPU).", "engine", operator=True,
            generate=True),
    Setting("device", str, "auto", "cpu | cuda | cuda:N | auto.", "engine", operator=True, generate=True),
    Setting("threads", int, None, "CPU threads for torch (default: torch's choice).", "engine", generate=True),
    Setting("attention_backend", str, "auto", "auto | sdpa | varlen (FlashAttention on CUDA, checked at start-up).",
            "engine", generate=True),
    Setting("quantization", str, None, "Weight-only quantization of the linear layers at load time (vLLM's flag): "
            "int8 (per channel) | int4 (groups of 32) on the CPU, fp8 on Hopper GPUs, or none.", "engine",
            operator=True, generate=True, decls=("--quantization", "-q")),
    Setting("speculative_config", str, None, "Speculative decoding as JSON (vLLM's flag): method ngram (prompt "
            "lookup; prompt_lookup_min/max) or draft_model (\"model\": a smaller model's folder with the same "
            "tokenizer), num_speculative_tokens 1-16; e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' "
            "or '{\"model\": \"/models/draft\"}'. Off by default.", "engine", operator=True, generate=True),
    Setting("tensor_parallel_size", int, 1, "GPUs (ranks) to split the model across, Megatron-style; the engine "
            "starts ranks 1..N-1 as its own processes in the container. Must divide the attention heads and the "
            "MLP width.", "engine", operator=True, generate=True, decls=("--tensor-parallel-size", "-tp")),
    Setting("compile", bool, False, COMPILE_HELP, "engine", generate=True, decls=("--compile",)),
    Setting("tensor_parallel_timeout", float, 120.0, "Seconds a collective between ranks may take (more than the "
            "slowest step); a rank that hangs longer makes the engine exit non-zero, so the pod restarts.",
            "engine"),
    Setting("grace_period", float, 30.0, "Seconds in-flight requests may finish after SIGTERM.", "server",
            operator=True),
    Setting("max_request_bytes", int, None, "Largest request body; larger ones get HTTP 413 before they are parsed "
            "(default: 64 bytes per token of max-model-len, at least 1 MiB).", "server"),
    Setting("stream_write_timeout", float, 30.0, "Seconds a stream may wait on a client that reads nothing before "
            "it is aborted and its slot freed.", "server"),
    Setting("stall_timeout", float, 120.0, "/health fails (the pod restarts) when one engine step has run this "
            "long.", "server"),
    Setting("prompt_tokens_details", bool, True, "Report usage.prompt_tokens_details.cached_tokens. The count tells "
            "a caller which prompt prefixes are cached: with one shared key, hide it or give each tenant its own "
            "key.", "server",
            decls=("--enable-prompt-tokens-details/--disable-prompt-tokens-details",)),
    Setting("exit_on_load_failure", bool, False, "Exit with status 1 when the model fails to load, the error as the "
            "last log line (in a pod: restarted and reported at once); by default the server stays up and says "
            "why on /ready.", "server", operator=True),
    Setting("role", str, "both", "Disaggregation role: both (prefill and decode here, the default) | prefill "
            "(serve /kv/prefill for decode pods and hold the blocks under a lease) | decode (send long uncached "
            "prompts to --prefill-peers and pull their KV blocks). See docs/disaggregation.md.", "server",
            operator=True),
    Setting("live_roles", bool, False, "Let the role change while the engine serves (prefill <-> decode, by a "
            "knobs push or the knobs file's role), no restart: the engine keeps both sides ready, one KV transport "
            "for both; switched to prefill it takes prompts once its client streams ended (at most --grace-period). "
            "Needs --role prefill or decode and --prefill-peers. The operator starts spec.disaggregation mode "
            "auto's pods so.", "server", operator=True),
    Setting("prefill_peers", str, None, "Prefill pods a decode (or both) engine may send prompts to: host:port "
            "entries separated by commas; a name that resolves to several addresses (a headless Service) is every "
            "pod behind it, resolved again every second.", "server", operator=True),
    Setting("disagg_threshold", int, DISAGG_THRESHOLD, "Uncached prompt tokens above which a decode engine has a "
            "prefill pod compute the prompt; at or below it the prompt is prefilled here, chunked as usual.",
            "server", operator=True),
    Setting("kv_transport", str, "nixl", "How KV blocks move between pods: nixl (NVIDIA's transfer library over "
            "UCX: shared memory, TCP, RDMA or GPU memory, whatever UCX finds; UCX_TLS narrows it).", "server",
            operator=True),
    Setting("kv_lease_seconds", float, KV_LEASE_SECONDS, "Prefill role: seconds a prefill pod holds the blocks of "
            "a prompt it computed for the decode pod that asked; released earlier on acknowledgement or abort.",
            "server", operator=True),
    Setting("first_token", str, FIRST_TOKEN_MODES[0], "Decode role: when the first token of a prompt a prefill pod "
            "computed goes to the client. early: as soon as the prefill pod has it (the lowest TTFT; the gap to the "
            "second token then holds the pull of the blocks) | with-kv: once the blocks are here, as vLLM's and "
            "llm-d's decode pods send it (TTFT holds the pull, the first gap is one decode step): for a tight ITL "
            "SLO with TTFT to spare.", "server"),
    Setting("prefill_max_waiting", int, PREFILL_MAX_WAITING, "A prefill pod with more requests waiting than this "
            "is saturated: decode engines prefill locally instead of queueing behind it.", "server"),
    Setting("pull_share", float, PULL_SHARE, "Decode role, KV pool on the CPU: the largest share of the wall time "
            "the read of a prompt's KV blocks from a prefill pod works (in slices, each checked as it lands, pausing "
            "between them), so that the decode steps sharing its cores keep their inter-token gaps; the pull takes "
            "1/share as long, and the first token waits for it under --first-token with-kv. 1 reads whole. A pool on "
            "a GPU is always read whole.", "server"),
    Setting("prefill_retries", int, PREFILL_RETRIES, "Other prefill pods a decode engine tries, at most, when one "
            "fails a prompt (unreachable, transfer, checksum, lease, KV layout) and the time that try took is less "
            "than prefilling the prompt here would take; then it prefills locally. 0: never.", "server"),
    Setting("slo_classes", str, None, "Per-request SLO classes as JSON {\"default\": NAME, \"classes\": [{\"name\", "
            "\"priority\" (higher is more important, below 0 sheddable), \"ttft\"/\"itl\": {\"threshold\", "
            "\"quantile\"}, \"share\", \"queue_limit\"}]}; a request picks one with the x-chunkpilot-slo-class "
            "header, the Inference Extension's objective header or service_tier (docs/slo-classes.md).", "engine",
            operator=True),
    Setting("seed", int, 0, "Seed for requests without their own.", "engine"),
    Setting("log_level", str, "info", "debug | info | warning | error.", "listen"),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def default(name: str) -> Any:
    """A setting's default, for the typed configs that declare the field (EngineConfig, ServerSettings)."""
    return BY_NAME[name].default


def layer(name: Layer) -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.layer == name)


def operator_settings() -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.operator)
