"""Formats follow from their bits; our loss scaler is GradScaler, step for step; fine-grained
FP8 scales (DeepSeek-V3) beat one scale per tensor on activations with outlier channels."""
import copy

import pytest
import torch

from labkit.quantisation.precision import (DynamicLossScaler, ScalerStep, exponent_histogram,
                                           format_info, format_table, fp8_error,
                                           fraction_representable, outlier_activations,
                                           quantize_fp8)

NUMBERS = ("max", "min_normal", "min_subnormal", "eps")


# ----------------------------------------------------------------------------- formats

def test_bit_layout_formulas_agree_with_torch_finfo():
    by_formula = {row.name: row for row in format_table("bit layout")}
    for row in format_table("torch"):
        formula = by_formula[row.name]
        for number in NUMBERS:
            assert getattr(row, number) == getattr(formula, number), (row.name, number)
    assert [r.source for r in format_table()] == ["torch", "bit layout"] + ["torch"] * 4


def test_table_lists_the_six_formats_with_their_bits_and_bytes():
    layout = {r.name: (r.sign_bits, r.exponent_bits, r.mantissa_bits, r.bits, r.bytes)
              for r in format_table()}
    assert layout == {"fp32": (1, 8, 23, 32, 4), "tf32": (1, 8, 10, 19, 4),
                      "fp16": (1, 5, 10, 16, 2), "bf16": (1, 8, 7, 16, 2),
                      "fp8-e4m3": (1, 4, 3, 8, 1), "fp8-e5m2": (1, 5, 2, 8, 1)}
    assert format_info(torch.float8_e4m3fn).name == "fp8-e4m3"


def test_tf32_has_fp32_range_fp16_precision_and_is_stored_in_four_bytes():
    tf32, fp32, fp16 = format_info("tf32"), format_info("fp32"), format_info("fp16")
    assert tf32.dtype is None and tf32.bytes == 4 and "4 bytes" in tf32.note
    assert tf32.min_normal == fp32.min_normal and tf32.max == pytest.approx(fp32.max, rel=1e-3)
    assert tf32.eps == fp16.eps == 2.0 ** -10


def test_bf16_trades_fp16_precision_for_fp32_range():
    bf16, fp16, fp32 = format_info("bf16"), format_info("fp16"), format_info("fp32")
    assert fp16.max == 65504 and bf16.min_normal == fp32.min_normal
    assert bf16.eps == 8 * fp16.eps


