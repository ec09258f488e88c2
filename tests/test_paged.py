"""A paged KV cache reserves whole blocks and nothing more, attends exactly like a contiguous
one, and fits more requests in one budget."""
import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.transformer.paged import (CacheFull, ContiguousKVCache, PagedKVCache, Request,
                                      compare_caches, decode_attention, make_cache, request_stream,
                                      simulate)

GEOMETRY = dict(layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
TOKEN_BYTES = 2 * 2 * 2 * 8 * 4          # layers x (k, v) x kv_heads x head_dim x fp32
GiB = 2**30


def kv(T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, 2, 8, generator=g), torch.randn(T, 2, 8, generator=g)


def test_blocks_are_taken_on_demand_and_all_returned_on_free():
    cache = PagedKVCache(num_blocks=8, block_size=4, **GEOMETRY)
    assert cache.block_bytes == 4 * TOKEN_BYTES and cache.capacity_bytes == 8 * 4 * TOKEN_BYTES
    cache.admit("a")
    assert cache.reserved_bytes == cache.used_bytes == 0
    for layer in range(2):
        cache.append("a", layer, *kv(5, layer))                  # 5 tokens -> 2 blocks
    assert cache.tables["a"] == [0, 1]
    assert cache.used_bytes == 5 * TOKEN_BYTES
    assert cache.reserved_bytes == 8 * TOKEN_BYTES
    assert cache.fragmentation_bytes == 3 * TOKEN_BYTES          # the last block's slack
    cache.admit("b")
    cache.grow("b", 9)                                            # 3 blocks, no tensor written
    assert cache.tables["b"] == [2, 3, 4] and len(cache.free_blocks) == 3
    cache.free("a")
    assert cache.reserved_bytes == 3 * 4 * TOKEN_BYTES and cache.used_bytes == 9 * TOKEN_BYTES
    cache.admit("c")
    cache.grow("c", 4)
    assert cache.tables["c"] == [0]                              # a freed block is reused
    with pytest.raises(CacheFull):
        cache.grow("c", 4 * 4 + 1)                                # 5 blocks; 1 held, 4 free
    cache.free("b"), cache.free("c")
    assert sorted(cache.free_blocks) == list(range(8)) and cache.reserved_bytes == 0


def test_contiguous_cache_reserves_max_seq_at_admission():
    cache = ContiguousKVCache(capacity_bytes=2 * 16 * TOKEN_BYTES, max_seq=16, **GEOMETRY)
    cache.admit("a")
    assert cache.reserved_bytes == 16 * TOKEN_BYTES and cache.used_bytes == 0
    cache.grow("a", 3)
    assert cache.fragmentation_bytes == 13 * TOKEN_BYTES
    cache.admit("b")
    assert not cache.can_admit(1)
    with pytest.raises(CacheFull):
        cache.admit("c")
    with pytest.raises(CacheFull):
        cache.grow("a", 14)                                       # 17 > max_seq
    cache.free("a")
    assert cache.can_admit(16) and cache.reserved_bytes == 16 * TOKEN_BYTES


def test_bad_calls_name_the_fix():
    cache = PagedKVCache(4, 4, **GEOMETRY)
    with pytest.raises(ValueError, match="admit it first"):
        cache.append("x", 0, *kv(1, 0))
    cache.admit("x")
    with pytest.raises(ValueError, match="already admitted"):
        cache.admit("x")
    with pytest.raises(ValueError, match=r"\(T_new, 2, 8\)"):
        cache.append("x", 0, torch.zeros(1, 3, 8), torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="layer must be"):
        cache.append("x", 2, *kv(1, 0))
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(0, 4, **GEOMETRY)
    with pytest.raises(ValueError, match="GQA/MHA"):
        make_cache("paged", 2**30, "deepseek-v2-lite")


def test_paged_gather_and_attention_equal_the_contiguous_cache():
    paged = PagedKVCache(num_blocks=16, block_size=4, **GEOMETRY)
    slab = ContiguousKVCache(capacity_bytes=2**20, max_seq=32, **GEOMETRY)
    # two requests interleaved, so their blocks interleave in the pool: prefill, then decode
    steps = [("a", 4), ("b", 3), ("a", 1), ("b", 5), ("a", 1), ("b", 1)]
    for cache in (paged, slab):
        cache.admit("a"), cache.admit("b")
        for i, (request, T) in enumerate(steps):
            for layer in range(2):
                cache.append(request, layer, *kv(T, 10 * i + layer))
    assert paged.tables["a"] == [0, 2] and paged.tables["b"] == [1, 3, 4]      # interleaved
    g = torch.Generator().manual_seed(0)
    for request, T in (("a", 6), ("b", 9)):
        for layer in range(2):
            for got, want in zip(paged.gather(request, layer), slab.gather(request, layer)):
                assert got.shape == (T, 2, 8) and torch.equal(got, want)
            q = torch.randn(4, 2, 8, generator=g)             # 4 heads over 2 kv heads, 2 new
            out = decode_attention(paged, request, layer, q)
            assert torch.equal(out, decode_attention(slab, request, layer, q))
    # and equal to plain causal attention over the whole sequence, for its last two rows
    k, v = (t.transpose(0, 1)[None] for t in slab.gather("b", 1))   # (1, 2, 9, 8)
    q = torch.randn(1, 4, 9, 8, generator=g)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0]
    torch.testing.assert_close(decode_attention(paged, "b", 1, q[0, :, -2:]), full[:, -2:],
                               atol=1e-6, rtol=0)


