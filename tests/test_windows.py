"""Sliding-window layers (Mistral, Gemma 2/3): the band they attend to, as transformers runs it
through SDPA from seq = window on, and the estimate's bytes for it against measured steps."""
import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.transformer.attention import tiled_attention
from labkit.transformer.model import attention_core, document_mask, use_attention, window_mask

# Mistral's shape (every layer windowed) and Gemma 3's (every 2nd layer global, here), small
MISTRAL = lk.ModelConfig(name="mistral-shape", hidden=256, layers=2, heads=4, kv_heads=2,
                         head_dim=64, ffn=768, vocab_size=512, max_seq=1024, sliding_window=256)
GEMMA3 = MISTRAL.replace(name="gemma3-shape", layers=4, global_every=2, norms="sandwich",
                         norm_style="gemma", activation="gelu_tanh", qk_norm=True)


def band_attention(q, k, v, window):
    """The definition: query i sees keys i - window + 1 .. i, every matrix in memory."""
    groups, T = q.shape[1] // k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    sees = band_attention_mask(T, window)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~sees, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("T, window", [(5, 3), (12, 5), (12, 12), (16, 4)])
def test_the_band_is_transformers_sliding_window_mask(T, window):
    masking = pytest.importorskip("transformers.masking_utils")
    i = torch.arange(T)
    theirs = masking.sliding_window_causal_mask_function(window)(0, 0, i[:, None], i[None, :])
    assert torch.equal(window_mask(2, T, window, None), theirs.expand(2, 1, T, T))
    assert torch.equal(band_attention_mask(T, window), theirs)       # the tests' definition


def band_attention_mask(T, window):
    i = torch.arange(T)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)


def qkv(T=12, B=2, H=4, Hkv=2, d=8):
    torch.manual_seed(0)
    return [torch.randn(B, h, T, d, dtype=torch.float64, requires_grad=True)
            for h in (H, Hkv, Hkv)]


@pytest.mark.parametrize("core, block", [("sdpa", 0), ("naive", 0), ("tiled", 2), ("tiled", 3),
                                         ("tiled", 5), ("tiled", 128)])
def test_a_windowed_layer_attends_to_its_band_with_the_gradients_of_the_definition(core, block):
    q, k, v = qkv()
    with use_attention(core):
        out = (tiled_attention(q, k, v, block=block, window=5) if core == "tiled" else
               attention_core(q, k, v, window=5))
    ref = band_attention(q, k, v, 5)
    assert torch.allclose(out, ref, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert all(torch.allclose(g, e, atol=1e-12) for g, e in zip(grads, expected))


def test_below_the_window_a_layer_is_plain_causal_attention():
    q, k, v = qkv(T=12)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(attention_core(q, k, v, window=13), causal)
    at_window = attention_core(q, k, v, window=12)             # a mask, as transformers'
    assert torch.allclose(at_window, causal, atol=1e-12)
    assert at_window.grad_fn._saved_attn_mask.shape == (2, 1, 12, 12)


def test_past_the_window_packed_rows_are_refused():
    q, k, v = qkv(T=12)
    mask = document_mask(torch.zeros(2, 12, dtype=torch.long), torch.float64)
    with pytest.raises(ValueError, match="packed rows"):
        attention_core(q, k, v, mask, window=5)


def test_every_global_every_th_layer_attends_to_all():
    assert [GEMMA3.window_of(i) for i in range(4)] == [256, 0, 256, 0]
    assert [MISTRAL.window_of(i) for i in range(2)] == [256, 256]
    gemma = lk.preset("gemma-3-1b")                             # 5 local layers, then 1 global
    assert [gemma.window_of(i) for i in range(6)] == [512] * 5 + [0]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed", "bf16-master"])
@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_the_window_adds_the_masks_float_copy_and_repeated_heads_from_seq_equal_window(
        name, precision):
    cfg = {"mistral": MISTRAL, "gemma3": GEMMA3}[name]
    plain = cfg.replace(sliding_window=0, global_every=0)
    per = 4 if precision == "fp32" else 2
    windowed = cfg.windowed_layers
    for seq in (255, 256, 512):
        gap = (lk.estimate(cfg, 2, seq, precision=precision).saved_activations
               - lk.estimate(plain, 2, seq, precision=precision).saved_activations)
        extra = 2 * seq * seq * per + 2 * seq * 2 * (4 - 2) * 64 * per     # mask, k and v
        assert gap == (0 if seq < 256 else pytest.approx(windowed * extra, abs=windowed)), seq


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed", "bf16-master"])
@pytest.mark.parametrize("name, seq", [("mistral", 255), ("mistral", 512), ("gemma3", 512)])
def test_the_estimate_follows_a_windowed_step_measured_on_the_cpu(name, seq, precision,
                                                                  recompute):
    cfg = {"mistral": MISTRAL, "gemma3": GEMMA3}[name]
    m = lk.measure_step(cfg, batch=2, seq=seq, precision=precision, recompute=recompute,
                        fake=False)
    e = lk.estimate(cfg, batch=2, seq=seq, precision=precision, recompute=recompute,
                    device=m.device)
    assert e.saved_activations == pytest.approx(m.saved_activations, rel=0.002)
    assert e.total == pytest.approx(m.total, rel=0.02), (e.moments, m.as_dict())
    assert e.peak_phase == m.peak_phase


def test_one_kv_head_is_repeated_as_a_view_as_transformers_repeats_it():
    cfg = MISTRAL.replace(kv_heads=1)
    gap = (lk.estimate(cfg, 2, 256, precision="fp32").saved_activations
           - lk.estimate(cfg.replace(sliding_window=0), 2, 256, precision="fp32").saved_activations)
    assert gap == cfg.layers * 2 * 256 * 256 * 4                           # the mask's copy only
    m = lk.measure_step(cfg, batch=2, seq=256, precision="fp32", fake=False)
    assert lk.estimate(cfg, 2, 256, precision="fp32", device=m.device).saved_activations == (
        pytest.approx(m.saved_activations, rel=0.002))


def test_context_parallel_refuses_a_row_past_the_window():
    from labkit.parallel.context.context_parallel import cp_loss
    tokens = torch.zeros(1, 256, dtype=torch.long)             # 128 a rank over 2: the row
    with pytest.raises(ValueError, match="no sliding window"):
        cp_loss(lk.build_model(MISTRAL), tokens, tokens, comm=None)