def test_e4m3_spends_its_top_exponent_on_numbers_up_to_448_not_on_infinity():
    e4m3 = torch.tensor([0x7E, 0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e5m2 = torch.tensor([0x7B, 0x7C], dtype=torch.uint8).view(torch.float8_e5m2).float()
    assert e4m3[0] == 448 == format_info("fp8-e4m3").max and e4m3[1].isnan()
    assert e5m2[0] == 57344 == format_info("fp8-e5m2").max and e5m2[1].isinf()


def test_exponent_histogram_counts_floor_log2_of_the_nonzero_values():
    x = torch.tensor([1.0, 1.5, 2.0, 0.25, 0.0, -3.0, 2.0 ** -140])
    assert exponent_histogram(x) == {-140: 1, -2: 1, 0: 2, 1: 2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e5m2])
def test_fraction_representable_agrees_with_real_casts(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, generator=g).sign() * 2.0 ** (torch.rand(20_000, generator=g) * 60 - 40)
    f = format_info(dtype)
    edges = torch.tensor([f.min_subnormal / 2, f.min_normal - f.min_subnormal / 2,
                          f.max * (1 + f.eps / 4), f.max * (1 + f.eps / 2)])
    x = torch.cat([x, edges, -edges])
    y = x.to(dtype).float()
    expected = [~y.isfinite(), y == 0, (y != 0) & (y.abs() < f.min_normal),
                y.isfinite() & (y.abs() >= f.min_normal)]
    got = fraction_representable(x, dtype)
    assert [got.overflow, got.underflow, got.subnormal, got.normal] == \
        [m.sum().item() / x.numel() for m in expected]


def test_e4m3_saturates_rather_than_overflowing_until_halfway_past_448():
    got = fraction_representable(torch.tensor([460.0, 464.0, 1e4, 1.0]), "fp8-e4m3")
    assert (got.overflow, got.normal) == (0.5, 0.5)


def test_loss_scaling_lifts_gradients_out_of_fp16_underflow():
    grads = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 1e-7
    before = fraction_representable(grads, "fp16")
    after = fraction_representable(grads * 2 ** 16, "fp16")
    assert before.underflow > 0.2 and before.normal == 0      # measured 0.24 flushed to zero
    assert after.underflow == 0 and after.normal > 0.99


# ----------------------------------------------------------------------------- loss scaling

STEPS = 16
# step -> what goes wrong: a loss too large for fp32 once scaled, or a grad set to inf / nan
OVERFLOWS = {2: "huge loss", 5: "inf grad", 9: "nan grad", 10: "nan grad"}
CLIP_STEPS = {3, 7, 10, 13}      # unscale_ explicitly, then clip, then step


def _scripted_step(i, model, scaler, optimizer, x, y):
    """One step of the script; ``scaler`` is ours or GradScaler (same calls)."""
    loss = ((model(x) - y) ** 2).mean()
    if OVERFLOWS.get(i) == "huge loss":
        loss = loss * 1e38
    scaler.scale(loss).backward()
    if OVERFLOWS.get(i) in ("inf grad", "nan grad"):
        model.weight.grad[0, 0] = float("inf") if OVERFLOWS[i] == "inf grad" else float("nan")
    if i in CLIP_STEPS:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("settings", [
    dict(init_scale=2.0 ** 10, growth_interval=3),
    dict(init_scale=1000.0, growth_factor=1.5, backoff_factor=0.3, growth_interval=3),
], ids=["powers-of-two", "odd-factors"])
def test_our_loss_scaler_matches_gradscaler_step_for_step(settings):
    torch.manual_seed(0)
    ours_model = torch.nn.Linear(8, 4)
    theirs_model = copy.deepcopy(ours_model)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.1, momentum=0.9)
    theirs_opt = torch.optim.SGD(theirs_model.parameters(), lr=0.1, momentum=0.9)
    stepped = {"ours": [], "theirs": []}
    ours_opt.register_step_post_hook(lambda *_: stepped["ours"].append(True))
    theirs_opt.register_step_post_hook(lambda *_: stepped["theirs"].append(True))
    ours, theirs = DynamicLossScaler(**settings), torch.amp.GradScaler("cpu", **settings)
    g = torch.Generator().manual_seed(1)
    for i in range(STEPS):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        _scripted_step(i, ours_model, ours, ours_opt, x, y)
        _scripted_step(i, theirs_model, theirs, theirs_opt, x, y)
        assert ours.scale_value == theirs.get_scale(), i
        assert ours.state == theirs.state_dict(), i
        assert len(stepped["ours"]) == len(stepped["theirs"]), i
        assert ours.history[-1].skipped == (i in OVERFLOWS), i
        assert torch.equal(ours_model.weight, theirs_model.weight), i
        assert torch.equal(ours_model.bias, theirs_model.bias), i
    changes = [b.scale / a.scale for a, b in zip(ours.history, ours.history[1:])]
    assert any(c > 1 for c in changes) and any(c < 1 for c in changes)  # it grew and backed off


def test_a_run_of_overflows_halves_the_scale_each_time():
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=0.1)
    scaler = DynamicLossScaler()
    for _ in range(5):
        scaler.scale(w.sum()).backward()
        w.grad[1] = float("inf")
        assert scaler.step(optimizer) is False
        scaler.update()
        w.grad = None
    assert scaler.history == [ScalerStep(2.0 ** k, True) for k in (16, 15, 14, 13, 12)]
    assert scaler.scale_value == 2.0 ** 11 and torch.equal(w.detach(), torch.ones(3))


def test_a_good_step_unscales_the_gradients_exactly():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    scaler = DynamicLossScaler()
    (scaler.scale((w ** 2).sum())).backward()
    assert torch.equal(w.grad, torch.tensor([2.0, -4.0]) * 2 ** 16)
    scaler.unscale_([w])
    assert torch.equal(w.grad, torch.tensor([2.0, -4.0]))


@pytest.mark.parametrize("settings, message", [
    (dict(init_scale=-1.0), "init_scale must be a positive finite number.*2\\*\\*16"),
    (dict(growth_factor=1.0), "growth_factor must be > 1.*use e.g. 2.0"),
    (dict(backoff_factor=1.5), "backoff_factor must be in \\(0, 1\\).*use e.g. 0.5"),
    (dict(backoff_factor=0.0), "backoff_factor must be in \\(0, 1\\)"),
    (dict(growth_interval=0), "growth_interval must be an integer >= 1.*use e.g. 2000"),
])
def test_scaler_arguments_out_of_range_raise_value_errors_naming_the_fix(settings, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**settings)


