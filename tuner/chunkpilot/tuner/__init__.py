"""The Optuna tuner: chooses each deployment's token budget and max chunk from live latency, while it serves."""
