"""What the scheduler owns, with no tensors: requests and their sampling settings, sequences, the block manager, the
scheduler, the knobs and their file, the outputs and per-step stats. Torch-free, so the tuner's simulator runs this
exact scheduling code. Imports only the settings (engine/config.py) below it.

Empty on purpose: importing one module of the layer never loads its siblings."""
