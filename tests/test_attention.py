"""Naive, tiled and SDPA attention: the same numbers, different memory, and an estimate that
knows which one runs (lab 07)."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.predict.layers import layer_saved
from labkit.transformer.attention import (ATTENTION_IMPLS, SRAM_PER_SM, TiledAttention,
                                          fitted_block, hbm_accesses, hbm_ratio_all_l2_hits,
                                          hbm_ratio_tiles, naive_attention, tiled_attention)
from labkit.transformer.model import build_model, use_attention

SHAPES = [(4, 4, 64, 32),     # heads, kv heads, T, block: multi-head, T a multiple of the block
          (8, 2, 100, 32),    # grouped-query, T not a multiple of the block
          (4, 1, 37, 128)]    # multi-query, one block larger than T


def _qkv(heads, kv_heads, T, d=16, batch=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, T, d, generator=g, dtype=dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


def _output_and_grads(fn, q, k, v):
    y = fn(q, k, v)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    return (y, *torch.autograd.grad(y, (q, k, v), dy))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, kv_heads, T, block", SHAPES)
def test_tiled_equals_naive_forward_and_backward_in_fp32(one_thread, causal, heads, kv_heads,
                                                         T, block):
    q, k, v = _qkv(heads, kv_heads, T)
    naive = _output_and_grads(lambda *t: naive_attention(*t, causal=causal), q, k, v)
    tiled = _output_and_grads(lambda *t: tiled_attention(*t, causal=causal, block=block), q, k, v)
    for a, b in zip(naive, tiled):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_tiled_equals_sdpa(one_thread, causal):
    q, k, v = _qkv(8, 2, 100)
    sdpa = _output_and_grads(lambda *t: F.scaled_dot_product_attention(
        *t, is_causal=causal, enable_gqa=True), q, k, v)
    tiled = _output_and_grads(lambda *t: tiled_attention(*t, causal=causal, block=32), q, k, v)
    for a, b in zip(sdpa, tiled):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


# ---- any shape SDPA takes: leading dims, T_q != T_k, grouped kv heads --------------------------
LEADING = {"(T, d)": ((), ()),                            # q's dims before T, then k's and v's
           "(H, T, d)": ((3,), (3,)),
           "(B, H, T, d) grouped": ((2, 4), (2, 2)),
           "(B, B, H, T, d) multi-query": ((2, 3, 2), (2, 3, 1))}


def _assert_tiled_equals_sdpa_in_fp64(q, k, v, causal: bool, block: int = 128):
    """The output and the gradients of q, k, v, to 1e-12."""
    sdpa = _output_and_grads(lambda *t: F.scaled_dot_product_attention(
        *t, is_causal=causal, enable_gqa=q.dim() > 2), q, k, v)
    tiled = _output_and_grads(lambda *t: tiled_attention(*t, causal=causal, block=block), q, k, v)
    for a, b in zip(sdpa, tiled):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("block", [4, 5])
@pytest.mark.parametrize("keys", ["same", "more", "fewer"])
@pytest.mark.parametrize("Tq", [1, 4, 7, 8, 33])
@pytest.mark.parametrize("leading", LEADING.values(), ids=LEADING.keys())
def test_tiled_equals_sdpa_for_any_shape(one_thread, leading, Tq, keys, block, causal):
    """Causal with T_q != T_k is SDPA's top-left mask (T_q = 1: "fewer" keys is one, as "same")."""
    Tk = {"same": Tq, "more": 2 * Tq + 3, "fewer": (Tq + 1) // 2}[keys]
    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    q_lead, kv_lead = leading
    q, k, v = (torch.randn(*lead, T, d, generator=g, dtype=torch.float64).requires_grad_()
               for lead, T, d in ((q_lead, Tq, 8), (kv_lead, Tk, 8), (kv_lead, Tk, 6)))
    _assert_tiled_equals_sdpa_in_fp64(q, k, v, causal, block)


def test_four_queries_see_all_eight_keys():
    """The key loop once stopped at the number of queries: keys 4..7 were never seen."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64).requires_grad_()
               for T in (4, 8, 8))
    _assert_tiled_equals_sdpa_in_fp64(q, k, v, causal=False)


@pytest.mark.parametrize("q, k, v, fix", [
    ((2, 4, 8, 16), (2, 4, 8, 8), (2, 4, 8, 8), "project them to the same d"),
    ((2, 4, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16), "among the divisors of 4"),
    ((2, 4, 8, 16), (2, 2, 8, 16), (2, 4, 8, 16), "give each key head its value head"),
    ((2, 4, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16), r"to q's leading dims \(2,\)"),
    ((2, 4, 8, 16), (4, 8, 16), (4, 8, 16), "unsqueeze the missing ones"),
    ((16,), (16,), (16,), "unsqueeze the missing ones"),
    ((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 7, 16), "give one value per key"),
    ((2, 4, 8, 16), (2, 4, 0, 16), (2, 4, 0, 16), "give one value per key")])
def test_shapes_the_tiled_core_cannot_take_raise_naming_the_fix(q, k, v, fix):
    with pytest.raises(ValueError, match=fix):
        tiled_attention(torch.zeros(q), torch.zeros(k), torch.zeros(v))


def _saved(fn, *inputs) -> list[torch.Tensor]:
    """The tensors autograd keeps for the backward pass of fn(*inputs)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*inputs)
    return out, saved


