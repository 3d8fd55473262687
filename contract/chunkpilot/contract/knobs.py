"""The scheduler knobs, the knobs file and the admin push that carries the same content, the contract between whoever chooses the knobs (the operator's ConfigMap,
the local tuner, the demo) and the engine that applies them: `{"token_budget": int, "max_chunk": int,
"generation": int}`, and on a disaggregated decode engine optionally `"disagg_threshold": int` (the uncached prompt
tokens above which it sends a prompt to a prefill pod; docs/disaggregation.md), its one validation, its one reader
and its one writer. Torch-free: operator and tuner images
carry this package, not the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Knobs:
    """The two numbers: what the tuner searches over and what a pod applies. The one value type of the knobs;
    the file adds a generation (SchedulerKnobs), the API's SchedulerSpec and SchedulerStatus convert with
    `.knobs` and `SchedulerStatus.of`."""

    token_budget: int
    max_chunk: int


@dataclass(frozen=True)
class SchedulerKnobs:
    """Knobs with the generation that carries them: the knobs file's content."""

    token_budget: int
    max_chunk: int
    generation: int = 0
    # disaggregation: the decode engine's threshold, moved while it serves like the two numbers; None: the engine's
    # start-up --disagg-threshold stays (and the file or push leaves the key out)
    disagg_threshold: int | None = None

    @classmethod
    def of(cls, knobs: Knobs, generation: int = 0) -> "SchedulerKnobs":
        return cls(knobs.token_budget, knobs.max_chunk, generation)

    @property
    def knobs(self) -> Knobs:
        return Knobs(self.token_budget, self.max_chunk)

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
        return self


FIELDS = ("token_budget", "max_chunk", "generation")
OPTIONAL_FIELDS = ("disagg_threshold",)
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
    return SchedulerKnobs(obj["token_budget"], obj["max_chunk"], obj["generation"], obj.get("disagg_threshold"))


def knobs_object(knobs: SchedulerKnobs) -> dict[str, int]:
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
