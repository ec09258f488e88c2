"""Decoding's roofline (labkit.transformer.decoding): the bytes a decode step reads, weights and
KV cache, exactly; MoE's experts read by a batch; the largest batch that fits."""
import pytest

import labkit as lk
from labkit.core.gpus import GPUS, usable_memory
from labkit.transformer.decoding import decode_step, experts_read, largest_batch


def test_a_dense_step_reads_every_weight_but_the_embedding_and_the_whole_cache():
    n = lk.count_params("llama-2-7b")
    s = decode_step("llama-2-7b", 8, 4096)
    assert s.weight_bytes == 2 * (n.total - n.by_component["embedding"])
    assert s.kv_bytes == lk.kv_cache_bytes("llama-2-7b", 8, 4096) == 8 * 4096 * 32 * 2 * 4096 * 2
    tied = lk.preset("gemma-3-1b")                      # the tied table is the LM head: read whole
    assert decode_step(tied, 1, 512).weight_bytes == 2 * lk.count_params(tied).total


def test_an_moe_batch_reads_the_experts_its_tokens_choose():
    c = lk.preset("deepseek-v2-lite")
    n = lk.count_params(c)
    embedding = n.by_component["embedding"]
    assert experts_read(64, 6, 1) == pytest.approx(6)
    assert decode_step(c, 1, 1024).weight_bytes == pytest.approx(2 * (n.active - embedding), rel=1e-9)
    assert decode_step(c, 4096, 64).weight_bytes == pytest.approx(2 * (n.total - embedding), rel=1e-6)
    reads = [decode_step(c, b, 1024).weight_bytes for b in (1, 2, 8, 64, 512)]
    assert reads == sorted(reads)


def test_at_batch_one_the_bound_is_the_bandwidth_over_the_bytes():
    s = decode_step("mistral-7b", 1, 4096)
    assert s.intensity < 2                               # FLOPs per byte: far below any GPU's
    assert s.tokens_per_second("h100-80gb") == pytest.approx(3350e9 / s.bytes)
    big = decode_step("mistral-7b", 64, 4096)            # GQA: the cache grows 8x slower than MHA's
    assert big.bytes_per_token < decode_step("llama-2-7b", 64, 4096).bytes_per_token / 2


def test_the_largest_batch_fits_and_one_more_does_not():
    g = GPUS["h100-80gb"]
    for name in ("llama-2-7b", "mistral-7b", "deepseek-v2-lite"):
        b = largest_batch(name, 4096, g)
        stored = 2 * lk.count_params(name).total
        assert stored + lk.kv_cache_bytes(name, b, 4096) <= usable_memory(g)
        assert stored + lk.kv_cache_bytes(name, b + 1, 4096) > usable_memory(g)
    assert largest_batch("llama-2-70b", 4096, "rtx-4090-24gb") == 0      # the weights alone do not fit


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="batch"):
        decode_step("llama-2-7b", 0, 4096)
    with pytest.raises(ValueError, match="unknown GPU"):
        decode_step("llama-2-7b", 1, 4096).tokens_per_second("a200")


def test_attention_reads_a_cached_byte_once_per_query_head_that_shares_it():
    from labkit.transformer.decoding import attention_flops_per_byte
    assert attention_flops_per_byte("llama-2-7b") == 1.0            # MHA: one head per cached head
    assert attention_flops_per_byte("mistral-7b") == 4.0            # 32 query heads on 8
    v3 = lk.preset("deepseek-v3")                                   # 128 heads on one latent
    assert attention_flops_per_byte(v3) == 128 * (576 + 512) / 576


def test_no_batch_passes_the_caches_ceiling_and_bad_counts_are_refused():
    ceiling = decode_step("mistral-7b", 1, 4096).cache_ceiling("a100-80gb")
    rates = [decode_step("mistral-7b", b, 4096).tokens_per_second("a100-80gb") for b in (1, 16, 106, 4096)]
    assert rates == sorted(rates) and rates[-1] < ceiling and rates[2] >= 0.8 * ceiling
    with pytest.raises(ValueError, match="top_k"):
        experts_read(64, 70, 1)
    with pytest.raises(ValueError, match="context"):
        largest_batch("llama-2-7b", 0, "h100-80gb")