def test_tiled_attention_keeps_only_q_k_v_output_and_log_sum_exp():
    q, k, v = _qkv(8, 2, 100)
    out, saved = _saved(lambda *t: TiledAttention.apply(*t, True, 32), q, k, v)
    assert [tuple(t.shape) for t in saved] == [(2, 8, 100, 16), (2, 2, 100, 16), (2, 2, 100, 16),
                                              (2, 8, 100, 16), (2, 8, 100)]
    assert all(a is b for a, b in zip(saved[:3], (q, k, v)))
    assert saved[3].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert saved[4].dtype == torch.float32                          # one log-sum-exp per row


def test_naive_attention_keeps_a_t_by_t_matrix_per_head():
    _, saved = _saved(naive_attention, *_qkv(8, 2, 100))
    assert (2, 8, 100, 100) in [tuple(t.shape) for t in saved]


@pytest.mark.parametrize("dtype, autocast, pair_bytes", [(torch.float32, False, 4),
                                                         (torch.bfloat16, False, 6),
                                                         (torch.bfloat16, True, 6)])
def test_naive_keeps_probabilities_of_4_or_6_bytes_as_the_estimate_says(dtype, autocast,
                                                                       pair_bytes):
    """Against SDPA, to the byte: the probabilities (an fp32 softmax and its bf16 copy from bf16
    scores, as transformers' eager attention), k and v repeated to every head, no log-sum-exp
    (the inputs as the model makes them: bf16 under autocast)."""
    B, H, Hkv, T, d = 1, 4, 2, 64, 16
    kept = {}
    for name, fn in [("naive", naive_attention), ("sdpa", lambda q, k, v: (
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))]:
        leaves = _qkv(H, Hkv, T, d, batch=B, dtype=dtype)
        with lk.MemoryTracker() as mt:
            with torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext():
                q, k, v = (t * 1 for t in leaves)                   # non-leaf, like the model's
                y = fn(q, k, v)
            del q, k, v
            kept[name] = mt.current
        assert y.dtype == dtype
    number = dtype.itemsize
    assert kept["naive"] - kept["sdpa"] == (B * H * T * T * pair_bytes
                                            + 2 * (H - Hkv) * B * T * d * number - 4 * B * H * T)


def test_naive_brings_back_korthikantis_attention_matrix_term():
    """Korthikanti et al. keep 5as^2b bytes of attention matrices per layer (fp16 with
    dropout); the naive core under bf16 autocast keeps 6as^2b (fp32 softmax + its bf16 copy)
    and no log-sum-exp (LLaMA-2-7B: as many kv heads as heads, nothing repeated)."""
    cfg, s, b = lk.preset("llama-2-7b"), 2048, 1
    a = cfg.heads
    naive, sdpa = (layer_saved(cfg, "bf16-mixed", attention=impl).bytes(b, s)
                   for impl in ("naive", "sdpa"))
    assert naive - sdpa == 6 * a * s * s * b - 4 * a * s * b
    tiled = layer_saved(cfg, "bf16-mixed", attention="tiled").bytes(b, s)
    assert tiled == sdpa


@pytest.mark.parametrize("attention", ATTENTION_IMPLS)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_estimate_equals_a_real_step_for_each_attention(one_thread, precision, attention):
    m = lk.measure_step("small", 1, 512, precision=precision, fake=False, attention=attention)
    e = lk.estimate("small", 1, 512, precision=precision, device="cpu", attention=attention)
    assert e.total == pytest.approx(m.total, rel=0.005), (e.moments, m.as_dict())
    assert e.saved_activations == pytest.approx(m.saved_activations, rel=0.005)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_estimate_finds_the_peak_inside_naive_attentions_backward(one_thread, recompute):
    """Where the (T, T) matrices dominate, the step peaks in the softmax's backward: two more
    (B, H, T, T) gradients beside the probabilities."""
    m = lk.measure_step("tiny", 1, 256, precision="bf16-mixed", fake=False,
                        recompute=recompute, attention="naive")
    e = lk.estimate("tiny", 1, 256, precision="bf16-mixed", device="cpu", recompute=recompute,
                    attention="naive")
    assert e.details["peak moment"].startswith("backward: naive attention")
    assert e.total == pytest.approx(m.total, rel=0.005), (e.moments, m.as_dict())


