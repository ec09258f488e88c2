"""Each quantiser's round trip, 4-bit packing, the NF4 codebook (QLoRA's published values),
exact bits per parameter, LLM.int8()'s outlier split, QuantLinear and LoRALinear."""
import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from labkit.quantisation.precision import outlier_activations
from labkit.quantisation.quant import (GRANULARITIES, SCHEMES, LoRALinear, QuantLinear, dequantize,
                                       int8_matmul, int8_matmul_with_outliers, nf4_bits_per_param,
                                       nf4_codebook, pack_4bit, quantize_int8, quantize_nf4,
                                       unpack_4bit)

torch.set_num_threads(1)

# bitsandbytes' NF4 table (functional.py, get_4bit_type("nf4")), as the QLoRA paper lists it
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def weight(rows=256, cols=256, std=0.02, seed=0):
    """An N(0, std) weight, the shape of a freshly initialised linear layer."""
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * std


def rel_error(approx, exact):
    return ((approx.double() - exact.double()).norm() / exact.double().norm()).item()


# ----------------------------------------------------------------------------- int8

@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_int8_round_trip_is_within_half_a_step_of_every_value(scheme, granularity):
    w = weight(64, 128)
    q = quantize_int8(w, scheme, granularity, block=64)
    back = dequantize(q)
    step = q.scales.repeat_interleave(q.block).reshape(w.shape)             # each value's scale
    assert back.shape == w.shape and back.dtype == torch.float32
    assert ((back - w).abs() <= step / 2 + 1e-7).all()
    assert q.codes.dtype == (torch.int8 if scheme == "absmax" else torch.uint8)
    groups = {"tensor": 1, "channel": 64, "block": 64 * 128 // 64}[granularity]
    per_group = 4 + (scheme == "zero-point")                                # fp32 scale (+ uint8 z)
    assert q.nbytes == w.numel() + groups * per_group


def test_finer_scales_cut_the_int8_error():
    w = weight() * torch.logspace(-1, 1, 256)[:, None]       # rows of very different magnitude
    errors = [rel_error(dequantize(quantize_int8(w, "absmax", g)), w) for g in GRANULARITIES]
    assert errors[0] > 3 * errors[1] > 3 * errors[2]                        # tensor, channel, block


def test_absmax_keeps_zero_exact_and_zero_point_doubles_resolution_on_one_signed_values():
    x = torch.relu(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)))
    absmax, zero_point = quantize_int8(x, "absmax"), quantize_int8(x, "zero-point")
    assert (dequantize(absmax)[x == 0] == 0).all()
    assert zero_point.zero_points.item() == 0          # range [0, max]: all 256 codes used
    assert rel_error(dequantize(zero_point), x) < 0.6 * rel_error(dequantize(absmax), x)


def test_an_all_zero_group_round_trips_to_zero():
    w = weight(4, 64)
    w[1] = 0
    for scheme in SCHEMES:
        assert (dequantize(quantize_int8(w, scheme, "channel"))[1] == 0).all()
    assert (dequantize(quantize_nf4(w, double_quant=False))[1] == 0).all()


# ----------------------------------------------------------------------------- packing

