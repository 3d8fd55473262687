"""The ground floor the two controllers stand on: the kubernetes client and its config, server-side apply, the
kopf process wiring and the condition bookkeeping. The operator (chunkpilot.operator) and the tuner
(chunkpilot.tuner) both import this and chunkpilot.api, and never each other."""