def test_model_gives_the_same_loss_and_gradients_with_each_attention(one_thread):
    cfg = lk.preset("tiny")
    torch.manual_seed(0)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 65))
    results = {}
    for impl in ATTENTION_IMPLS:
        model.zero_grad()
        with use_attention(impl):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        results[impl] = (loss.detach(), *(p.grad.clone() for p in model.parameters()))
    for impl in ("naive", "tiled"):
        for a, b in zip(results["sdpa"], results[impl]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_attention_choices_are_checked_and_named():
    with pytest.raises(ValueError, match="sdpa, naive, tiled"):
        lk.Recipe(attention="flash")
    with pytest.raises(ValueError, match="attention='sdpa'"):
        lk.estimate("small", recompute="selective", attention="naive")
    with pytest.raises(ValueError, match="sdpa, naive, tiled"):
        with use_attention("flash"):
            pass
    cfg = lk.preset("tiny")
    model, tokens = build_model(cfg), torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="packed rows"), use_attention("naive"):
        model(tokens, tokens, doc_ids=torch.zeros(1, 8, dtype=torch.long))


# ---- the FlashAttention paper's HBM accesses --------------------------------------------------
def test_standard_attention_reads_and_writes_4nd_plus_4n_squared_whatever_the_sram():
    n, d = 4096, 64
    assert {hbm_accesses(n, d, m * 1024, "naive") for m in (16, 192, 256)} == {4 * n * d
                                                                               + 4 * n * n}


def test_tiled_accesses_fall_as_the_sram_grows_and_the_saving_grows_with_it():
    n, d = 8192, 128
    sizes = [s.per_sm for s in SRAM_PER_SM.values()] + [16 * 1024, 64 * 1024, 1024 * 1024]
    sizes.sort()
    tiled = [hbm_accesses(n, d, m, "tiled") for m in sizes]
    ratio = [hbm_accesses(n, d, m, "naive") / t for m, t in zip(sizes, tiled)]
    assert tiled == sorted(tiled, reverse=True) and tiled[0] > tiled[-1]
    assert ratio == sorted(ratio) and ratio[-1] > 1
    # with Q, K, V, O and all N x N scores on chip, one pass: FA2 reads Q, K, V and writes O
    # and the log-sum-exp once (4Nd + N); FA1 also reads O, l, m back once (2Nd + 3Nd + 4N)
    everything = (4 * n * d + n * n) * 2
    assert fitted_block(d, everything) == n
    assert hbm_accesses(n, d, everything, "tiled") == 4 * n * d + n
    assert hbm_accesses(n, d, everything, "tiled", loop_order="fa1") == 5 * n * d + 4 * n


def test_fa2s_loop_order_moves_less_than_fa1s_and_the_gain_survives_d_192():
    # an A100's 192 KiB per SM in bf16 is M = 98,304 numbers; the largest square block that
    # holds Q_i, K_j, V_j, O_i and the scores: 4Bd + B^2 <= M
    a100 = SRAM_PER_SM["A100"].per_sm
    assert [fitted_block(d, a100) for d in (64, 128, 192)] == [210, 148, 111]
    assert 4 * 210 * 64 + 210 ** 2 <= 98304 < 4 * 211 * 64 + 211 ** 2
    ratio = {(d, order): hbm_accesses(4096, d, a100, "naive")
             / hbm_accesses(4096, d, a100, "tiled", loop_order=order)
             for d in (64, 128, 192) for order in ("fa1", "fa2")}
    assert [round(ratio[d, "fa2"], 2) for d in (64, 128, 192)] == [6.19, 2.28, 1.18]
    assert [round(ratio[d, "fa1"], 2) for d in (64, 128, 192)] == [4.11, 1.52, 0.79]
    # by hand, d = 192 in 128-row tiles: T_r = 32 passes over K and V
    assert hbm_accesses(4096, 192, a100, "tiled", block=128) == \
        2 * 4096 * 192 + 32 * 2 * 4096 * 192 + 4096
    with pytest.raises(ValueError, match="fa2, fa1"):
        hbm_accesses(4096, 64, a100, "tiled", loop_order="fa3")


def test_128_row_tiles_and_all_l2_hits_bracket_the_ratio_and_both_fall_with_d():
    n, dims = 4096, (64, 128, 192)
    tiles = [hbm_ratio_tiles(n, d) for d in dims]
    l2 = [hbm_ratio_all_l2_hits(n, d) for d in dims]
    assert [round(r, 1) for r in tiles] == [3.9, 2.0, 1.4]               # about 2B / d, B = 128
    assert [round(r, 1) for r in l2] == [64.7, 32.9, 22.3]               # about 1 + N / d
    assert tiles == sorted(tiles, reverse=True) and l2 == sorted(l2, reverse=True)
    for d, r in zip(dims, l2):    # every K, V re-read an L2 hit: Q, K, V read, O and lse written once
        assert r == (4 * n * d + 4 * n * n) / (4 * n * d + n)


