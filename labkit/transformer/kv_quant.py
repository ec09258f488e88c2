"""A KV cache stored in 8 bits: int8 or FP8 (E4M3) keys and values with one fp32 scale per token
and KV head, computed as each token is written (as LMDeploy's online int8 cache does), and
dequantised when attention reads a layer. labkit's choice: vLLM's and TensorRT-LLM's 8-bit caches
keep fixed scales, one per tensor or per KV head, calibrated beforehand (1.0 otherwise), so they
store no scale per token; their kernels dequantise inside attention, a tile at a time. KIVI
scales keys per channel.
"""
from __future__ import annotations

import torch

from labkit.core.config import ModelConfig
from labkit.core.units import check_choice
from labkit.transformer.generate import KVCache

FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}   # dtype, its max


def quantise(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d) -> (8-bit codes (..., d), fp32 scales (..., 1)): absmax over the last dim."""
    dtype, top = FORMATS[fmt]
    scale = x.detach().abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / top   # (..., 1)
    y = x.float() / scale
    codes = y.round().clamp(-top, top).to(dtype) if fmt == "int8" else y.to(dtype)
    return codes, scale


def dequantise(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale).to(dtype)


class QuantisedKVCache(KVCache):
    """``KVCache`` whose keys and values are stored as 8-bit codes with a scale per token and head;
    ``read`` hands attention the dequantised tensors in ``dtype``."""

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, fmt: str = "int8",
                 share: int = 1, dtype: torch.dtype = torch.float32, device=None):
        check_choice("fmt (the cache's 8-bit format)", fmt, FORMATS)
        if cfg.attention == "mla":
            raise ValueError("MLA caches a latent, not keys and values per head: "
                             "QuantisedKVCache holds GQA, MHA and MQA caches (use an MLA model's "
                             "generate.new_cache)")
        self.fmt, self.dtype = fmt, dtype          # dtype: what attention reads
        super().__init__(cfg, batch, capacity, share, torch.float32, device)

    def shapes(self, cfg, batch, capacity):
        """Codes (B, Hkv, capacity, d) and one scale per token and head (B, Hkv, capacity, 1)."""
        codes, scales = super().shapes(cfg, batch, capacity)["k"], (batch, cfg.kv_heads, capacity, 1)
        return {"k": codes, "v": codes, "k_scale": scales, "v_scale": scales}

    def stored_dtype(self, name, dtype):
        return dtype if name.endswith("_scale") else FORMATS[self.fmt][0]   # fp32 scales

    def write(self, layer: int, **new):
        """Quantise the new tokens' keys and values (B, Hkv, T, d) and store codes and scales."""
        stored = {}
        for name, t in new.items():
            stored[name], stored[f"{name}_scale"] = quantise(t, self.fmt)
        super().write(layer, **stored)

    def read(self, layer: int, end: int) -> list:
        """The first ``end`` tokens' keys and values, dequantised: [k, v], each (B, Hkv, end, d)."""
        slot = self.slots[layer // self.share]
        t = self.time_dim
        return [dequantise(slot[n].narrow(t, 0, end), slot[f"{n}_scale"].narrow(t, 0, end),
                           self.dtype) for n in ("k", "v")]
