"""`chunkpilot demo`: the whole idea on one machine (engines, load, Prometheus, tuner), watched live, reported."""