def test_deepseek_v2s_narrower_values_count_as_128_wide_not_192():
    n, d, dv, a100 = 4096, 192, 128, SRAM_PER_SM["A100"].per_sm
    for impl, options in (("naive", {}), ("tiled", {"block": 128}), ("tiled", {}),
                          ("tiled", {"loop_order": "fa1"})):     # dv = d: the formulas unchanged
        assert hbm_accesses(n, d, a100, impl, dv=d, **options) == hbm_accesses(n, d, a100, impl,
                                                                               **options)
    naive = hbm_accesses(n, d, 1, "naive", dv=dv)
    assert naive == 2 * n * d + 2 * n * dv + 4 * n * n             # Q, K; V, O; S and P
    tiles = hbm_accesses(n, d, 1, "tiled", block=128, dv=dv)
    assert tiles == n * d + 32 * n * (d + dv) + n * dv + n          # Q once, K and V per pass
    l2 = hbm_accesses(n, d, 1, "tiled", block=n, dv=dv)
    assert round(naive / tiles, 2) == 1.61 and round(naive / l2, 1) == 26.6
    assert naive / tiles > hbm_ratio_tiles(n, d) and naive / l2 > hbm_ratio_all_l2_hits(n, d)
    width = d + dv                                  # a fitted block holds 2B(d + dv) + B^2 numbers
    block = max(b for b in range(1, n) if 2 * b * width + b * b <= a100 // 2)
    assert hbm_accesses(n, d, a100, "tiled", dv=dv) == hbm_accesses(n, d, 1, "tiled", block=block,
                                                                     dv=dv)


def test_hbm_accesses_grow_with_the_sequence():
    for impl in ("naive", "tiled"):
        counts = [hbm_accesses(n, 64, 192 * 1024, impl) for n in (512, 1024, 2048, 4096)]
        assert counts == sorted(counts) and len(set(counts)) == 4
    with pytest.raises(ValueError, match="naive, tiled"):
        hbm_accesses(1024, 64, 192 * 1024, "sdpa")


def test_h200_has_the_h100s_on_chip_memory():
    assert SRAM_PER_SM["H200"] == SRAM_PER_SM["H100 SXM"]
    assert SRAM_PER_SM["A100"].sms == 108 and SRAM_PER_SM["H100 SXM"].sms == 132


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t_q, t_k", [(4, 8), (1, 5), (6, 3)])
def test_naive_equals_sdpa_with_other_numbers_of_keys(t_q, t_k, causal):
    """Its causal mask is (T_q, T_k), top-left as SDPA's; it once assumed T_q == T_k."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, t, 8, generator=g, dtype=torch.float64) for t in (t_q, t_k, t_k))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(naive_attention(q, k, v, causal=causal), expected)


def test_soft_capping_refuses_what_it_cannot_do_and_says_why():
    """Bad soft-capping input: a clear ValueError naming the fix, never a silent uncapped run."""
    with pytest.raises(ValueError, match="attn_softcap must be a number >= 0"):
        lk.preset("tiny").replace(attn_softcap=-1.0)
    with pytest.raises(ValueError, match="labkit's MLA has none: set attn_softcap=0"):
        lk.preset("tiny-moe").replace(attention="mla", kv_lora_rank=16, qk_nope_dim=16,
                                      qk_rope_dim=8, v_head_dim=16, attn_softcap=50.0)
    with pytest.raises(ValueError, match="labkit's MLA has none: set sliding_window=0"):
        lk.preset("tiny-moe").replace(sliding_window=64)
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="softcap must be a number >= 0"):
        tiled_attention(q, k, v, softcap=-2.0)
    capped = lk.preset("tiny").replace(logit_softcap=30.0)
    with pytest.raises(ValueError, match="does not soft-cap the logits.*loss_chunk=None"):
        lk.estimate(capped, seq=64, recipe=lk.Recipe("fp32", loss_chunk=32))
    model = lk.build_model(capped)
    model.loss_chunk = 32
    tokens = torch.randint(0, capped.vocab_size, (1, 17))
    with pytest.raises(ValueError, match="does not soft-cap the logits.*loss_chunk=None"):
        model(tokens[:, :-1], tokens[:, 1:])
    packed = lk.build_model(lk.preset("tiny").replace(attn_softcap=5.0))
    with pytest.raises(ValueError, match="soft-capped attention .* no packed rows"):
        packed(tokens[:, :-1], tokens[:, 1:], doc_ids=torch.zeros(1, 16, dtype=torch.long))
