"""A server's KV-cache pool after its profiling run (labkit.training.serving): the weights are
the model's bytes, the profile is what real tensors allocate, the blocks are what is left."""
import json

import pytest

import labkit as lk
from labkit.__main__ import main
from labkit.training.serving import profile_forward, rank_shard, size_block_pool
from labkit.transformer.paged import make_cache

TINY = lk.preset("tiny")


def rope_bytes(cfg) -> int:
    """The RoPE tables labkit's model keeps as buffers: cos and sin, (max_seq, rope_dim) fp32."""
    return 2 * cfg.max_seq * cfg.rope_dim * 4


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fake_profile_equals_real_tensors(dtype):
    """Fake tensors (any size) allocate what real CPU tensors do, to the byte."""
    for tokens, seqs in ((512, 8), (300, 7), (64, 256)):
        assert (profile_forward(TINY, tokens, seqs, dtype) ==
                profile_forward(TINY, tokens, seqs, dtype, fake=False))


def test_weights_are_the_parameters_and_rope_tables():
    c = lk.preset("llama-2-13b")
    weights = profile_forward(c, 2048, 256).weights
    assert weights == lk.count_params(c).total * 2 + rope_bytes(c)


def test_peak_holds_the_mlps_three_wide_tensors_and_grows_with_tokens():
    """labkit's SwiGLU holds silu(gate), up and their product, (T, ffn) each, at once; the peak
    is that plus a few (T, hidden) tensors (the sampler's 256 rows come after, smaller)."""
    c = lk.preset("llama-2-13b")
    small, large = (profile_forward(c, t, 256).activations for t in (2048, 8192))
    for tokens, peak in ((2048, small), (8192, large)):
        mlp = 3 * tokens * c.ffn * 2
        assert mlp <= peak <= mlp + 8 * tokens * c.hidden * 2
    assert large == 4 * small          # the peak is in a block, not the sampler: per token


def test_blocks_are_what_the_share_leaves():
    c = lk.preset("llama-2-13b")
    pool = size_block_pool(c, "a100-40gb", 0.9, max_num_batched_tokens=2048, other=2**30)
    per_token = 2 * c.layers * c.kv_heads * c.head_dim * 2          # k and v, fp16/bf16
    assert pool.block_bytes == 16 * per_token
    assert pool.share == int(40 * 2**30 * 0.9)
    left = pool.share - pool.weights - pool.activations - 2**30
    assert pool.blocks == left // pool.block_bytes and pool.tokens == pool.blocks * 16
    assert pool.concurrency(2048) == pool.tokens / 2048
    cache = make_cache("paged", pool.kv_bytes, c, dtype="bf16")       # the simulation's pool
    assert cache.num_blocks == pool.blocks
    fp8 = size_block_pool(c, "a100-40gb", 0.9, max_num_batched_tokens=2048, other=2**30,
                          kv_dtype="fp8-e4m3")
    assert fp8.block_bytes * 2 == pool.block_bytes and fp8.blocks == left // fp8.block_bytes


def test_concurrency_counts_whole_blocks_per_request():
    pool = size_block_pool("llama-2-13b", "a100-40gb", max_num_batched_tokens=2048)
    assert pool.concurrency(1000) == pool.blocks / 63        # 1,000 tokens take 63 blocks
    assert pool.concurrency(2048) == pool.tokens / 2048


def test_tensor_parallel_sampler_sees_the_whole_vocabulary():
    """vLLM all-gathers a shard's logits before sampling: the sampler's fp32 (requests, vocab)
    tensors are the whole model's. Here the sampler sets the peak: its logits in bf16, their
    fp32 copy and the probabilities, 10 bytes per request and token of the vocabulary."""
    c = TINY.replace(vocab_size=32000)
    half = rank_shard(c, 2)
    local, gathered, whole = (profile_forward(m, 64, 64, gathered_vocab=v)
                              for m, v in ((half, None), (half, 32000), (c, None)))
    assert gathered.activations == whole.activations
    assert gathered.activations - local.activations == 10 * 64 * (32000 - 16000)


def test_tensor_parallel_rank_holds_its_share():
    c = lk.preset("llama-2-70b")
    shard = rank_shard(c, 4)
    assert (shard.heads, shard.kv_heads, shard.head_dim, shard.ffn, shard.hidden) == (
        16, 2, 128, 7168, 8192)
    norms = lk.count_params(c).by_component["norms"]
    assert lk.count_params(shard).total == (lk.count_params(c).total - norms) // 4 + norms
    pool = size_block_pool(c, "h100-80gb", tp=4)
    assert pool.block_bytes == 16 * lk.kv_cache_bytes(c, 1, 1, "bf16", tp=4)
    assert rank_shard(lk.preset("llama-3-8b"), 16).kv_heads == 1     # replicated, as vLLM does


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="gpu_memory_utilization is a fraction"):
        size_block_pool(TINY, "a100-40gb", 1.2)
    with pytest.raises(ValueError, match="shard the model"):
        size_block_pool("llama-2-70b", "a100-40gb")
    with pytest.raises(ValueError, match="tp=3 does not divide heads"):
        rank_shard("llama-2-70b", 3)
    with pytest.raises(ValueError, match="exceeds labkit's RoPE tables"):
        profile_forward(TINY, 4096, 1)
    with pytest.raises(ValueError, match="below the 256 one request of 4096 tokens needs"):
        size_block_pool("llama-2-13b", "a100-40gb", 0.69, max_num_batched_tokens=2048,
                        max_model_len=4096)
    assert size_block_pool("llama-2-13b", "a100-40gb", 0.7, max_num_batched_tokens=2048,
                           max_model_len=4096).blocks >= 256
    with pytest.raises(ValueError, match="max_model_len 8192 exceeds"):
        size_block_pool("llama-2-7b", "h100-80gb", max_model_len=8192)
    uneven_kv = TINY.replace(hidden=96, heads=24, kv_heads=8, ffn=192)
    with pytest.raises(ValueError, match="kv_heads 8"):
        rank_shard(uneven_kv, 6)                # 8 kv heads neither split nor copied 6 ways
    with pytest.raises(ValueError, match="other is bytes"):
        size_block_pool(TINY, "a100-40gb", other=-1)


def test_command_line(capsys):
    assert main(["serve", "--model", "llama-2-70b", "--gpu", "h100-80gb", "--tp", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["blocks"] == size_block_pool("llama-2-70b", "h100-80gb", tp=4).blocks
    assert out["concurrency"] == out["tokens"] / lk.preset("llama-2-70b").max_seq
    assert main(["serve", "--model", "llama-2-13b", "--gpu", "a100-40gb"]) == 0
    assert "KV-cache pool" in capsys.readouterr().out
    assert main(["serve", "--model", "llama-2-70b", "--gpu", "h100-80gb", "--tp", "3"]) == 2
    assert "--tp 3 does not divide" in capsys.readouterr().err
