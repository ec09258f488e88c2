"""An 8-bit KV cache (labkit.transformer.kv_quant): its bytes exactly, each stored number within
half a step of its scale, and generation that stays close to the full-precision cache's."""
import pytest
import torch

import labkit as lk
from labkit.transformer import generate
from labkit.transformer.kv_quant import QuantisedKVCache, dequantise, quantise


def test_its_bytes_are_one_per_number_and_a_scale_per_token_and_head():
    c = lk.preset("tiny")
    cache = QuantisedKVCache(c, 2, 16, fmt="int8")
    per_token = 2 * c.layers * c.kv_heads * (c.head_dim + 4)        # k and v: codes + fp32 scale
    assert cache.nbytes == 2 * 16 * per_token


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_stored_number_comes_back_within_the_formats_step(fmt):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 64) * torch.logspace(-2, 1, 8)[None, None, :, None]   # scales vary
    codes, scale = quantise(x, fmt)
    error = (dequantise(codes, scale, torch.float32) - x).abs()
    if fmt == "int8":                      # rounding to the nearest of 255 levels
        assert (error <= scale / 2 + 1e-6 * x.abs()).all()
    else:                                  # E4M3: 3 mantissa bits, relative step 2^-3 at most
        assert (error <= x.abs() * 2**-4 + scale * 2**-9).all()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_generation_over_it_stays_close_to_the_full_caches(fmt):
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("tiny")).eval()
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        exact = generate.step(model, tokens, generate.new_cache(model, 2, 24)).log_softmax(-1)
        quant = generate.step(model, tokens, QuantisedKVCache(model.cfg, 2, 24, fmt=fmt))
    kl = (exact.exp() * (exact - quant.log_softmax(-1))).sum(-1).mean()
    assert 0 < kl < 1e-3
    assert quant.dtype == torch.float32


def test_a_bad_format_and_an_mla_model_are_refused():
    with pytest.raises(ValueError, match="int8"):
        QuantisedKVCache(lk.preset("tiny"), 1, 8, fmt="int4")
    with pytest.raises(ValueError, match="latent"):
        QuantisedKVCache(lk.preset("tiny-moe"), 1, 8)
