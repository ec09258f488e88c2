"""GPTQ against round-to-nearest: GPTQ's layer outputs are closer on correlated inputs, the two
agree when the Hessian is the identity, stored bytes are exact, and on the trained ``small``
model GPTQ's 4-bit loss is no worse than RTN's."""
import math

import pytest
import torch
from torch import nn

from labkit import build_model, preset
from labkit.quantisation.gptq import (gptq_quantize, layer_inputs, quantize_model, quantize_weight,
                                      rtn_quantize)
from labkit.quantisation.quant import pack_4bit

torch.set_num_threads(1)


def correlated_layer(seed=0, n=1024, features=256, rank=32, out=64):
    """A random weight (out, in) and inputs (n, in) that live near a rank-``rank`` subspace."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(rank, features, generator=g)
    inputs = torch.randn(n, rank, generator=g) @ mixing + 0.1 * torch.randn(n, features,
                                                                            generator=g)
    return torch.randn(out, features, generator=g) * 0.02, inputs


def output_error(weight, approx, inputs):
    return (inputs @ weight.T - inputs @ approx.T).norm().item()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_layer_output_error_is_below_rtn_on_correlated_inputs(seed):
    weight, inputs = correlated_layer(seed)
    gptq, rtn = gptq_quantize(weight, inputs), rtn_quantize(weight)
    # measured: GPTQ's output error is 0.26-0.27 of RTN's; its weight error is larger
    assert output_error(weight, gptq.weight, inputs) < 0.5 * output_error(weight, rtn.weight,
                                                                            inputs)
    assert (weight - gptq.weight).norm() > (weight - rtn.weight).norm()


def test_gptq_with_identity_hessian_is_round_to_nearest():
    weight, _ = correlated_layer()
    inputs = torch.eye(256) * math.sqrt(256 / 2)                # 2 X^T X / N = I exactly
    gptq, rtn = gptq_quantize(weight, inputs), rtn_quantize(weight)
    assert torch.equal(gptq.codes, rtn.codes) and torch.equal(gptq.weight, rtn.weight)
    assert torch.equal(gptq.scales, rtn.scales) and torch.equal(gptq.zeros, rtn.zeros)


@pytest.mark.parametrize("quantize", ["rtn", "gptq"])
def test_codes_scales_and_zeros_rebuild_the_weight_and_bytes_are_exact(quantize):
    weight, inputs = correlated_layer()
    q = rtn_quantize(weight) if quantize == "rtn" else gptq_quantize(weight, inputs)
    groups = q.scales.float().repeat_interleave(64, dim=1), q.zeros.float().repeat_interleave(
        64, dim=1)
    assert torch.equal((q.codes.float() - groups[1]) * groups[0], q.weight)
    assert q.codes.max() <= 15 and q.zeros.max() <= 15 and q.scales.dtype == torch.float16
    packed = pack_4bit(q.codes).numel() + pack_4bit(q.zeros).numel()
    assert q.nbytes == packed + q.scales.nbytes == 64 * 256 // 2 + 64 * 4 * 2 + 64 * 4 // 2
    assert 8 * q.nbytes / weight.numel() == 4 + 16 / 64 + 4 / 64


def test_odd_bit_widths_round_stored_bytes_up():
    weight = torch.randn(3, 64)
    assert rtn_quantize(weight, bits=3, group=64).nbytes == math.ceil(192 * 3 / 8) + 3 * 2 + 2
    assert rtn_quantize(weight, bits=3).codes.max() <= 7


@pytest.mark.parametrize("kwargs", [dict(group=48), dict(bits=1), dict(bits=9), dict(group=0)])
def test_bad_grid_is_a_value_error(kwargs):
    weight, inputs = correlated_layer()
    with pytest.raises(ValueError):
        rtn_quantize(weight, **kwargs)
    with pytest.raises(ValueError):
        gptq_quantize(weight, inputs, **kwargs)


def test_bad_gptq_arguments_are_value_errors():
    weight, inputs = correlated_layer()
    for kwargs in [dict(block=96), dict(damp=0.0)]:
        with pytest.raises(ValueError):
            gptq_quantize(weight, inputs, **kwargs)
    with pytest.raises(ValueError, match="calibration inputs"):
        quantize_weight("gptq int4 g64", weight)
    with pytest.raises(ValueError, match="unknown method"):
        quantize_weight("awq int4", weight)
    with pytest.raises(ValueError, match="features"):
        gptq_quantize(weight, inputs[:, :128])


def test_layer_inputs_are_what_the_layer_receives():
    torch.manual_seed(0)
    model = build_model(preset("tiny")).eval()
    tokens = torch.randint(0, 256, (2, 16))
    block = model.blocks[0]
    expected = block.attn_norm(model.embed(tokens)).reshape(-1, 64)        # (B * T, hidden)
    assert torch.equal(layer_inputs(model, block.attn.wq, tokens), expected)


@pytest.mark.parametrize("method", ["fp32", "rtn int4 g16", "gptq int4 g16"])
def test_quantize_model_counts_every_block_linear_and_leaves_the_original(method):
    torch.manual_seed(0)
    model = build_model(preset("tiny")).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize_model(model, method, torch.randint(0, 256, (4, 16)))
    linears = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    assert q.numel == sum(m.weight.numel() for m in linears)
    assert q.bits_per_param == (32 if method == "fp32" else 4 + 16 / 16 + 4 / 16)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert torch.equal(q.model.lm_head.weight, model.lm_head.weight)   # the head stays fp32
    last = q.model.blocks[1].mlp.w_down.weight
    changed = not torch.equal(last, model.blocks[1].mlp.w_down.weight)
    assert changed == (method != "fp32") and (q.weight_error > 0) == (method != "fp32")


# On a trained model (``trained_small``: `small`, 100 steps), lab 06's checked cell asserts what
# GPTQ is for: its output error below half of RTN's at int4 and int3 g64, its weight error above,
# its held-out loss no higher than RTN's (within 0.001 nats), every scheme within 0.05 nats of
# fp32, the bits a parameter, and training's loss under 2 nats (the browser and papermill runs).
