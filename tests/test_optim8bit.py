"""8-bit AdamW: the dynamic map, blockwise quantisation, the optimizer, its bytes and its loss."""
import math

import pytest
import torch

import labkit as lk
from labkit.quantisation.optim8bit import (BLOCK, LOOKUP_BYTES, MAP_BYTES, AdamW8bit, Codebook,
                                           dequantize_blockwise, dynamic_map, optimizer_state_bytes,
                                           quantize_blockwise, state_bytes, step_temporary_bytes)
from labkit.training.track import MemoryTracker
from labkit.training.train import MasterWeights, compare_with_adamw, make_optimizer


def _bitsandbytes():
    return pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed in .venv")


def _moments(seed=0, n=10_000, signed=True):
    """Moment-like numbers: most tiny, a few large (what blockwise scaling is for)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 6
    return x if signed else x.abs()


# ---- the dynamic map -----------------------------------------------------------------------------
def test_dynamic_maps_hold_256_increasing_values_from_zero_to_one():
    signed, unsigned = dynamic_map(signed=True), dynamic_map(signed=False)
    for code in (signed, unsigned):
        assert code.shape == (256,) and code.dtype == torch.float32
        assert bool((code.diff() > 0).all())                     # sorted, no repeats
        assert code.max() == 1.0 and int((code == 0).sum()) == 1
    assert unsigned.min() == 0.0
    assert -0.9931 < signed.min() < -0.9929          # bitsandbytes' map has +1 but not -1
    positive = signed[signed > 0]
    assert torch.equal(-positive[:-1].flip(0), signed[signed < 0])  # mirrored, but for +1
    # decade 10^-e holds 2^(6-e) signed values (twice as many unsigned): finest near 1
    assert int(((signed >= 0.1) & (signed < 1)).sum()) == 64
    assert int(((unsigned >= 0.1) & (unsigned < 1)).sum()) == 128
    assert int(((signed > 0) & (signed < 1e-5)).sum()) == 1 + 2       # decades 1e-6 and 1e-5


def test_dynamic_maps_equal_bitsandbytes():
    functional = _bitsandbytes().functional
    for signed in (True, False):
        assert torch.equal(dynamic_map(signed), functional.create_dynamic_map(signed=signed))


# ---- nearest value and blockwise quantisation ----------------------------------------------------
@pytest.mark.parametrize("signed", [True, False])
def test_prefix_table_finds_what_bucketize_finds(signed):
    book = Codebook.of(dynamic_map(signed))
    assert book.prefix_table is not None and book.prefix_table.shape == (2 ** 16,)
    normed = _moments(signed=signed, n=200_000)
    normed = normed / normed.abs().max()
    near = book.values.clone()                  # the values, the midpoints and their neighbours
    mids = book.midpoints[:-1]
    edges = torch.cat([near, mids, mids.nextafter(torch.tensor(2.0)),
                       mids.nextafter(torch.tensor(-2.0)), torch.tensor([0.0, -0.0, 1.0])])
    edges = edges[(edges.abs() <= 1) & ((edges >= 0) | signed)]
    for x in (normed, edges):
        assert torch.equal(book.nearest(x), torch.bucketize(x, mids).to(torch.uint8))


def test_a_map_too_dense_for_the_table_falls_back_to_bucketize():
    dense = torch.linspace(0, 1e-3, 256)        # neighbours 4e-6 apart: finer than a prefix
    book = Codebook.of(dense)
    x = torch.rand(1000) * 1e-3
    assert book.prefix_table is None
    assert torch.equal(book.nearest(x), torch.bucketize(x, book.midpoints[:-1]).to(torch.uint8))


def test_blockwise_codes_are_the_nearest_map_value_times_the_block_absmax():
    code = dynamic_map(signed=True)
    x = _moments(n=1000).view(10, 100)                    # 1000 numbers: 3 blocks of 256 + 232
    codes, absmax = quantize_blockwise(x, code, block=256)
    assert codes.dtype == torch.uint8 and codes.shape == (10, 100)
    assert absmax.dtype == torch.float32 and absmax.shape == (math.ceil(1000 / 256),)
    flat = x.reshape(-1)
    for b in range(4):
        assert absmax[b] == flat[b * 256:(b + 1) * 256].abs().max()
    scale = absmax.repeat_interleave(256)[:1000]
    brute = ((flat / scale)[:, None] - code[None]).abs().argmin(dim=1)     # (1000,)
    assert torch.equal(codes.reshape(-1).long(), brute)
    back = dequantize_blockwise(codes, absmax, code, block=256)
    assert torch.equal(back.reshape(-1), code[brute] * scale)
    largest = flat.abs().argmax()                          # the absmax itself comes back exactly
    assert back.reshape(-1)[largest].abs() == flat[largest].abs()


def test_an_all_zero_block_stays_zero():
    codes, absmax = quantize_blockwise(torch.zeros(300), dynamic_map(signed=False), block=256)
    assert torch.equal(absmax, torch.zeros(2))
    assert torch.equal(dequantize_blockwise(codes, absmax, dynamic_map(signed=False)),
                       torch.zeros(300))


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_never_further_than_bitsandbytes_codes(signed):
    """bitsandbytes' CPU quantiser picks the same block scales and map; its search is not
    always the nearest value (it differs on ~1 number in 4 here, mostly tiny ones)."""
    functional = _bitsandbytes().functional
    code = dynamic_map(signed)
    x = _moments(signed=signed, n=25_600)
    codes, absmax = quantize_blockwise(x, code, block=256)
    theirs, quant_state = functional.quantize_blockwise(x, code=code, blocksize=256)
    assert torch.equal(absmax, quant_state.absmax)
    normed = x / absmax.repeat_interleave(256)
    ours_error = (code[codes.long()] - normed).abs()
    their_error = (code[theirs.long()] - normed).abs()
    assert bool((ours_error <= their_error).all())
    assert float((codes == theirs).float().mean()) > 0.7      # measured 0.78 and 0.75


# ---- the optimizer -------------------------------------------------------------------------------
def _run(opt_class, grads, w0, **kwargs):
    w = torch.nn.Parameter(w0.clone())
    opt = opt_class([w], **kwargs)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach(), opt


def _problem(shape=(64, 256), steps=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g),
            [torch.randn(shape, generator=g) * 0.01 for _ in range(steps)])


def test_with_fp32_moments_the_update_is_torch_adamw_bit_for_bit():
    w0, grads = _problem()
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours, opt = _run(AdamW8bit, grads, w0, min_8bit_size=10 ** 9, **kwargs)
    theirs, _ = _run(torch.optim.AdamW, grads, w0, foreach=False, **kwargs)
    assert torch.equal(ours, theirs)
    assert opt.state[next(iter(opt.state))]["m"].dtype == torch.float32


def test_8bit_moments_follow_fp32_adamw_closely():
    w0, grads = _problem(steps=20)
    ours, _ = _run(AdamW8bit, grads, w0, lr=1e-2, weight_decay=0.1)
    theirs, _ = _run(torch.optim.AdamW, grads, w0, lr=1e-2, weight_decay=0.1)
    moved = (theirs - w0).abs().max()                     # ~0.2 after 20 steps of lr 1e-2
    assert (ours - theirs).abs().max() < 0.05 * moved     # measured: 2.4% of the movement


def test_state_is_uint8_codes_and_one_fp32_absmax_per_block():
    big = torch.nn.Parameter(torch.randn(100, 50))        # 5000 numbers >= 4096: 8-bit
    small = torch.nn.Parameter(torch.randn(4095))         # under min_8bit_size: fp32
    opt = AdamW8bit([big, small])
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    opt.step()
    state = opt.state[big]
    assert state["step"] == 1
    assert state["m_codes"].dtype == state["v_codes"].dtype == torch.uint8
    assert state["m_codes"].shape == big.shape
    assert state["m_absmax"].shape == state["v_absmax"].shape == (math.ceil(5000 / BLOCK),)
    assert set(opt.state[small]) == {"step", "m", "v"}
    assert opt.state[small]["v"].dtype == torch.float32


def test_bf16_weights_step_in_fp32_and_stay_bf16():
    w = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    opt = AdamW8bit([w], lr=1e-2, weight_decay=0.0)
    w.grad = torch.ones_like(w)
    opt.step()
    assert w.dtype == torch.bfloat16
    assert torch.allclose(w.float(), torch.full((8192,), 0.99), atol=4e-3)


def test_steps_on_fake_tensors_as_measure_step_runs_them():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    with FakeTensorMode():
        w = torch.nn.Parameter(torch.randn(8192, 4096))    # 32M numbers, no memory
        opt = AdamW8bit([w])
        w.grad = torch.randn_like(w)
        opt.step()
        state = opt.state[w]
    assert isinstance(state["m_codes"], FakeTensor) and state["m_codes"].dtype == torch.uint8
    assert state["v_absmax"].shape == (8192 * 4096 // BLOCK,)


def test_follows_bitsandbytes_adamw8bit():
    bnb = _bitsandbytes()
    w0, grads = _problem(steps=10)
    ours, opt = _run(AdamW8bit, grads, w0, lr=1e-2, weight_decay=0.1)
    theirs, their_opt = _run(bnb.optim.AdamW8bit, grads, w0, lr=1e-2, weight_decay=0.1)
    fp32, _ = _run(torch.optim.AdamW, grads, w0, lr=1e-2, weight_decay=0.1)
    moved = (fp32 - w0).abs().max()
    assert (ours - theirs).abs().max() < 0.1 * moved      # measured ~0.07: their codes differ
    ours_state, their_state = next(iter(opt.state.values())), next(iter(their_opt.state.values()))
    assert torch.allclose(ours_state["m_absmax"], their_state["absmax1"], rtol=0.02)
    assert float((ours_state["v_codes"] == their_state["state2"]).float().mean()) > 0.95


def test_bad_arguments_name_the_fix():
    w = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="betas"):
        AdamW8bit(w, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        AdamW8bit(w, lr=-1)
    with pytest.raises(ValueError, match="block"):
        AdamW8bit(w, block=0)
    with pytest.raises(ValueError, match="256 strictly increasing"):
        Codebook.of(torch.zeros(256))


# ---- bytes ---------------------------------------------------------------------------------------
def test_tracker_counts_codes_absmax_and_maps_as_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(300, 100), torch.nn.Linear(100, 10))
    opt = AdamW8bit(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    # 30000 weights: 8-bit, 118 blocks; 100 + 1000 + 10 numbers: fp32 moments
    expected = 2 * (30_000 + 4 * 118) + 8 * (100 + 1000 + 10) + 2 * 256 * 4
    assert sum(state_bytes(p.numel()) for p in model.parameters()) + 2048 == expected
    assert optimizer_state_bytes(opt) == expected
    with MemoryTracker(model, opt) as mt:                 # the same when a step is measured
        opt.step()
    assert mt.by_category["optimizer"] == expected




def test_small_trains_like_fp32_adamw_with_a_quarter_of_the_state(one_thread):
    result = compare_with_adamw("small", steps=25)
    fp32, eight = result.losses_fp32, result.losses_8bit
    assert fp32[-1] < fp32[0] - 2.0 and eight[-1] < eight[0] - 2.0      # 8.36 -> ~5.6
    assert result.max_loss_difference < 0.01               # measured 0.0012 over 25 steps
    params = 5_048_576                                     # the small preset; 39 tensors
    norms = 9 * 256                                        # under 4096 numbers: fp32 moments
    assert result.state_bytes_fp32 == 8 * params + 4 * 39          # + torch's step tensors
    assert result.state_bytes_8bit == result.expected_bytes_8bit == (
        2 * (params - norms) + 8 * (params - norms) // BLOCK + 8 * norms + 2048)
    assert 3.9 < result.state_bytes_fp32 / result.state_bytes_8bit < 4
    # labkit.estimate counts the codes, block scales, fp32 small tensors and maps exactly
    assert result.estimated_bytes_8bit == result.state_bytes_8bit


# ---- the step's temporaries, make_optimizer and the estimate -------------------------------------
def test_make_optimizer_gives_labkits_adamw8bit():
    w = torch.nn.Parameter(torch.zeros(8192))
    opt = make_optimizer([w], "adamw-8bit", lr=3e-3)
    assert isinstance(opt, AdamW8bit)
    assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["weight_decay"] == 0.1
    wrapped = make_optimizer([w], "adamw-8bit", master_weights=True)
    assert isinstance(wrapped, MasterWeights) and isinstance(wrapped.inner, AdamW8bit)


def test_a_chunked_step_equals_a_whole_one():
    w0, grads = _problem(shape=(5000,), steps=3)           # 19 blocks + a partial one
    whole, _ = _run(AdamW8bit, grads, w0, lr=1e-2)
    chunked, opt = _run(AdamW8bit, grads, w0, lr=1e-2, chunk=4 * BLOCK)   # 5 chunks
    assert torch.equal(whole, chunked)
    with pytest.raises(ValueError, match="multiple of block"):
        AdamW8bit([torch.nn.Parameter(w0)], chunk=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel, chunk", [(100_000, 64 * BLOCK), (70_000, 100 * BLOCK),
                                          (3000, 2 ** 24), (65_536, 2 ** 24)])
def test_step_temporaries_are_a_chunks_worth(dtype, numel, chunk):
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(numel, dtype=dtype))
    opt = AdamW8bit([model.w], chunk=chunk)
    for _ in range(2):                                     # the second step: state exists
        model.w.grad = torch.randn_like(model.w)
        with MemoryTracker(model, opt) as mt:
            opt.step()
    temporaries = mt.peak - mt.current
    assert temporaries == step_temporary_bytes(numel, model.w.element_size(), chunk=chunk)
    if numel >= 4096:                  # 17 bytes a number of a chunk (20 with bf16 weights)
        assert temporaries <= (20 if dtype == torch.bfloat16 else 17.04) * min(numel, chunk)


def _close(measured, estimated, tolerance):
    for name in ("params", "grads", "optimizer", "activations", "weight_cache", "other", "total"):
        m, e = getattr(measured, name), getattr(estimated, name)
        # activations at the optimizer step: 4 B measured, 1,044 B estimated (a scalar's slack)
        assert abs(m - e) <= max(tolerance * e, 1040), (name, m, e)


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_small_step_matches_the_estimate(precision, one_thread):
    measured = lk.measure_step("small", batch=2, seq=64, precision=precision,
                               optimizer="adamw-8bit", fake=False, device="cpu")
    estimated = lk.estimate("small", 2, 64, precision=precision, optimizer="adamw-8bit",
                            device="cpu")
    assert measured.peak_phase == "optimizer"
    _close(measured, estimated, 0.01)
    if precision == "fp32":                # exact: codes, scales, fp32 norms, maps, one chunk
        assert (measured.optimizer, measured.other) == (estimated.optimizer, estimated.other)
        temporaries = estimated.other - LOOKUP_BYTES - 2 * 4096 * 32 * 4      # less RoPE tables
        assert temporaries == 17 * 2 ** 20 + 8 * 2 ** 20 // BLOCK   # the 1M-number embedding
    else:        # MasterWeights does not show the tracker the inner maps (2 KiB + 130 KiB)
        assert estimated.optimizer - measured.optimizer in (0, MAP_BYTES)
        assert estimated.other - measured.other in (0, LOOKUP_BYTES)


@pytest.mark.slow
def test_llama_7b_fake_step_matches_the_estimate():
    """LLaMA-2-7B's shapes with 4 of its 32 identical layers (the whole model was 63 s of the
    slow run: about 500 chunks of 2^24 numbers on fake tensors, twice)."""
    cfg = lk.preset("llama-2-7b", layers=4)
    measured = lk.measure_step(cfg, batch=1, seq=2048, precision="bf16-master",
                               optimizer="adamw-8bit", fake=True)
    estimated = lk.estimate(cfg, 1, 2048, precision="bf16-master", optimizer="adamw-8bit")
    assert measured.peak_phase == "optimizer"
    _close(measured, estimated, 0.03)              # measured: within 0.001% in every category
