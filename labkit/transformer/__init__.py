"""The model: one readable transformer, its attention cores and loss, recomputation, LoRA's
host, generation with a KV cache. Mechanisms: they import the core and the estimate."""