def test_request_stream_is_seeded_with_the_papers_means():
    stream = request_stream(2000, seed=1)
    assert stream == request_stream(2000, seed=1) and stream != request_stream(2000, seed=2)
    assert all(r.prompt >= 1 and r.output >= 1 and r.prompt + r.output <= 2048 for r in stream)
    assert sum(r.prompt for r in stream) / 2000 == pytest.approx(161.31, rel=0.1)
    assert sum(r.output for r in stream) / 2000 == pytest.approx(337.99, rel=0.1)
    short = request_stream(500, seed=1, dataset="alpaca", max_seq=64)
    assert max(r.prompt + r.output for r in short) <= 64
    with pytest.raises(ValueError, match="sharegpt"):
        request_stream(5, dataset="wiki")


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_simulation_never_exceeds_its_budget_and_finishes_every_request(kind):
    stream = request_stream(60, seed=0, max_seq=512)
    budget = 3000 * 819200                                   # 3000 tokens of LLaMA-2-13B, fp16
    sim = simulate(kind, budget, stream, max_seq=512, block_size=16)
    assert sim.finished == 60
    assert all(u <= r <= budget for u, r in zip(sim.timeline["used"], sim.timeline["reserved"]))
    assert sim.peak_used <= sim.peak_reserved <= budget and 0 < sim.utilisation <= 1
    if kind == "contiguous":                                  # 3000 // 512 slabs fit
        assert sim.max_running == 5 and sim.preempted == 0
        assert sim.peak_reserved == 5 * 512 * 819200
    else:                                                     # waste: < 1 block per request
        waste = [r - u for u, r in zip(sim.timeline["used"], sim.timeline["reserved"])]
        assert all(w < 16 * 819200 * max(1, n) for w, n in zip(waste, sim.timeline["running"]))


def test_paged_cache_fits_more_requests_in_the_same_budget():
    sims = compare_caches(3000 * 819200, request_stream(60, seed=0, max_seq=512), max_seq=512)
    paged, slab = sims["paged"], sims["contiguous"]
    assert paged.max_running > 2 * slab.max_running
    assert paged.utilisation > 0.9 > 0.5 > slab.utilisation
    assert paged.steps < slab.steps


def test_simulation_rejects_a_request_no_empty_cache_holds():
    with pytest.raises(ValueError, match="raise the budget"):
        simulate("paged", 100 * 819200, [Request(0, 90, 20)], block_size=16)


def test_a_preempted_request_is_prefilled_again_with_the_tokens_it_had():
    # two requests of 1 + 40 tokens in 4 blocks of 16: both are admitted, the cache runs out
    # when the older needs its 33rd token, and the newer goes back to the queue holding
    # 1 + 31 tokens, which it prefills again when it returns
    stream = [Request(0, 1, 40), Request(1, 1, 40)]
    sim = simulate("paged", 4 * 16 * 819200, stream, max_seq=64, block_size=16, watermark=0.0)
    assert sim.finished == 2 and sim.preempted == 1 and sim.recomputed == 1 + 31


