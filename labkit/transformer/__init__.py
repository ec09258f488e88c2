"""The model: one readable transformer, its attention cores (SDPA, naive, tiled, Triton) and
chunked loss, recomputation, generation with a KV cache and a paged cache."""
