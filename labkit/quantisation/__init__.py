"""Fewer bits per number and fewer trained numbers: number formats and loss scaling, weight
quantisers (NF4, GPTQ, FP8), 8-bit AdamW, LoRA and QLoRA, and the production libraries
beside them."""
