"""Decoding is bandwidth-bound: each step of generation reads every weight it uses and the whole
KV cache once, and makes one token per sequence of the batch (Pope et al., 2022, "Efficiently
Scaling Transformer Inference"). A roofline of one decode step, counted in bytes and FLOPs.

A model: weights and cache read once per step from HBM (no L2 reuse), the input embedding's
rows only (a lookup), the LM head whole; for MoE layers, the routed experts that the batch's
tokens choose, every expert equally likely: an upper bound on the experts read (a skewed router
picks fewer). One query token per sequence a step (no speculative decoding), on one GPU. The
weights' matmuls and attention are bounded one after the other, each by the slower of its bytes
and its FLOPs.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.config import ModelConfig, preset
from labkit.core.gpus import GPU, gpu, usable_memory
from labkit.core.units import check_positive, dtype_bytes
from labkit.predict import count_params, kv_cache_bytes


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of ``batch`` sequences at ``context`` tokens each."""

    batch: int
    context: int
    weight_bytes: int        # weights read: every dense weight, the experts the batch routes to
    kv_bytes: int            # the whole KV cache of the batch, read by attention
    weight_flops: int        # 2 per weight used, per token
    attention_flops: int     # 2 per cached number, per query head that reads it

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def flops(self) -> int:
        return self.weight_flops + self.attention_flops

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.batch

    @property
    def intensity(self) -> float:
        """FLOPs per byte read: below a GPU's FLOP/s over its bytes/s, bandwidth bounds it."""
        return self.flops / self.bytes

    def seconds(self, device: GPU | str) -> float:
        """The roofline's time: the weights' matmuls, then attention, each the slower of reading
        its bytes and doing its FLOPs."""
        g = gpu(device)
        bandwidth, peak = g.hbm_gbps * 1e9, g.bf16_tflops * 1e12
        return (max(self.weight_bytes / bandwidth, self.weight_flops / peak)
                + max(self.kv_bytes / bandwidth, self.attention_flops / peak))

    def tokens_per_second(self, device: GPU | str) -> float:
        """The roofline's bound on the batch's tokens a second."""
        return self.batch / self.seconds(device)

    def cache_ceiling(self, device: GPU | str) -> float:
        """Tokens a second that no batch passes: with the weights' reads shared by ever more
        sequences, each token still reads its own sequence's cache."""
        g = gpu(device)
        per_sequence = max(self.kv_bytes / (g.hbm_gbps * 1e9),
                           self.attention_flops / (g.bf16_tflops * 1e12)) / self.batch
        return 1 / per_sequence


def experts_read(routed: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts that ``tokens`` tokens choose, ``top_k`` each of ``routed``,
    every expert equally likely: routed x (1 - (1 - top_k / routed) ** tokens)."""
    if not 0 < top_k <= routed or tokens < 0:
        raise ValueError(f"experts_read needs 0 < top_k <= routed and tokens >= 0, got "
                         f"routed={routed}, top_k={top_k}, tokens={tokens}")
    return routed * (1 - (1 - top_k / routed) ** tokens)


def decode_step(cfg: ModelConfig | str, batch: int = 1, context: int = 4096,
                weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> DecodeStep:
    """Bytes and FLOPs of one decode step (``labkit.predict.kv_cache_bytes`` for the cache)."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    batch, context = check_positive("batch", batch), check_positive("context", context)
    kv_dtype = {"fp8": "fp8-e4m3"}.get(kv_dtype, kv_dtype)      # QuantisedKVCache's name for it
    n = count_params(c)
    embedding = n.by_component["embedding"] if not c.tie_embeddings else 0   # a lookup, not a read
    routed = n.by_component.get("routed experts", 0)
    per_expert = routed / c.routed_experts if c.routed_experts else 0
    idle = (c.routed_experts - experts_read(c.routed_experts, c.top_k, batch)) * per_expert \
        if c.routed_experts else 0
    weights = (n.total - embedding - idle) * dtype_bytes(weight_dtype)
    kv = kv_cache_bytes(c, batch, context, kv_dtype)
    used_per_token = n.active - embedding
    attention = attention_flops_per_byte(c, kv_dtype) * kv
    return DecodeStep(batch, context, int(weights), kv, 2 * used_per_token * batch, int(attention))


def attention_flops_per_byte(cfg: ModelConfig | str, kv_dtype: str = "bf16") -> float:
    """Decode attention's FLOPs per byte of cache read: 2 per cached number for each query head
    that reads it (q.k on keys, p.v on values). GQA: heads / kv_heads read each. Absorbed MLA:
    every head scores over the latent and RoPE key and sums the latent as its values."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    if c.attention == "mla":
        latent = c.kv_lora_rank + c.qk_rope_dim                    # numbers cached per token
        per_number = 2 * c.heads * (latent + c.kv_lora_rank) / latent
    else:
        per_number = 2 * c.heads / c.kv_heads
    return per_number / dtype_bytes(kv_dtype)


def largest_batch(cfg: ModelConfig | str, context: int, device: GPU | str,
                  weight_dtype: str = "bf16", kv_dtype: str = "bf16") -> int:
    """The most sequences of ``context`` tokens whose KV cache fits beside every stored weight in
    the GPU's usable memory (``labkit.core.gpus.usable_memory``); 0 when the weights alone do not.
    Decoding's activations (one token per sequence) are left out."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    context = check_positive("context", context)
    room = usable_memory(gpu(device)) - count_params(c).total * dtype_bytes(weight_dtype)
    per_sequence = kv_cache_bytes(c, 1, context, kv_dtype)
    return max(int(room // per_sequence), 0)
