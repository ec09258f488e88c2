"""Fewer bits per number: number formats and loss scaling, weight quantisers (NF4, GPTQ, FP8),
8-bit optimizers, LoRA and QLoRA, and the production libraries beside them."""