def test_update_before_step_says_what_to_call():
    with pytest.raises(RuntimeError, match="call step\\(optimizer\\) first"):
        DynamicLossScaler().update()


# ----------------------------------------------------------------------------- FP8

def _normal(shape=(256, 1024), seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("granularity", ["tensor", "tile", "block"])
def test_fp8_round_trip_error_is_small_on_normal_data(granularity):
    x = _normal()
    e4m3, e5m2 = fp8_error(x, "fp8-e4m3", granularity), fp8_error(x, "fp8-e5m2", granularity)
    assert e4m3.rel_fro < 0.03 and e5m2.rel_fro < 0.06        # measured 0.026, 0.052
    assert e4m3.underflow < 1e-5                              # measured: at most 1 value in 262,144


def test_tile_scaling_beats_per_tensor_scaling_on_outlier_activations():
    x = outlier_activations((256, 1024), n_outliers=4, scale=1000.0, seed=0)
    tensor, tile = fp8_error(x, granularity="tensor"), fp8_error(x, granularity="tile")
    # measured: rel_fro 0.0269 vs 0.0047, underflow 0.55% vs 0.02%, mean_rel 3.4% vs 2.3%
    assert tensor.rel_fro > 4 * tile.rel_fro
    assert tensor.underflow > 10 * tile.underflow
    assert tensor.mean_rel > 1.3 * tile.mean_rel


def test_at_1000x_outliers_the_e4m3_exponent_still_shields_the_quiet_channels():
    # a float format's relative error does not depend on the scale until values go subnormal:
    # the gain from tiles above is on the loud channels and the underflow, not on the rest
    x = outlier_activations((256, 1024), n_outliers=4, scale=1000.0, seed=0)
    quiet = x.abs().amax(0) < 50
    errors = {}
    for granularity in ("tensor", "tile"):
        q = quantize_fp8(x, granularity=granularity).dequantize()
        errors[granularity] = ((q - x)[:, quiet].norm() / x[:, quiet].norm()).item()
    assert errors["tensor"] < 1.1 * errors["tile"]            # measured 0.0266 vs 0.0259


def test_beyond_e4m3_dynamic_range_one_scale_per_tensor_flushes_ordinary_values():
    x = outlier_activations((256, 1024), n_outliers=4, scale=1e5, seed=0)
    tensor, tile = fp8_error(x, granularity="tensor"), fp8_error(x, granularity="tile")
    assert tensor.underflow > 0.4 and tile.underflow < 0.05  # measured 0.49, 0.026
    assert tensor.mean_rel > 5 * tile.mean_rel               # measured 0.66, 0.067


def test_e4m3_is_more_precise_and_e5m2_reaches_further():
    assert fp8_error(_normal(), "fp8-e4m3").rel_fro < 0.6 * fp8_error(_normal(), "fp8-e5m2").rel_fro
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(256, 1024, generator=g) * 10 ** (-8 * torch.rand(256, 1024, generator=g))
    assert fp8_error(wide, "fp8-e4m3").underflow > 0.3 > 0.01 > fp8_error(wide, "fp8-e5m2").underflow


@pytest.mark.parametrize("granularity, scale_shape, nbytes", [
    ("tensor", (), 256 * 1024 + 4),
    ("tile", (256, 8), 256 * 1024 + 256 * 8 * 4),
    ("block", (2, 8), 256 * 1024 + 2 * 8 * 4),
])
def test_fp8_tensor_holds_one_byte_per_value_and_one_fp32_scale_per_group(granularity, scale_shape,
                                                                         nbytes):
    q = quantize_fp8(_normal(), granularity=granularity)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (256, 1024)
    assert tuple(q.scale.shape) == scale_shape and q.scale.dtype == torch.float32
    assert q.nbytes == nbytes


def test_tile_scaling_takes_activations_of_any_rank_and_maps_each_tile_max_to_448():
    x = _normal((2, 64, 256))
    q = quantize_fp8(x, granularity="tile")
    assert q.scale.shape == (2, 64, 2) and q.dequantize().shape == x.shape
    assert torch.equal(q.data.float().abs().reshape(2, 64, 2, 128).amax(-1),
                       torch.full((2, 64, 2), 448.0))


@pytest.mark.parametrize("shape, granularity, message", [
    ((4, 100), "tile", "last dimension 100 is not a multiple of tile=128; pad it"),
    ((128, 100), "block", "both dimensions multiples of tile=128.*pad it"),
    ((2, 128, 128), "block", "needs a 2-D tensor.*granularity='tile'"),
    ((128, 128), "row", "unknown granularity 'row'; use one of tensor, tile, block"),
])
def test_shapes_that_do_not_split_into_groups_raise_naming_the_fix(shape, granularity, message):
    with pytest.raises(ValueError, match=message):
        quantize_fp8(torch.ones(shape), granularity=granularity)


def test_an_all_zero_tile_comes_back_as_zeros():
    x = _normal((2, 256))
    x[:, :128] = 0
    back = quantize_fp8(x, granularity="tile").dequantize()
    assert torch.equal(back[:, :128], torch.zeros(2, 128))


def test_outlier_activations_are_reproducible_with_a_few_loud_channels():
    x = outlier_activations((256, 1024), n_outliers=4, scale=1000.0, seed=0)
    assert torch.equal(x, outlier_activations((256, 1024), n_outliers=4, scale=1000.0, seed=0))
    loud = x.abs().amax(0) > 50                               # per channel, over tokens
    assert loud.sum() == 4 and x[:, ~loud].abs().max() < 6


def test_compare_with_gradscaler_reports_identical_decisions_and_weights():
    from labkit.quantisation.precision import compare_with_gradscaler
    ours, theirs, same_weights = compare_with_gradscaler(steps=10, overflow_at=(2, 5))
    assert ours == theirs and same_weights
    assert [s.skipped for s in ours] == [i in (2, 5) for i in range(10)]


def test_a_too_high_start_scale_backs_off_to_the_same_level():
    from labkit.quantisation.precision import scale_history
    low = scale_history(2.0 ** 16, overflow_above=2.0 ** 17, steps=12)
    high = scale_history(2.0 ** 20, overflow_above=2.0 ** 17, steps=12)
    assert high[:4] == [2.0 ** 20, 2.0 ** 19, 2.0 ** 18, 2.0 ** 17]
    assert high[4:] == low[4:]


def test_shrunk_loss_flushes_the_logits_gradient_to_zero_in_fp16_and_scaling_restores_it():
    import labkit as lk
    from labkit.quantisation.precision import activation_gradients, fraction_representable
    logits = activation_gradients(lk.preset("tiny"), loss_factor=1e-3, at="logits")
    assert fraction_representable(logits, torch.float16).underflow > 0.95   # measured 99.6%
    assert fraction_representable(logits * 2.0 ** 16, torch.float16).normal > 0.99
    block = activation_gradients(lk.preset("tiny"), loss_factor=1e-3, at="last block")
    assert fraction_representable(block, torch.float16).normal < 0.05        # subnormal, mostly
    with pytest.raises(ValueError, match="use 'logits' or 'last block'"):
        activation_gradients(lk.preset("tiny"), at="embedding")


def test_per_tensor_fp8_keeps_ordinary_channels_until_outliers_reach_thousands():
    def typical_error(scale, granularity):
        x = outlier_activations((512, 1024), n_outliers=8, scale=scale, seed=0)
        ordinary = x.std(0) < 5                        # the channels without an outlier
        return fp8_error(x, granularity=granularity, where=ordinary).mean_rel
    # e4m3's own rounding (3 mantissa bits) sets the error while the values stay normal
    assert abs(typical_error(300.0, "tensor") - typical_error(300.0, "tile")) < 0.005
    assert typical_error(30000.0, "tensor") > 3 * typical_error(30000.0, "tile")


# ----------------------------------------------------------------------------- lab 02, issue 10

def test_the_scale_update_rule_is_the_same_in_labkit_gradscaler_and_its_kernel():
    from labkit.quantisation.precision import scale_sequence
    flags = [False, True, True, False, False, False, False, False, False, True, False]
    ours = scale_sequence(flags, "labkit", init_scale=2.0 ** 12, growth_interval=2)
    assert ours == scale_sequence(flags, "torch", init_scale=2.0 ** 12, growth_interval=2)
    s, tracker, kernel = torch.tensor(2.0 ** 12), torch.zeros((), dtype=torch.int32), []
    for f in flags:
        kernel.append(s.item())
        torch._amp_update_scale_(s, tracker, torch.tensor(float(f)), 2.0, 0.5, 2)
    assert ours == kernel
    assert ours[:4] == [4096, 4096, 2048, 1024] and ours[5] == 2048      # halve twice, then grow
    with pytest.raises(ValueError, match="'labkit' or 'torch'"):
        scale_sequence(flags, "apex")


def test_rounding_to_7_mantissa_bits_gives_bf16_and_to_10_bits_tf32s_spacing():
    from labkit.quantisation.precision import round_mantissa
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 10.0 ** torch.randint(-40, 38, (4096,), generator=g).float()
    assert torch.equal(round_mantissa(x, 7), x.to(torch.bfloat16).float())
    assert torch.equal(round_mantissa(x, 23), x)
    tf32 = round_mantissa(torch.tensor([1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -1.0 - 2.0 ** -12]), 10)
    assert tf32.tolist() == [1.0, 1.0 + 2 * 2.0 ** -10, -1.0]        # ties to even, sign kept
    with pytest.raises(ValueError, match="0..23"):
        round_mantissa(x, 24)


def test_the_fp8_cache_what_if_splits_layer_saved_exactly():
    from labkit.predict.layers import layer_saved
    from labkit.quantisation.precision import fp8_cached_activations
    import labkit as lk
    c = lk.preset("llama-2-7b")
    f = fp8_cached_activations(c, batch=2, seq=1024)
    terms = {t.name: t.bytes(2, 1024) for t in layer_saved(c, "bf16-master")}
    assert f.layer == sum(terms.values())
    assert f.inputs["wq, wk, wv"] == terms["input of wq, wk, wv"] == 2 * 2048 * c.hidden
    assert f.inputs["w_gate, w_up"] == terms["input of w_gate, w_up"]
    assert f.swiglu == terms["SwiGLU gate, silu, up, product"]
    assert f.inputs_fp8["w_down"] == 2048 * (c.ffn + 4 * c.ffn // 128)         # 1 B + tile scales
    assert f.v3_like < f.all_linear_inputs_fp8 < f.layer
    with pytest.raises(ValueError, match="dense GQA"):
        fp8_cached_activations("deepseek-v2-lite")
    with pytest.raises(ValueError, match="'bf16' or 'bf16-master'"):
        fp8_cached_activations(c, precision="bf16-mixed")


def test_model_half_halves_the_weights_and_an_inference_forward_without_the_loss():
    from labkit.quantisation.precision import inference_peak
    fp32, half = (inference_peak("tiny", 2, 64, half=h) for h in (False, True))
    assert 2 * half.weights == fp32.weights
    assert abs(2 * half.peak - fp32.peak) <= 0.001 * fp32.peak
    fp32, half = (inference_peak("tiny", 2, 64, half=h, loss=True) for h in (False, True))
    assert 2 * half.peak > fp32.peak                     # the loss's fp32 logits do not halve


def _clip_run(clip_first: bool, scaled: bool, max_norm=0.5):
    """One SGD step of `tiny` (fp16 autocast + GradScaler when scaled); the new weights."""
    import labkit as lk
    from labkit.training.train import bigram_corpus, train_step
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("tiny"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = bigram_corpus(256, 4 * 33, seed=0).view(4, 33)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    result = train_step(model, opt, rows[:, :-1], rows[:, 1:],
                        "fp16-mixed" if scaled else "fp32", scaler, clip_norm=max_norm)
    return result, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_train_step_unscales_before_clipping_so_the_update_is_fp32s():
    torch.manual_seed(0)
    import labkit as lk
    start = torch.cat([p.detach().flatten() for p in lk.build_model(lk.preset("tiny")).parameters()])
    r32, w32 = _clip_run(True, scaled=False)
    r16, w16 = _clip_run(True, scaled=True)
    assert r32.grad_norm > 0.5                                  # the clip fires
    assert r16.grad_norm == pytest.approx(r32.grad_norm, rel=0.01)   # the true norm, not x 2^16
    assert (w16 - start).norm().item() == pytest.approx((w32 - start).norm().item(), rel=0.01)
    with pytest.raises(ValueError, match="clip_norm must be a positive"):
        _clip_run(True, scaled=False, max_norm=0.0)
