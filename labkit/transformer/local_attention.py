"""Sliding-window + global-token attention: what it saves, checked four ways (lab 07, claim 19
"sparse (local + global) attention cuts memory 30%"): a dense boolean mask given to SDPA,
FlexAttention's block mask, a banded kernel against naive attention's (T, T) matrices, and the
inference KV cache that a sliding window caps at ``window`` tokens (Mistral 7B's rolling buffer,
Jiang et al., 2023).

``allocator_peak`` and ``core_allocator_peak`` read the CPU allocator (torch.profiler) where the
``MemoryTracker`` cannot look: inside a fused or compiled kernel (its per-thread scratch).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.core.config import ModelConfig, preset
from labkit.core.units import check_positive, dtype_bytes, torch_dtype
from labkit.predict import estimate, kv_cache_bytes
from labkit.predict.layers import count_params
from labkit.training.track import MemoryTracker


def local_global_mask(T: int, window: int, n_global: int) -> torch.Tensor:
    """(T, T) bool, True where query i may see key j: causal, and either one of the last
    ``window`` keys (i - j < window, itself included) or one of the first ``n_global`` tokens."""
    check_positive("T", T)
    check_positive("window", window)
    if not isinstance(n_global, int) or n_global < 0:
        raise ValueError(f"n_global must be an integer >= 0, got {n_global!r}")
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]          # (T, 1), (1, T)
    # compare small aranges, never subtract them: ``i - j`` would be a (T, T) int64 tensor,
    # 8 bytes per pair, where the mask itself is 1
    keep = j > i - window                          # i - j < window: one of the last `window`
    keep |= j < n_global                           # or a global token
    keep &= j <= i                                 # and causal
    return keep                                    # (T, T) bool


def block_density(mask: torch.Tensor, block: int = 128) -> float:
    """Fraction of (block x block) tiles of the mask with any True: the share of the score
    tiles a block-sparse kernel (FlexAttention, block 128) still computes."""
    T = mask.shape[0]
    n = math.ceil(T / block)
    padded = F.pad(mask, (0, n * block - T, 0, n * block - T))
    return padded.view(n, block, n, block).any(dim=3).any(dim=1).float().mean().item()


@dataclass
class AttentionMemory:
    """Peak bytes of one attention forward + backward (SDPA's fused CPU kernel) beyond q, k, v.
    The bool mask is built before the measurement, as a model builds it once per step for all
    its layers, and counted apart (``mask_bytes``); ``density``: kept fraction of the causal
    scores, ``block_density`` per (128 x 128) tile."""

    T: int
    window: int
    n_global: int
    full: int                  # causal, no mask tensor (is_causal=True): fwd + bwd peak
    local_global: int          # the same kernel given the dense (T, T) bool mask
    mask_bytes: int            # the bool mask itself (T^2 bytes), not in local_global
    density: float
    block_density: float
    full_forward: int          # the causal step's peak by the end of its forward pass
    local_global_forward: int  # the masked step's peak by the end of its forward pass
    additive_mask_bytes: int   # T^2 numbers in q's dtype: the additive copy SDPA makes of a bool mask
    float_mask: int = 0        # the same kernel given the mask as an additive float tensor in q's
    #                            dtype, built before (counted apart as the bool mask): not copied

    @property
    def added_by_the_mask(self) -> int:
        """What the masked forward holds beyond the causal one: SDPA's additive copy of the mask."""
        return self.local_global_forward - self.full_forward


def attention_memory(T: int, window: int, n_global: int = 4, heads: int = 8,
                     head_dim: int = 64, dtype=torch.float32) -> AttentionMemory:
    """Measure fwd+bwd peaks of full causal attention and of local + global attention
    through a dense mask, bool and additive float, with the MemoryTracker (q, k, v and the
    masks made before: a model builds its mask once per step for all its layers)."""
    dtype = torch_dtype(dtype)
    q, k, v = (torch.randn(1, heads, T, head_dim, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, heads, T, head_dim, dtype=dtype)
    mask = local_global_mask(T, window, n_global)

    def peaks(mask) -> tuple[int, int]:
        """(fwd+bwd peak, peak by the end of the forward pass), beyond what existed before."""
        with MemoryTracker(timeline=False) as mt:
            if mask is not None:
                mt.tag(mask, "other")        # the model's mask: counted apart, not here
            before = mt.current
            mt.reset_peak()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            forward = mt.peak - before
            out.backward(grad)
            del out
        q.grad = k.grad = v.grad = None
        return mt.peak - before, forward

    (full, full_forward), (masked, masked_forward) = peaks(None), peaks(mask)
    additive = torch.zeros(T, T, dtype=dtype).masked_fill_(~mask, float("-inf"))  # (T, T), q's dtype
    float_masked, _ = peaks(additive)
    causal_pairs = T * (T + 1) // 2
    return AttentionMemory(T, window, n_global, full, masked, mask.nbytes,
                           mask.sum().item() / causal_pairs, block_density(mask), full_forward,
                           masked_forward, T * T * q.element_size(), float_masked)


@dataclass(frozen=True)
class BandedSaving:
    """What a banded kernel would keep of naive attention's probabilities in one training step.
    Naive attention keeps the whole (T, T) matrix per head, upper triangle and masked pairs
    included; a banded kernel would keep the mask's pairs alone."""

    T: int
    window: int
    n_global: int
    band_pairs: int            # (query, key) pairs the local + global mask keeps
    probabilities: int         # bytes naive attention keeps for its (T, T) matrices, every layer
    saved: int                 # the step's saved activations with naive attention (lk.estimate)

    @property
    def of_matrix(self) -> float:
        """The band's share of the T^2 pairs naive attention keeps."""
        return self.band_pairs / self.T ** 2

    @property
    def of_causal(self) -> float:
        """The band's share of the causal pairs (what a causal kernel computes)."""
        return self.band_pairs / (self.T * (self.T + 1) // 2)

    @property
    def matrix_saving(self) -> float:
        """How much smaller the (T x T) term gets: the pairs outside the band."""
        return 1 - self.of_matrix

    @property
    def probability_share(self) -> float:
        """The probabilities' share of the saved activations."""
        return self.probabilities / self.saved

    @property
    def saved_saving(self) -> float:
        """How much smaller the saved activations get."""
        return self.matrix_saving * self.probability_share


def banded_naive_saving(cfg: ModelConfig | str = "llama-2-7b", T: int = 4096, window: int = 512,
                        n_global: int = 4, batch: int = 1) -> BandedSaving:
    """Naive attention under bf16-mixed keeps 6 bytes per (query, key) pair and head in every
    layer (the fp32 softmax and its bf16 copy: ``lk.estimate(..., attention="naive")``'s term)
    for all T^2 pairs; a banded kernel would keep the local + global mask's pairs only."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    band = int(local_global_mask(T, window, n_global).sum())
    probabilities = batch * c.layers * c.heads * T * T * (4 + 2)
    saved = estimate(c, batch, T, precision="bf16-mixed", attention="naive").saved_activations
    return BandedSaving(T, window, n_global, band, probabilities, saved)


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


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 to /dev/null: kineto, the profiler's C++ side, prints a line on
    every start and stop (``USDT: ... profiler_start``) whatever its log level."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def allocator_peak(fn) -> int:
    """Peak bytes the CPU allocator hands out while ``fn`` runs (torch.profiler's memory
    events), beyond what was live before: it sees what no dispatch mode, and so no tracker,
    sees - the scratch a fused kernel allocates inside (SDPA's CPU kernel: more with more
    threads) and what a compiled kernel allocates."""
    from torch.profiler import ProfilerActivity, profile
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def core_allocator_peak(impl: str, seq: int, heads: int = 8, head_dim: int = 64,
                        block: int = 128) -> int:
    """``labkit.transformer.attention.core_peak_bytes`` read from the CPU allocator instead of
    the tracker: one forward + backward of ``impl`` (fp32, CPU), its inputs made before. Equal
    to the tracker's count where the core allocates only tensors (naive, tiled); above it by
    the in-kernel scratch for SDPA, which grows with the number of threads."""
    from labkit.transformer.attention import core, core_inputs
    q, k, v, grad = core_inputs(seq, heads, head_dim)
    return allocator_peak(lambda: core(impl, block)(q, k, v).backward(grad))


def flex_attention_memory(T: int, window: int, n_global: int = 4, heads: int = 8,
                          head_dim: int = 64) -> FlexMemory:
    """Try ``torch.compile(flex_attention)`` with the local + global BlockMask (fp32, no
    grad), time its first call and count its forward's allocator peak (slow: ~15 s compile)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def keep(b, h, q_idx, kv_idx):
        near = q_idx - kv_idx < window
        return (kv_idx <= q_idx) & (near | (kv_idx < n_global))

    q, k, v = (torch.randn(1, heads, T, head_dim) for _ in range(3))
    full = allocator_peak(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    try:
        block_mask = create_block_mask(keep, None, None, T, T, device="cpu")
        # static shapes: a dynamic-shape recompile (a second T) falls back to a kernel that
        # keeps every score, as a compiled call that fails does for all later calls
        compiled = torch.compile(flex_attention, dynamic=False)
        start = time.perf_counter()
        compiled(q, k, v, block_mask=block_mask)
        compile_s = time.perf_counter() - start
        forward = allocator_peak(lambda: compiled(q, k, v, block_mask=block_mask))
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


def smallest_batch_saving(cfg: ModelConfig | str = "mistral-7b", seq: int = 32768,
                          window: int = 4096, share: float = 0.30, max_batch: int = 1024,
                          dtype: str = "bf16") -> int | None:
    """The smallest batch from which a sliding window saves at least ``share`` of the weights +
    KV cache (``window_kv_cache(...).total_saving``; it grows with the batch), or None if no batch
    up to ``max_batch`` does (a context within the window saves nothing)."""
    check_positive("max_batch", max_batch)

    def saving(batch: int) -> float:
        return window_kv_cache(cfg, seq, window, batch=batch, dtype=dtype).total_saving

    if saving(max_batch) < share:
        return None
    low, high = 1, max_batch                  # saving(high) >= share; find the first such batch
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if saving(mid) >= share else (mid + 1, high)
    return low
