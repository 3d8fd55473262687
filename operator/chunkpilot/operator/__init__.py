"""The chunkpilot operator: pure builders (spec in, manifests out) and thin kopf handlers."""
