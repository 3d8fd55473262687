"""The network and its loading: the checkpoint's description (model_config), the Llama-family network (llama) and
what its layers are built from (rope, paged attention and its opaque operator, the forward context, the
tensor-parallel shard sizes, the quantized layers), the weights loader, the tokenizer, fetching a checkpoint, and
the perplexity measurement. Imports the core, the parallel group and the settings, never what runs the model.

Empty on purpose: importing one module of the layer never loads its siblings."""