def test_a_shared_prefix_is_held_once_and_freed_with_its_last_holder():
    cache = PagedKVCache(num_blocks=8, block_size=4, **GEOMETRY)
    cache.admit("a")
    for layer in range(2):
        cache.append("a", layer, *kv(10, layer))            # 2 full blocks and a partial one
    assert cache.share("a", "b", 9) == 8                    # the full blocks of 9 tokens only
    assert cache.tables["b"] == cache.tables["a"][:2] and cache.refs[:3] == [2, 2, 1]
    assert cache.used_bytes == 10 * TOKEN_BYTES             # the shared tokens once
    for layer in range(2):
        cache.append("b", layer, *kv(3, layer + 7))         # b's own tokens: a block of its own
    assert cache.tables["b"][2] not in cache.tables["a"] and cache.copies == 0
    for layer in range(2):                                  # b reads the prefix a wrote
        assert torch.equal(cache.gather("b", layer)[0][:8], cache.gather("a", layer)[0][:8])
    assert cache.used_bytes == 13 * TOKEN_BYTES and cache.reserved_bytes == 4 * 4 * TOKEN_BYTES
    cache.free("a")
    assert cache.used_bytes == 11 * TOKEN_BYTES and len(cache.free_blocks) == 5
    cache.free("b")
    assert sorted(cache.free_blocks) == list(range(8)) and cache.used_bytes == 0


def test_a_fork_copies_its_shared_last_block_on_the_first_write():
    cache = PagedKVCache(num_blocks=8, block_size=4, **GEOMETRY)
    cache.admit("a")
    for layer in range(2):
        cache.append("a", layer, *kv(6, layer))
    cache.fork("a", "b")                                    # parallel sampling: all 2 blocks
    assert cache.tables["b"] == cache.tables["a"] and cache.used_bytes == 6 * TOKEN_BYTES
    assert cache.can_hold("b", 7) and not PagedKVCache(2, 4, **GEOMETRY).can_hold(None, 9)
    for layer in range(2):
        cache.append("b", layer, *kv(1, 5))                 # the partial block is copied first
    assert cache.copies == 1 and cache.tables["b"][0] == cache.tables["a"][0]
    assert cache.tables["b"][1] != cache.tables["a"][1]
    for layer in range(2):
        assert torch.equal(cache.gather("b", layer)[0][:6], cache.gather("a", layer)[0])
        assert not torch.equal(cache.gather("b", layer)[0][6], cache.gather("a", layer)[0][5])
    assert cache.used_bytes == (6 + 2 + 1) * TOKEN_BYTES   # block 0 once, 2 copied, 1 new
    for layer in range(2):
        cache.append("a", layer, *kv(1, 9))                 # a's block is its own again
    assert cache.copies == 1
    cache.free("a"), cache.free("b")
    assert sorted(cache.free_blocks) == list(range(8)) and cache.used_bytes == 0


def test_a_cache_out_of_blocks_refuses_the_copy_it_needs():
    cache = PagedKVCache(num_blocks=2, block_size=4, **GEOMETRY)
    cache.admit("a")
    cache.grow("a", 6)
    cache.fork("a", "b")
    assert not cache.can_hold("b", 7)                       # its copy needs a third block
    with pytest.raises(CacheFull):
        cache.grow("b", 1)


def test_prefix_caching_runs_more_requests_at_once_on_the_same_budget():
    stream = request_stream(60, seed=0)
    plain, cached = (simulate("paged", 2 * GiB, stream, prefix=512, prefix_caching=caching)
                     for caching in (False, True))
    assert plain.finished == cached.finished == 60
    assert cached.mean_running > plain.mean_running and cached.steps < plain.steps
    with pytest.raises(ValueError, match="kind='paged'"):
        simulate("contiguous", 2 * GiB, stream, prefix=16, prefix_caching=True)


def test_a_request_part_way_through_a_step_is_neither_shared_nor_forked():
    cache = PagedKVCache(num_blocks=8, block_size=4, **GEOMETRY)
    cache.admit("a")
    cache.append("a", 0, *kv(5, 0))                          # layer 1 not yet written
    for share in (lambda: cache.fork("a", "b"), lambda: cache.share("a", "b", 4)):
        with pytest.raises(ValueError, match="part-way through a step"):
            share()


def test_a_preempted_request_prefills_its_system_prompt_again_unless_it_is_shared():
    stream = request_stream(60, seed=0)
    plain, cached = (simulate("paged", 2 * GiB, stream, prefix=512, prefix_caching=caching)
                     for caching in (False, True))
    bare = simulate("paged", 2 * GiB, [Request(r.id, 512 + r.prompt, r.output) for r in stream])
    assert plain.preempted > 0 and plain.recomputed == bare.recomputed    # the prefix is prompt
    # shared, a re-admitted request prefills its own tokens only: on average less than the
    # prefix alone (measured: 16,128 tokens over 64 re-admissions)
    assert cached.preempted > 0 and cached.recomputed < cached.preempted * 512
