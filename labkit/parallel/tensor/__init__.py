"""Tensor and sequence parallelism (Megatron-LM): the split layers and their messages."""
