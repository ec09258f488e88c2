"""Sliding-window + global-token attention: what it saves, checked three ways (lab 07, claim 19
"sparse (local + global) attention cuts memory 30%"): a dense boolean mask given to SDPA,
FlexAttention's block mask, and the inference KV cache that a sliding window caps at ``window``
tokens (Mistral 7B's rolling buffer, Jiang et al., 2023).
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.core.config import ModelConfig, preset
from labkit.core.units import check_positive, dtype_bytes, torch_dtype
from labkit.predict import kv_cache_bytes
from labkit.predict.layers import count_params
from labkit.training.track import MemoryTracker


def local_global_mask(T: int, window: int, n_global: int) -> torch.Tensor:
    """(T, T) bool, True where query i may see key j: causal, and either one of the last
    ``window`` keys (i - j < window, itself included) or one of the first ``n_global`` tokens."""
    check_positive("T", T)
    check_positive("window", window)
    if not isinstance(n_global, int) or n_global < 0:
        raise ValueError(f"n_global must be an integer >= 0, got {n_global!r}")
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) & ((i - j < window) | (j < n_global))


def block_density(mask: torch.Tensor, block: int = 128) -> float:
    """Fraction of (block x block) tiles of the mask with any True: the share of the score
    tiles a block-sparse kernel (FlexAttention, block 128) still computes."""
    T = mask.shape[0]
    n = math.ceil(T / block)
    padded = F.pad(mask, (0, n * block - T, 0, n * block - T))
    return padded.view(n, block, n, block).any(dim=3).any(dim=1).float().mean().item()


@dataclass
class AttentionMemory:
    """Peak bytes of one attention forward + backward (SDPA's fused CPU kernel), q, k, v
    excluded; ``density``: kept fraction of the causal scores, ``block_density`` per tile."""

    T: int
    window: int
    n_global: int
    full: int                  # causal, no mask tensor (is_causal=True)
    local_global: int          # the same kernel given the dense (T, T) bool mask
    mask_bytes: int            # the bool mask itself, counted in local_global
    density: float
    block_density: float
    local_global_forward: int = 0   # the masked step's peak by the end of its forward pass


def attention_memory(T: int, window: int, n_global: int = 4, heads: int = 8,
                     head_dim: int = 64, dtype=torch.float32) -> AttentionMemory:
    """Measure fwd+bwd peaks of full causal attention and of local + global attention
    through a dense mask, with the MemoryTracker (q, k, v made before it starts)."""
    dtype = torch_dtype(dtype)
    q, k, v = (torch.randn(1, heads, T, head_dim, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, heads, T, head_dim, dtype=dtype)

    def peaks(make_mask) -> tuple[int, int]:
        """(fwd+bwd peak, peak by the end of the forward pass)."""
        with MemoryTracker() as mt:
            mask = make_mask()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            forward = mt.peak
            out.backward(grad)
            del out, mask
        q.grad = k.grad = v.grad = None
        return mt.peak, forward

    mask = local_global_mask(T, window, n_global)
    causal_pairs = T * (T + 1) // 2
    masked, masked_forward = peaks(lambda: local_global_mask(T, window, n_global))
    return AttentionMemory(T, window, n_global, peaks(lambda: None)[0], masked, mask.nbytes,
                           mask.sum().item() / causal_pairs, block_density(mask), masked_forward)


@dataclass
class FlexMemory:
    """FlexAttention on this build: does it run, how long the first (compiling) call takes,
    and the forward's peak allocator bytes beside SDPA's full causal forward."""

    works: bool
    backward: bool             # fwd+bwd runs (not on CPU in torch 2.13: forward only)
    compile_s: float
    forward_peak: int | None   # CPU allocator bytes during one compiled forward
    full_forward_peak: int     # the same count for SDPA, causal, no mask
    error: str = ""


def _allocator_peak(fn) -> int:
    """Peak bytes the CPU allocator hands out while ``fn`` runs (torch.profiler's memory
    events): compiled kernels allocate where no dispatch mode, and so no tracker, sees them."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def flex_attention_memory(T: int, window: int, n_global: int = 4, heads: int = 8,
                          head_dim: int = 64) -> FlexMemory:
    """Try ``torch.compile(flex_attention)`` with the local + global BlockMask (fp32, no
    grad), time its first call and count its forward's allocator peak (slow: ~15 s compile)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def keep(b, h, q_idx, kv_idx):
        near = q_idx - kv_idx < window
        return (kv_idx <= q_idx) & (near | (kv_idx < n_global))

    q, k, v = (torch.randn(1, heads, T, head_dim) for _ in range(3))
    full = _allocator_peak(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    try:
        block_mask = create_block_mask(keep, None, None, T, T, device="cpu")
        # static shapes: a dynamic-shape recompile (a second T) falls back to a kernel that
        # keeps every score, as a compiled call that fails does for all later calls
        compiled = torch.compile(flex_attention, dynamic=False)
        start = time.perf_counter()
        compiled(q, k, v, block_mask=block_mask)
        compile_s = time.perf_counter() - start
        forward = _allocator_peak(lambda: compiled(q, k, v, block_mask=block_mask))
    except Exception as error:               # an unsupported build: report it, do not fail
        return FlexMemory(False, False, 0.0, None, full, f"{type(error).__name__}: {error}")
    try:                                     # ask eager flex, so no compiled call fails
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile()"
            flex_attention(q.clone().requires_grad_(), k, v, block_mask=block_mask).sum().backward()
        backward, error = True, ""
    except Exception as e:                   # CPU: "FlexAttention does not support backward"
        backward, error = False, f"{type(e).__name__}: {e}"
    return FlexMemory(True, backward, compile_s, forward, full, error)


@dataclass
class WindowCache:
    """Inference memory of one model at one context: full KV cache against a rolling buffer."""

    seq: int
    window: int
    weights: int               # the model's weights in the cache's dtype
    full_cache: int
    window_cache: int

    @property
    def cache_saving(self) -> float:
        return 1 - self.window_cache / self.full_cache

    @property
    def total_saving(self) -> float:
        """Saving on weights + cache, what "memory" means to someone serving the model."""
        return 1 - (self.weights + self.window_cache) / (self.weights + self.full_cache)


def window_kv_cache(cfg: ModelConfig | str = "mistral-7b", seq: int = 32768,
                    window: int = 4096, n_global: int = 0, batch: int = 1,
                    dtype: str = "bf16") -> WindowCache:
    """A sliding window keeps only the last ``window`` (+ ``n_global``) tokens per layer,
    so the cache stops growing with the context (Mistral 7B: window 4096)."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    kept = min(seq, window + n_global)
    weights = int(count_params(c).total * dtype_bytes(dtype))
    return WindowCache(seq, window, weights, kv_cache_bytes(c, batch, seq, dtype, windows=False),
                       kv_cache_bytes(c, batch, kept, dtype, windows=False))
