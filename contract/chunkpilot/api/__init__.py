"""The InferenceDeployment API (chunkpilot.io/v1alpha1): pydantic types, the single source of the CRD schema.
Shared by the operator and the tuner."""

from chunkpilot.api.types import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    Condition,
    InferenceDeployment,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    SchedulerStatus,
)

__all__ = ["GROUP", "VERSION", "KIND", "PLURAL", "InferenceDeployment", "InferenceDeploymentSpec",
           "InferenceDeploymentStatus", "Condition", "SchedulerStatus"]
