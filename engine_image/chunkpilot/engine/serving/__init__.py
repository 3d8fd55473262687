"""The HTTP side, on top of everything: the OpenAI-compatible server (FastAPI), its request and response types, SSE
streaming, API keys, body limits, errors, and the admin endpoint for the knobs. It sees the engine only through
AsyncEngine's facade (engine/async_engine.py) and publishes the metrics the engine's step loop records.

Empty on purpose: importing one module of the layer never loads its siblings."""