def test_two_codes_share_a_byte_first_in_the_high_nibble():
    assert pack_4bit(torch.tensor([1, 2, 15, 0])).tolist() == [0x12, 0xF0]
    codes = torch.randint(0, 16, (2 * 999,), generator=torch.Generator().manual_seed(0))
    packed = pack_4bit(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 999
    assert torch.equal(unpack_4bit(packed), codes.to(torch.uint8))


def test_packing_refuses_odd_lengths_and_codes_above_15():
    with pytest.raises(ValueError, match="even number"):
        pack_4bit(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="0..15"):
        pack_4bit(torch.tensor([1, 16]))
    with pytest.raises(ValueError, match="uint8"):
        unpack_4bit(torch.tensor([1, 2]))


# ----------------------------------------------------------------------------- NF4

def test_nf4_codebook_derived_from_normal_quantiles_equals_the_published_values():
    levels = nf4_codebook()
    assert levels.shape == (16,) and torch.equal(levels, levels.sort().values)
    assert (levels - torch.tensor(PUBLISHED_NF4)).abs().max().item() <= 1e-6
    assert levels[7] == 0 and levels[0] == -1 and levels[-1] == 1
    assert ((levels > 0).sum(), (levels < 0).sum()) == (8, 7)


def test_nf4_stores_each_value_as_its_nearest_level_times_the_block_absmax():
    w = weight(32, 64)
    q = quantize_nf4(w, double_quant=False)
    blocks = w.reshape(-1, 64)
    assert torch.equal(q.scales, blocks.abs().amax(dim=1))
    normalised = (blocks / q.scales[:, None]).reshape(-1, 1)
    distance = (normalised - nf4_codebook()).abs()                          # (N, 16)
    chosen = distance.gather(1, unpack_4bit(q.codes).long()[:, None])
    assert torch.allclose(chosen[:, 0], distance.min(dim=1).values, atol=1e-7)
    assert torch.allclose(dequantize(q), w, atol=0.2 * w.abs().max().item())


def test_nf4_bits_per_parameter_are_exact_with_and_without_double_quantisation():
    w = weight(128, 128)                                                    # 256 blocks of 64
    n = w.numel()
    plain, double = quantize_nf4(w, double_quant=False), quantize_nf4(w)
    assert Fraction(8 * plain.nbytes, n) == 4 + Fraction(32, 64) == 4.5
    # 8-bit codes per block, one fp32 per 256 blocks, one fp32 mean per tensor
    assert Fraction(8 * double.nbytes, n) == 4 + Fraction(8, 64) + Fraction(32, 64 * 256) \
        + Fraction(32, n)
    assert Fraction(nf4_bits_per_param()) == 4 + Fraction(8, 64) + Fraction(32, 64 * 256)
    assert round(nf4_bits_per_param() - 4, 3) == 0.127                     # QLoRA's overhead
    assert nf4_bits_per_param(double_quant=False) == plain.bits_per_param == 4.5
    assert plain.codes.numel() == n // 2                                    # two codes a byte


def test_double_quantisation_keeps_scales_within_half_an_int8_step():
    w = weight(256, 256)
    plain, double = quantize_nf4(w, double_quant=False), quantize_nf4(w)
    assert torch.equal(double.scales_mean, plain.scales.mean())  # centred: both signs of int8
    scales = dequantize(double.scales) + double.scales_mean
    step = double.scales.scales.repeat_interleave(256)
    assert ((scales - plain.scales).abs() <= step / 2 + 1e-8).all()
    # measured: 9.20% without and with double quantisation on N(0, 0.02)
    e_plain, e_double = rel_error(dequantize(plain), w), rel_error(dequantize(double), w)
    assert e_plain < 0.095 and abs(e_double - e_plain) < 0.01 * e_plain


def test_quantisers_name_the_fix_for_bad_input():
    w = weight(4, 40)                                                       # 160 values
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int8(w, granularity="block", block=64)
    with pytest.raises(ValueError, match="unknown scheme"):
        quantize_int8(w, scheme="int4")
    with pytest.raises(ValueError, match="unknown granularity"):
        quantize_int8(w, granularity="row")
    with pytest.raises(ValueError, match="2 or more dimensions"):
        quantize_int8(w.flatten(), granularity="channel")
    with pytest.raises(ValueError, match="dq_block"):
        quantize_nf4(weight(64, 64))                                        # 64 scales < 256
    assert quantize_nf4(weight(64, 64), dq_block=64).bits_per_param > 4.127
    with pytest.raises(ValueError, match="even number"):
        quantize_nf4(torch.randn(3, 3), block=9, double_quant=False)
    with pytest.raises(ValueError, match="block must be a positive integer"):
        quantize_nf4(w, block=0)


# ----------------------------------------------------------------------------- LLM.int8()

def test_int8_matmul_is_exact_in_int32():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (33, 96), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (96, 40), generator=g, dtype=torch.int8)
    out = int8_matmul(a, b)
    assert out.dtype == torch.int32 and torch.equal(out.long(), a.long() @ b.long())


