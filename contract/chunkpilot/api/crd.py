"""Generate the CustomResourceDefinition from the pydantic types (the only place the schema is written).

pydantic emits JSON Schema (draft 2020-12, with $refs and anyOf-null for optionals); Kubernetes wants a
*structural* OpenAPI v3.0 schema: everything inlined, one type per node, `nullable` instead of anyOf-null,
boolean `exclusiveMinimum`, `x-kubernetes-preserve-unknown-fields` for free-form objects, and defaults written
out so the API server fills them in.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from chunkpilot.api import types as t

CRD_FILENAME = f"{t.PLURAL}.{t.GROUP}.yaml"
_DROP = {"title", "additionalProperties", "$defs", "discriminator"}


def _structural(node: Any, defs: dict) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(options) == 1:
            out = _structural({**options[0], **rest}, defs)
            out["nullable"] = True
            out.pop("default", None) if rest.get("default") is None else None
            return out
        # str | list[str] and similar: no single type fits, so keep the value as it comes
        return {**{k: v for k, v in rest.items() if k in ("description",)}, "x-kubernetes-preserve-unknown-fields": True}
    out: dict = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: _structural(v, defs) for name, v in value.items()}
        elif key in ("items",):
            out[key] = _structural(value, defs)
        elif key == "const":  # a one-value Literal; OpenAPI v3.0 has no const, an enum of one says the same
            out["enum"] = [value]
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        else:
            out[key] = value
    extra = node.get("additionalProperties")
    if node.get("type") == "object" and "properties" not in node:
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = _structural(extra, defs)
        else:  # dict[str, Any]: a free-form Kubernetes object (affinity, tolerations)
            out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("default") is None:
        out.pop("default", None)
    return out


def _with_defaults(model: type[BaseModel], schema: dict) -> dict:
    """Write nested defaults (pydantic leaves default_factory fields without one) so the API server fills a
    whole default sub-object, e.g. spec.tuning when the user wrote none."""
    for name, field in model.model_fields.items():
        key = field.alias or name
        prop = schema.get("properties", {}).get(key)
        if prop is None:
            continue
        sub = _model_of(field.annotation)
        if field.default_factory is not None and sub is not None:
            prop["default"] = field.default_factory().model_dump(by_alias=True, exclude_none=True)
        if sub is not None:
            _with_defaults(sub, prop)
    return schema


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, also when it is optional (`Model | None`): an optional sub-object without a
    default stays absent, but once the user writes it, the API server fills its own fields' defaults."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = [a for a in typing.get_args(annotation) if a is not type(None)] if union else [annotation]
    if len(options) == 1 and isinstance(options[0], type) and issubclass(options[0], BaseModel):
        return options[0]
    return None


def schema_for(model: type[BaseModel], *, defaults: bool) -> dict:
    raw = model.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
    schema = _structural(raw, raw.get("$defs", {}))
    return _with_defaults(model, schema) if defaults else schema


PRINTER_COLUMNS = [
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready engine pods."},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired engine pods."},
    # disaggregation on or auto: each role's ready pods (empty without it)
    {"name": "Prefill", "type": "integer", "jsonPath": ".status.disaggregation.prefill.readyReplicas",
     "description": "Ready prefill pods (disaggregation)."},
    {"name": "Decode", "type": "integer", "jsonPath": ".status.disaggregation.decode.readyReplicas",
     "description": "Ready decode pods (disaggregation)."},
    {"name": "Budget", "type": "integer", "jsonPath": ".status.knobs.tokenBudget", "description": "Token budget delivered."},
    {"name": "Chunk", "type": "integer", "jsonPath": ".status.knobs.maxChunk", "description": "Max chunk delivered."},
    {"name": "Applied", "type": "integer", "jsonPath": ".status.knobs.appliedReplicas",
     "description": "Ready pods that acknowledged the knobs."},
    {"name": "TTFT", "type": "number", "jsonPath": ".status.slo.ttftSeconds", "description": "Measured TTFT (s)."},
    {"name": "TTFT-SLO", "type": "number", "jsonPath": ".spec.slo.ttft.thresholdSeconds", "description": "TTFT SLO (s)."},
    {"name": "ITL", "type": "number", "jsonPath": ".status.slo.itlSeconds", "description": "Measured ITL (s)."},
    {"name": "ITL-SLO", "type": "number", "jsonPath": ".spec.slo.itl.thresholdSeconds", "description": "ITL SLO (s)."},
    {"name": "Tuning", "type": "string", "jsonPath": ".status.tuning.phase", "description": "Tuner phase."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd_manifest() -> dict:
    spec = schema_for(t.InferenceDeploymentSpec, defaults=True)
    spec["description"] = "What the user wants: the model, the engine pods, scheduler knobs, SLOs and tuning."
    status = schema_for(t.InferenceDeploymentStatus, defaults=False)
    status["description"] = "What the operator and the tuner observed or decided."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{t.PLURAL}.{t.GROUP}"},
        "spec": {
            "group": t.GROUP,
            "scope": "Namespaced",
            "names": {"kind": t.KIND, "plural": t.PLURAL, "singular": t.SINGULAR, "shortNames": t.SHORT_NAMES,
                      "categories": ["chunkpilot", "all"], "listKind": f"{t.KIND}List"},
            "versions": [{
                "name": t.VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "An LLM served by chunkpilot engine pods whose scheduler knobs can be tuned online.",
                    "required": ["spec"],
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "metadata": {"type": "object"}, "spec": spec, "status": status},
                }},
                "subresources": {"status": {}, "scale": {
                    "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def render() -> str:
    header = "# Generated by `chunkpilot crds generate` from chunkpilot.api.types: do not edit by hand.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)


def write(output_dir: str | Path) -> Path:
    path = Path(output_dir) / CRD_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    return path
