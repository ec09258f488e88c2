"""Sliding-window layers (Mistral, Gemma 2/3): the band they attend to, as transformers runs it
through SDPA from seq = window on, and the estimate's bytes for it against measured steps."""
import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.transformer.model import attention_core, document_mask, use_attention

# Mistral's shape (every layer windowed) and Gemma 3's (every 2nd layer global, here), small
MISTRAL = lk.ModelConfig(name="mistral-shape", hidden=256, layers=2, heads=4, kv_heads=2,
                         head_dim=64, ffn=768, vocab_size=512, max_seq=1024, sliding_window=256)
GEMMA3 = MISTRAL.replace(name="gemma3-shape", layers=4, global_every=2, norms="sandwich",
                         norm_style="gemma", activation="gelu_tanh", qk_norm=True)


def band_attention(q, k, v, window):
    """The definition: query i sees keys i - window + 1 .. i, every matrix in memory."""
    groups, T = q.shape[1] // k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    i = torch.arange(T)
    sees = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~sees, float("-inf")).softmax(-1) @ v


def qkv(T=12, B=2, H=4, Hkv=2, d=8):
    torch.manual_seed(0)
    return [torch.randn(B, h, T, d, dtype=torch.float64, requires_grad=True)
            for h in (H, Hkv, Hkv)]


@pytest.mark.parametrize("core", ["sdpa", "naive"])
def test_a_windowed_layer_attends_to_its_band_with_the_gradients_of_the_definition(core):
    q, k, v = qkv()
    with use_attention(core):
        out = attention_core(q, k, v, window=5)
    ref = band_attention(q, k, v, 5)
    assert torch.allclose(out, ref, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert all(torch.allclose(g, e, atol=1e-12) for g, e in zip(grads, expected))


def test_below_the_window_a_layer_is_plain_causal_attention():
    q, k, v = qkv(T=12)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(attention_core(q, k, v, window=13), causal)
    assert torch.allclose(attention_core(q, k, v, window=12), causal, atol=1e-12)  # a mask


def test_past_the_window_the_tiled_core_and_packed_rows_are_refused():
    q, k, v = qkv(T=12)
    with use_attention("tiled"), pytest.raises(ValueError, match="use_attention\\('naive'\\)"):
        attention_core(q, k, v, window=5)
    with use_attention("tiled"):                           # up to the window it is causal
        assert torch.allclose(attention_core(q, k, v, window=12), band_attention(q, k, v, 12))
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
