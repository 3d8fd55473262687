"""The rules an InferenceDeployment's engine env and extraArgs must follow, in one place for both sides that check
them: the operator (builders.validate) and the chart's ValidatingAdmissionPolicy, which reads the lists from
`helm/chunkpilot/files/engine-rules.json`, written by `chunkpilot crds generate` from this module (a test fails
when the committed file differs).

* **Environment: an allowlist.** Deny lists kept missing names that make the engine's interpreter or libraries
  load code from the tenant's own volume (`PYTHONPYCACHEPREFIX` with an unchecked-hash .pyc, `OPENSSL_CONF`
  naming a provider .so, `NCCL_NET_PLUGIN`, `PYTHONWARNINGS` importing a category, `TORCHINDUCTOR_*` caches,
  even `HOME`); the names below only tune threads, logging and time zone. `CHUNKPILOT_*` are the operator's.
* **extraArgs: the engine's own options, derived from its settings.** An argument that starts with `-` must name an
  option of `chunkpilot engine serve` (aliases such as `-tp` included) that the operator does not set; both come
  from the one declaration of the engine settings (chunkpilot.contract.engine_settings), which the CLI builds its
  options from, so a new option or alias cannot slip past a second hand-kept list. Values go after
  `=` when they start with `-` (`--seed=-1`): a bare `-x` is always read as a flag.
* Neither may hold `$(VAR)`: Kubernetes expands it in env values and args, and the operator's variables include
  the API key.
"""

from __future__ import annotations

import functools
import json

from chunkpilot.contract import engine_settings

# Every engine setting the operator sets (as CHUNKPILOT_<NAME> env) is reserved as an option too: an
# InferenceDeployment author must not turn off the platform's API key (`--api-key=`) or move the port the probes
# and the Service use.
OPERATOR_ENGINE_SETTINGS = tuple(s.name.upper() for s in engine_settings.operator_settings())
# Environment names a spec may set: threads, logging, time zone. Nothing here reads a path.
ENV_ALLOWED = (
    "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS",
    "CUDA_LAUNCH_BLOCKING", "TORCH_CPP_LOG_LEVEL", "HF_HUB_OFFLINE",
)
OPERATOR_ENV_PREFIX = engine_settings.ENV_PREFIX


@functools.cache
def engine_options() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(free, owned): every option string of `chunkpilot engine serve` (long names, aliases, --no- forms), split
    by whether the operator sets that setting."""
    free, owned = set(), set()
    for s in engine_settings.SETTINGS:
        (owned if s.operator else free).update(s.option_strings)
    return tuple(sorted(free)), tuple(sorted(owned))


def option_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def env_refusal(name: str, value: str | None) -> str | None:
    """Why a spec's env entry is refused (None: allowed)."""
    if name.startswith(OPERATOR_ENV_PREFIX):
        return ("CHUNKPILOT_* variables are the operator's; set the matching spec field instead (model, engine, "
                "scheduler)")
    if name not in ENV_ALLOWED:
        return (f"only {', '.join(ENV_ALLOWED)} may be set (other variables can make the engine load code from "
                "elsewhere); build an engine image for anything else")
    if value and "$(" in value:
        return "$(VAR) references are not allowed (they would expand the operator's variables, the API key among them)"
    return None


def arg_refusal(arg: str) -> str | None:
    """Why a spec's extraArgs entry is refused (None: allowed)."""
    if "$(" in arg:  # Kubernetes expands $(VAR) in args: "--x=$(CHUNKPILOT_API_KEY)" would print the key
        return "$(VAR) references are not allowed"
    if not arg.startswith("-"):
        return None
    free, owned = engine_options()
    name = option_name(arg)
    if name in owned:
        return f"{name!r} is set by the operator; use the matching spec field instead (model, engine, scheduler)"
    if name not in free:
        return (f"{name!r} is not an option of `chunkpilot engine serve` (see its --help); a value that starts "
                "with '-' goes after '=' (--seed=-1)")
    return None


def render() -> str:
    """The chart's copy (helm/chunkpilot/files/engine-rules.json): what its CEL needs of these rules."""
    free, owned = engine_options()
    return json.dumps({"envAllowed": list(ENV_ALLOWED), "envOperatorPrefix": OPERATOR_ENV_PREFIX,
                       "freeOptions": list(free), "ownedOptions": list(owned)}, indent=2) + "\n"
