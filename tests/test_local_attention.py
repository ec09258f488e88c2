"""Local + global attention: a dense mask saves no attention memory, FlexAttention computes fewer
tiles, and a sliding window caps the KV cache (claim 19)."""
import pytest
import torch

import labkit as lk

from labkit.training.track import MemoryTracker
from labkit.transformer.attention import core_peak_bytes
from labkit.transformer.local_attention import (attention_memory, banded_naive_saving,
                                                block_density, core_allocator_peak,
                                                flex_attention_memory, local_global_mask,
                                                smallest_batch_saving, window_kv_cache)


def test_local_global_mask_on_a_small_sequence():
    mask = local_global_mask(6, window=2, n_global=1)
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0, 0],
                                   [1, 1, 1, 0, 0, 0],
                                   [1, 0, 1, 1, 0, 0],
                                   [1, 0, 0, 1, 1, 0],
                                   [1, 0, 0, 0, 1, 1]]
    assert torch.equal(local_global_mask(5, window=5, n_global=0),
                       torch.ones(5, 5, dtype=torch.bool).tril())
    tiles = block_density(local_global_mask(512, 128, 4), block=128)
    assert tiles == (1 + 2 + 3 + 3) / 16           # per tile row: diagonal, left, first column
    with pytest.raises(ValueError, match="n_global"):
        local_global_mask(4, 2, -1)


def test_the_mask_builder_makes_no_int64_matrix():
    T = 1024
    with MemoryTracker(timeline=False) as mt:
        mask = local_global_mask(T, window=128, n_global=4)
    assert mask.dtype == torch.bool
    assert mt.peak <= 2 * T * T + 2 * 8 * T      # the mask and one bool temporary, two aranges


def test_a_dense_mask_saves_no_attention_memory(one_thread):
    T = 512
    m = attention_memory(T=T, window=64, n_global=4, heads=2, head_dim=16)
    assert m.mask_bytes == T * T                              # the model's bool mask, apart
    assert 0.2 < m.density < 0.3                             # ~75% of the scores are skipped...
    assert m.local_global > m.full                           # ...and memory goes up, not down
    # SDPA (CPU) adds an fp32 additive copy of the mask, 4 T^2, kept through its backward kernel
    assert m.added_by_the_mask == m.additive_mask_bytes == 4 * T * T
    unit, rows = 2 * T * 16 * 4, 2 * T * 4                   # one (H, T, d) tensor, one (H, T) row
    assert m.local_global == m.additive_mask_bytes + 4 * unit + rows   # + out, dq, dk, dv, lse


def test_a_float_mask_built_once_is_not_copied(one_thread):
    T = 512
    m = attention_memory(T=T, window=64, n_global=4, heads=2, head_dim=16)
    assert m.float_mask == m.full                            # no (T, T) tensor beyond the mask
    assert m.local_global > m.float_mask + m.additive_mask_bytes // 2   # the bool mask's copy


def test_the_allocator_sees_sdpas_scratch_the_tracker_does_not(one_thread):
    n = 512
    tiled, sdpa = core_allocator_peak("tiled", n), core_allocator_peak("sdpa", n)
    assert abs(tiled - core_peak_bytes("tiled", n)) < 1024   # tensors only: the same count
    assert sdpa > core_peak_bytes("sdpa", n)                  # + the fused kernel's scratch


def test_a_banded_kernel_is_measured_against_the_whole_matrix_naive_attention_keeps():
    T, window, n_global = 4096, 512, 4
    b = banded_naive_saving("llama-2-7b", T, window, n_global)
    # window pairs per row (fewer in the first rows) + the global tokens left of each window
    band = sum(min(i + 1, window) + min(n_global, max(0, i + 1 - window)) for i in range(T))
    assert b.band_pairs == band == 1_980_666
    assert b.of_matrix == band / T**2 and b.of_causal == 2 * b.of_matrix * T / (T + 1)
    assert round(b.matrix_saving, 3) == 0.882 and round(b.of_causal, 2) == 0.24
    c = lk.preset("llama-2-7b")
    naive, sdpa = (lk.estimate(c, 1, T, precision="bf16-mixed", attention=a).saved_activations
                   for a in ("naive", "sdpa"))
    assert b.probabilities == naive - sdpa + c.layers * c.heads * T * 4   # + SDPA's log-sum-exp
    assert b.saved == naive and round(b.saved_saving, 2) == 0.68


def test_sdpas_math_backend_computes_bf16_attention_in_fp32(one_thread):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    H, n, d = 8, 256, 64
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()    # the default
    with sdpa_kernel(SDPBackend.MATH):
        default = core_peak_bytes("sdpa", n, dtype=torch.bfloat16)
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
        try:
            reduced = core_peak_bytes("sdpa", n, dtype=torch.bfloat16)
        finally:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
    # three (H, N, N) matrices at the backward's peak (P kept, dP, dS) in fp32 by default, and
    # 14 B per (H, N, d) number: fp32 q and k kept, fp32 dv, the bf16 output
    assert default == 3 * H * n * n * 4 + 14 * H * n * d
    assert reduced == 3 * H * n * n * 2 + 8 * H * n * d      # all in bf16 once allowed


def test_a_sliding_window_caps_mistrals_kv_cache():
    w = window_kv_cache("mistral-7b", seq=32768, window=4096)
    assert w.full_cache == 32768 * 32 * 2 * 8 * 128 * 2 == 4 * 2**30
    assert w.window_cache == 2**29 and w.cache_saving == 0.875
    assert w.weights == lk.count_params(lk.preset("mistral-7b")).total * 2
    assert 0 < w.total_saving < w.cache_saving
    assert window_kv_cache("mistral-7b", seq=2048, window=4096).cache_saving == 0


def test_a_windows_30_percent_needs_a_batch_that_grows_as_the_context_shrinks():
    first = {seq: smallest_batch_saving("mistral-7b", seq, 4096, 0.30) for seq in
             (4096, 8192, 16384, 32768)}
    assert first == {4096: None, 8192: 21, 16384: 5, 32768: 2}   # 4096: the window is the context
    for seq, b in first.items():
        if b is not None:
            assert window_kv_cache("mistral-7b", seq, 4096, batch=b).total_saving >= 0.30
            assert window_kv_cache("mistral-7b", seq, 4096, batch=b - 1).total_saving < 0.30


@pytest.mark.slow
def test_flex_attention_compiles_a_forward_on_this_build():
    f = flex_attention_memory(T=1024, window=128, n_global=4, heads=2, head_dim=16)
    assert f.works and f.forward_peak > 0 and f.full_forward_peak > 0