def test_outlier_decomposition_is_far_more_accurate_on_activations_with_outlier_features():
    x = outlier_activations((64, 256), n_outliers=4, scale=100.0)      # 4 features of 10..100
    w = weight(128, 256)
    exact = x.double() @ w.double().T
    split, plain = int8_matmul_with_outliers(x, w), int8_matmul_with_outliers(x, w, math.inf)
    assert (split.n_outliers, plain.n_outliers) == (4, 0)
    # measured: 0.13% with the split, 3.2% without
    assert rel_error(split.out, exact) < rel_error(plain.out, exact) / 10


def test_without_outliers_the_split_is_plain_vector_wise_int8():
    x, w = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(2)), weight(64, 256)
    x = x.clamp(-5.9, 5.9)
    split, plain = int8_matmul_with_outliers(x, w), int8_matmul_with_outliers(x, w, math.inf)
    assert split.n_outliers == 0 and split.out.shape == (2, 16, 64)
    assert torch.equal(split.out, plain.out)
    assert rel_error(plain.out, x @ w.T) < 0.02                             # measured: 1.0%
    with pytest.raises(ValueError, match="transpose"):
        int8_matmul_with_outliers(x, w.T)
    with pytest.raises(ValueError, match="6.0"):
        int8_matmul_with_outliers(x, w, threshold=0)


# ----------------------------------------------------------------------------- layers

