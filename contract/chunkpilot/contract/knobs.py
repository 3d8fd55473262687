"""The scheduler knobs, the knobs file and the admin push that carries the same content, the contract between whoever chooses the knobs (the operator's ConfigMap,
the local tuner, the demo) and the engine that applies them: `{"token_budget": int, "max_chunk": int,
"generation": int}`, and on a disaggregated decode engine optionally `"disagg_threshold": int` (the uncached prompt
tokens above which it sends a prompt to a prefill pod; docs/disaggregation.md) and on a live-roles engine `"role":
"prefill" | "decode"` (the role it serves in from then on), its one validation, its one reader
and its one writer. Torch-free: operator and tuner images
carry this package, not the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from chunkpilot.contract.engine_settings import LIVE_ROLES


# The disaggregation threshold that sends no prompt to a prefill pod: every prompt is prefilled on the decode pod
# that received it, as a colocated engine does. The engine routes a prompt remotely only when its uncached tokens
# are > the threshold (engine/kv_transfer/decode_side.py `route`), and no prompt is longer than the largest context
# the API admits (ModelSpec.maxModelLen <= 1_048_576 = 2^20 tokens; the engine refuses longer prompts), so this
# integer, which every engine accepts today, means "never". Humans read it as "never" (threshold_text).
DISAGG_NEVER = 1_048_576


def threshold_text(threshold: int | None) -> str:
    """A disaggregation threshold as status, Events and logs show it: "never" for DISAGG_NEVER (colocated)."""
    if threshold is None:
        return "start-up"  # no threshold pushed: the engine's --disagg-threshold holds
    return "never" if threshold >= DISAGG_NEVER else str(threshold)


@dataclass(frozen=True)
class Knobs:
    """The numbers a pod applies: what the tuner searches over. The one value type of the knobs; the file adds a
    generation (SchedulerKnobs), the API's SchedulerSpec and SchedulerStatus convert with `.knobs` and
    `SchedulerStatus.of`.

    `disagg_threshold`, `prefill_pods` and `prefill_budget` are set only where the tuner searches them
    (spec.disaggregation.mode auto with tuning.mode auto): the uncached prompt tokens above which the decode pods
    send a prompt to a prefill pod, DISAGG_NEVER for colocated; how many of the resource's pods serve as prefill
    pods (0 with DISAGG_NEVER: every pod serves clients); and the prefill pods' own token budget, which is also
    their max chunk (a prefill pod carries no decode whose gaps a smaller chunk would protect, so its one trade is
    a step's size against how long a short prompt waits behind a long one's chunk), None at DISAGG_NEVER (no
    prefill pod runs it). None everywhere else, so every other resource's knobs are the two numbers as before
    (equal, hashed and stored alike)."""

    token_budget: int
    max_chunk: int
    disagg_threshold: int | None = None
    prefill_pods: int | None = None
    prefill_budget: int | None = None

    @property
    def budget_and_chunk(self) -> "Knobs":
        """The two scheduler numbers alone: what the step-time model predicts from (it knows no remote prefill)."""
        searched = (self.disagg_threshold, self.prefill_pods, self.prefill_budget) != (None, None, None)
        return Knobs(self.token_budget, self.max_chunk) if searched else self

    @property
    def prefill_knobs(self) -> "Knobs | None":
        """What the prefill pods run at these knobs, where the tuner chose it: the budget as the chunk too."""
        return None if self.prefill_budget is None else Knobs(self.prefill_budget, self.prefill_budget)

    @property
    def colocated(self) -> bool:
        """No prompt goes to a prefill pod at these knobs as far as the tuner chose: no threshold of its own
        (None) or DISAGG_NEVER."""
        return self.disagg_threshold is None or self.disagg_threshold >= DISAGG_NEVER


@dataclass(frozen=True)
class SchedulerKnobs:
    """Knobs with the generation that carries them: the knobs file's content."""

    token_budget: int
    max_chunk: int
    generation: int = 0
    # disaggregation: the decode engine's threshold, moved while it serves like the two numbers; None: the engine's
    # start-up --disagg-threshold stays (and the file or push leaves the key out)
    disagg_threshold: int | None = None
    # disaggregation mode auto: the role a live-roles engine (--live-roles) serves in, switched while it serves (the
    # operator splits the pods between the roles, docs/disaggregation.md); None: the role it runs keeps
    role: str | None = None

    @classmethod
    def of(cls, knobs: Knobs, generation: int = 0) -> "SchedulerKnobs":
        return cls(knobs.token_budget, knobs.max_chunk, generation, knobs.disagg_threshold)

    def with_role(self, role: str | None) -> "SchedulerKnobs":
        """The same knobs for a pod of `role` (the operator's push to each pod of a live split)."""
        return replace(self, role=role)

    @property
    def knobs(self) -> Knobs:
        return Knobs(self.token_budget, self.max_chunk, self.disagg_threshold)

    def validated(self, *, min_token_budget: int = 1, max_token_budget: int | None = None) -> "SchedulerKnobs":
        """Return self if the knobs are usable, else raise ValueError saying which field to change. The one
        validation of the knobs: the engine's config, its knobs file and (through api.types.knob_refusal, which
        states the same two rules for a spec) the operator."""
        for name in ("token_budget", "max_chunk", "generation"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.max_chunk <= self.token_budget:
            raise ValueError(
                f"max_chunk must be in [1, token_budget={self.token_budget}], got {self.max_chunk}"
            )
        if self.token_budget < min_token_budget:
            raise ValueError(
                f"token_budget must be >= max_num_seqs = {min_token_budget} (every running sequence needs one "
                f"decode token per step: lower max_num_seqs or raise token_budget), got {self.token_budget}"
            )
        if max_token_budget is not None and self.token_budget > max_token_budget:
            raise ValueError(f"token_budget must be <= {max_token_budget}, got {self.token_budget}")
        if self.generation < 0:
            raise ValueError(f"generation must be >= 0, got {self.generation}")
        t = self.disagg_threshold
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError(f"disagg_threshold must be an integer >= 0 (uncached prompt tokens), got {t!r}")
        if self.role is not None and self.role not in LIVE_ROLES:
            raise ValueError(f"role must be one of {', '.join(LIVE_ROLES)}, got {self.role!r}")
        return self


FIELDS = ("token_budget", "max_chunk", "generation")
OPTIONAL_FIELDS = ("disagg_threshold", "role")
# The engine's admin endpoint (its own port): PUT a knobs file's content there to apply it at once, GET to read
# what the engine runs; both answer with the knobs file's content. The operator pushes here (knobs_delivery.py).
ADMIN_PATH = "/admin/knobs"


def parse_knobs(data: bytes | str) -> SchedulerKnobs:
    """The knobs-file contract: `{"token_budget": int, "max_chunk": int, "generation": int}`, nothing else."""
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"knobs file is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"knobs file must hold a JSON object with {', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in obj]
    unknown = sorted(set(obj) - set(FIELDS) - set(OPTIONAL_FIELDS))
    if missing:
        raise ValueError(f"knobs file lacks {', '.join(missing)}")
    if unknown:
        raise ValueError(f"knobs file has unknown keys {', '.join(unknown)}; allowed: "
                         f"{', '.join(FIELDS + OPTIONAL_FIELDS)}")
    return SchedulerKnobs(obj["token_budget"], obj["max_chunk"], obj["generation"], obj.get("disagg_threshold"),
                          obj.get("role"))


def knobs_object(knobs: SchedulerKnobs) -> dict[str, int | str]:
    """The file's content as a JSON object (the admin endpoint's answer); optional fields only when set."""
    out = {f: getattr(knobs, f) for f in FIELDS}
    out.update({f: getattr(knobs, f) for f in OPTIONAL_FIELDS if getattr(knobs, f) is not None})
    return out


def dumps_knobs(knobs: SchedulerKnobs) -> str:
    """The file's content for `knobs` (keys sorted, so the same knobs always give the same bytes)."""
    return json.dumps(knobs_object(knobs), sort_keys=True)


def write_knobs(path: str | Path, knobs: SchedulerKnobs) -> None:
    """Atomic write (rename), as the local tuner and tests do; readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(dumps_knobs(knobs))
    tmp.replace(path)
