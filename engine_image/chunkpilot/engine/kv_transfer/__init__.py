"""Prefill/decode disaggregation: a decode (or both) engine has a prefill pod compute long uncached prompts and pulls
their KV blocks (docs/disaggregation.md).

* wire.py: what the two sides say to each other over HTTP (pydantic), and the KV layout's fingerprint;
* leases.py: the prefill side's one-time transfer ids and the blocks each holds until acknowledged or expired;
* peers.py: the decode side's view of the prefill pods (their load) and the power-of-two choice among them;
* transport.py: the transport interface (shaped like vLLM's KV connector: register the pool once, read blocks)
  and its in-process backend for tests; nixl_transport.py: the NIXL backend;
* decode_side.py: the decode engine's orchestration (decide, call, pull, verify, acknowledge, retry or fall back);
* retry.py: whether a prompt a prefill pod failed goes to another one (a pure rule) and what a local prefill costs.
"""
