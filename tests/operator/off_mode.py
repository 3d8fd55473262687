"""What the builders render for resources without disaggregation, recorded as digests so that a test can hold the
builders to it byte for byte (tests/operator/test_disaggregation.py): spec.disaggregation absent or mode off must
render exactly the objects the builders rendered before disaggregation existed (commit 550c8e4), key order
included. The fixtures are the samples under a few operator settings and tuner states, and every admitted row of
the shared admission table.

`python -m tests.operator.off_mode` (from the repository root) writes OFF_MODE_DIGESTS from the builders on the
path; rerun it only for a change that is meant to alter what every resource renders, and say so in the commit."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import yaml

from chunkpilot.api import InferenceDeployment
from chunkpilot.api.types import SchedulerStatus
from chunkpilot.operator import builders as b
from chunkpilot.operator.policy import Policy

from .admission_cases import CASES
from .admission_cases import settings as admission_settings
from .operator_proc import sample

ROOT = Path(__file__).resolve().parents[2]
OFF_MODE_DIGESTS = Path(__file__).with_name("off_mode_digests.json")
SETTINGS = {
    "default": b.OperatorSettings(policy=Policy(allowed_priority_classes=("inference-critical",)),
                                  admin_token_key="k"),
    "everything": b.OperatorSettings(
        policy=Policy(allowed_priority_classes=("inference-critical",)), engine_api_key_secret="engine-key:token",
        hf_download_image="registry.example/downloader:1", hf_endpoint="https://hf-mirror.example",
        network_policy_namespaces=("monitoring", "gateway"), service_monitor_labels=(("release", "kps"),),
        admin_token_key="k", operator_namespace="chunkpilot",
        operator_pod_labels=(("app.kubernetes.io/name", "chunkpilot"),)),
    "no-network-policy": b.OperatorSettings(policy=Policy(allowed_priority_classes=("inference-critical",)),
                                            engine_network_policy=False, admin_token_key="k"),
}


def _objects(obj: InferenceDeployment, settings: b.OperatorSettings) -> list[dict]:
    return [*b.desired_objects(obj, settings, service_monitor_crd=True), b.admin_token_secret(obj, settings)]


def fixtures() -> Iterator[tuple[str, InferenceDeployment, b.OperatorSettings]]:
    for path in sorted((ROOT / "crds" / "samples").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        raw["metadata"] |= {"namespace": "ml", "uid": "1234-abcd", "generation": 3}
        for tuned in (False, True):
            obj = InferenceDeployment.model_validate(copy.deepcopy(raw))
            if tuned:
                obj.status.scheduler = SchedulerStatus(tokenBudget=256, maxChunk=32, source="tuner", generation=7)
            for label, settings in SETTINGS.items():
                yield f"{path.name}/{'tuned' if tuned else 'spec'}/{label}", obj, settings
    for case, overrides, admitted in CASES:
        # the rows of the table before disaggregation (and routing, which adds objects and a pod label)
        if admitted and not {"disaggregation", "routing"} & overrides.keys():
            raw = sample(case, "default", **overrides)
            raw["metadata"] |= {"uid": "5678-efgh", "generation": 1}
            yield f"admission/{case}", InferenceDeployment.model_validate(raw), admission_settings()


def digest(objects: list[dict]) -> dict[str, str]:
    """kind and name -> sha256 of the object's JSON, keys in the order the builders wrote them."""
    return {f"{o['kind']} {o['metadata']['name']}": hashlib.sha256(json.dumps(o).encode()).hexdigest()
            for o in objects}


def digests() -> dict[str, dict[str, str]]:
    return {name: digest(_objects(obj, settings)) for name, obj, settings in fixtures()}


if __name__ == "__main__":
    OFF_MODE_DIGESTS.write_text(json.dumps(digests(), indent=1) + "\n")
    print(OFF_MODE_DIGESTS)