def linear(in_features=256, out_features=128, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


@pytest.mark.parametrize("double_quant", [False, True])
def test_quant_linear_stores_half_a_byte_per_weight_plus_scales(double_quant):
    fp = linear()
    layer = QuantLinear(fp, double_quant=double_quant)
    n, blocks = 128 * 256, 128 * 256 // 64
    scale_bytes = blocks + 4 * (blocks // 256) + 4 if double_quant else 4 * blocks
    assert layer.nbytes == n // 2 + scale_bytes + 4 * 128                   # + the fp32 bias
    assert not any(p.requires_grad for p in layer.parameters())     # frozen, as Params4bit
    assert sum(_nbytes(t) for t in layer.state_dict().values()) == layer.nbytes
    assert layer.codes.dtype == torch.uint8 and layer.codes.numel() == n // 2


def _nbytes(t):
    return t.numel() * t.element_size()


def test_quant_linear_output_is_close_to_the_float_layer_and_passes_input_gradients():
    fp = linear()
    layer = QuantLinear(fp)
    x = torch.randn(4, 8, 256, requires_grad=True)
    y = layer(x)
    w = dequantize(quantize_nf4(fp.weight))
    assert torch.equal(y, nn.functional.linear(x, w, fp.bias))
    # measured: 9.0% relative error on the output (the NF4 weight error carries over)
    assert rel_error(y.detach(), fp(x).detach()) < 0.12
    y.sum().backward()
    assert torch.allclose(x.grad, w.sum(dim=0).expand_as(x), atol=1e-5)
    assert layer(x.detach().bfloat16()).dtype == torch.bfloat16


def test_quant_linear_keeps_no_dequantised_weight_for_backward():
    """Backward dequantises the codes again: autograd saves nothing of the layer (F.linear on
    the dequantised weight would keep a whole float copy of it per layer until backward)."""
    layer, x = QuantLinear(linear()), torch.randn(4, 256, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t,
                                                  lambda t: t):
        layer(x).sum().backward()
    assert saved == []
    w = dequantize(layer.quantized())
    assert torch.allclose(x.grad, w.sum(dim=0).expand_as(x), atol=1e-5)


def test_lora_starts_as_its_base_and_trains_only_a_and_b():
    base = linear()
    lora = LoRALinear(base, r=8, alpha=16)
    x = torch.randn(4, 256)
    assert torch.equal(lora(x), base(x))
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == 8 * (256 + 128)
    lora(x).pow(2).sum().backward()
    assert base.weight.grad is None and base.bias.grad is None
    assert lora.A.grad is not None and lora.B.grad is not None


def test_lora_update_is_scaled_by_alpha_over_r_and_merges_into_the_base():
    base = linear()
    lora = LoRALinear(base, r=4, alpha=2)
    nn.init.normal_(lora.B)
    x = torch.randn(4, 256)
    update = 0.5 * (x @ lora.A.T @ lora.B.T)
    assert torch.allclose(lora(x) - base(x), update, atol=1e-5)
    merged = lora.merge()
    assert isinstance(merged, nn.Linear) and torch.allclose(merged(x), lora(x), atol=1e-5)


def test_qlora_trains_adapters_over_a_quantised_base():
    lora = LoRALinear(QuantLinear(linear()), r=8, alpha=8, dropout=0.1)
    x = torch.randn(4, 256, requires_grad=True)
    lora(x).sum().backward()
    assert [name for name, p in lora.named_parameters() if p.grad is not None] == ["A", "B"]
    assert x.grad is not None and x.grad.shape == x.shape
    with pytest.raises(ValueError, match="dequantise"):
        lora.merge()


def test_lora_names_the_fix_for_bad_arguments():
    with pytest.raises(ValueError, match="r must be a positive integer"):
        LoRALinear(linear(), r=0, alpha=8)
    with pytest.raises(ValueError, match="alpha"):
        LoRALinear(linear(), r=8, alpha=0)
    with pytest.raises(ValueError, match="dropout"):
        LoRALinear(linear(), r=8, alpha=8, dropout=1.0)
    with pytest.raises(ValueError, match="nn.Linear"):
        LoRALinear(nn.Conv1d(4, 4, 1), r=8, alpha=8)
    with pytest.raises(ValueError, match="nn.Linear"):
        QuantLinear(nn.Conv1d(4, 4, 1))


# ---- a model's weights in each storage ---------------------------------------------------------

@pytest.mark.parametrize("shape", [(128, 128), (256, 512), (96, 384)])
def test_stored_bytes_equal_what_the_quantisers_store(shape):
    from labkit.quantisation.gptq import rtn_quantize
    from labkit.quantisation.quant import stored_bytes
    w = torch.randn(*shape)
    assert stored_bytes("bf16", *shape) == w.bfloat16().nbytes
    assert stored_bytes("int8 per channel", *shape) == quantize_int8(w, "absmax", "channel").nbytes
    assert stored_bytes("int4 group 128", *shape) == rtn_quantize(w, 4, 128).nbytes
    if w.numel() % (64 * 256) == 0:                          # double quantisation's whole blocks
        assert stored_bytes("nf4", *shape) == quantize_nf4(w).nbytes
    tiles = -(-shape[0] // 128) * -(-shape[1] // 128)
    assert stored_bytes("fp8 block 128", *shape) == shape[0] * shape[1] + 4 * tiles


def test_model_weight_bytes_quantise_the_blocks_matmuls_and_keep_the_rest():
    import labkit as lk
    from labkit.quantisation.quant import model_weight_bytes
    for name in ("llama-2-7b", "deepseek-v2-lite"):
        total = lk.count_params(name).total
        assert model_weight_bytes(name, "bf16").total == 2 * total
        parts = lk.count_params(name).by_component
        kept = sum(parts.get(k, 0) for k in ("embedding", "lm head", "norms", "router"))
        cfg = lk.preset(name)
        if cfg.attention == "mla":                  # the latent's norm gains, in "attention"
            kept += cfg.layers * (cfg.kv_lora_rank + (cfg.q_lora_rank or 0))
        assert model_weight_bytes(name, "nf4").kept == 2 * kept
        assert 4.12 < 8 * model_weight_bytes(name, "nf4").quantised / (total - kept) < 4.13
    with pytest.raises(ValueError, match="storage"):
        model_weight_bytes("llama-2-7b", "int3")
