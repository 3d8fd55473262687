"""What runs the model for a step: the worker (loads the model, sizes the KV pool), the model runner (one flattened
forward over the scheduled tokens), the sampler, the KV cache, the compiled forward, the activation-memory fit, and
the tensor-parallel rank processes (tp_worker). Beside speculation, neither importing the other; below the engine.

Empty on purpose: importing one module of the layer never loads its siblings."""
