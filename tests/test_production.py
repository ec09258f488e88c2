"""labkit's quantisers beside bitsandbytes and torchao (labkit.quantisation.production).

Each library's tests skip when it is not installed (the ``production`` extra)."""
import math
import sys
import types

import pytest
import torch

from labkit.quantisation import optim8bit, production, quant

pytestmark = pytest.mark.usefixtures("one_thread")     # many small ops: a second thread only waits
LAYER = production.synthetic_layer()               # 512 x 256, N(0, 1/256)
N, OUT = LAYER.weight.numel(), LAYER.weight.shape[0]
NF4_BLOCKS = N // 64


def _rows(rows, **match):
    return [r for r in rows if all(match[k] in getattr(r, k) for k in match)]


def _row(rows, **match):
    (row,) = _rows(rows, **match)
    return row


def _near_ties(normed, codes_a, codes_b, code):
    """For each code where a and b differ: how much nearer a's value is than b's (>= 0 when
    a is the nearer), in units of the normalised numbers."""
    differ = codes_a != codes_b
    value = normed[differ]
    return ((value - code[codes_b[differ].long()]).abs()
            - (value - code[codes_a[differ].long()]).abs())


# ------------------------------------------------------------------------ without the libraries

def test_without_the_libraries_only_labkit_rows_are_returned(monkeypatch):
    for name in production.PACKAGES:
        monkeypatch.setitem(sys.modules, name, None)          # import of it now fails
    assert production.available() == {"bitsandbytes": None, "torchao": None}
    reasons = production.unavailable()
    assert all(reasons[name].startswith("not installed") for name in production.PACKAGES)
    rows = production.weight_rows(LAYER) + production.optimizer_rows(LAYER, steps=2)
    assert {r.implementation for r in rows} == {
        "torch nn.Linear", "labkit QuantLinear", "labkit quantize_int8",
        "torch AdamW (fp32)", "labkit AdamW8bit"}
    assert production.agreement(LAYER) == []
    assert "not measured: torchao: not installed" in production.format_rows(rows, reasons)


def test_a_package_without_the_api_used_is_unusable(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))   # no submodules
    for name in [n for n in sys.modules if n.startswith("torchao.")]:    # imported by a test
        monkeypatch.delitem(sys.modules, name)                           # before: hide them
    assert production.available()["torchao"] is None
    assert production.unavailable()["torchao"].startswith("unusable")


def test_labkit_rows_count_the_bytes_of_the_tensors_kept():
    rows = production.weight_rows(LAYER)
    assert _row(rows, implementation="torch nn.Linear").stored_bytes == 4 * N
    # packed codes, int8 block scales, fp32 scale per 256 blocks, fp32 mean: 4.127 bits
    nf4 = _row(rows, implementation="labkit QuantLinear")
    assert nf4.stored_bytes == N // 2 + NF4_BLOCKS + 4 * NF4_BLOCKS // 256 + 4 == 67_620
    assert nf4.bits_per_param == pytest.approx(quant.nf4_bits_per_param() + 32 / N)
    assert _row(rows, implementation="labkit quantize_int8").stored_bytes == N + 4 * OUT
    # NF4 error on Gaussian weights ~9%, int8 per channel ~0.7%
    assert 0.08 < nf4.weight_error < 0.10
    assert 0.005 < _row(rows, implementation="labkit quantize_int8").weight_error < 0.009


# ----------------------------------------------------------------------------- bitsandbytes NF4

def _linear4bit(bnb, double_quant):
    return production._linear(LAYER.weight, bnb.nn.Linear4bit, compute_dtype=torch.float32,
                              compress_statistics=double_quant, quant_type="nf4")


def test_nf4_codes_and_weights_equal_bitsandbytes_exactly_with_fp32_scales():
    bnb = pytest.importorskip("bitsandbytes")
    row = _row(production.agreement(LAYER), what="fp32 scales")
    assert (row.codes_differing, row.codes, row.max_abs_difference) == (0, N, 0.0)
    # and labkit's dequantize reads bitsandbytes' double-quantised tensors bit for bit
    layer = _linear4bit(bnb, double_quant=True)
    state = layer.weight.quant_state
    scales = optim8bit.dequantize_blockwise(state.absmax, state.state2.absmax,
                                            state.state2.code, 256) + state.offset
    stored = quant.Quantized(layer.weight.data.reshape(-1), scales, None, None,
                             tuple(LAYER.weight.shape), "nf4", "block", 64)
    assert torch.equal(quant.dequantize(stored),
                       bnb.functional.dequantize_4bit(layer.weight.data, state))


def test_nf4_on_bitsandbytes_map_differs_only_where_its_cpu_kernel_misrounds_a_scale():
    bnb = pytest.importorskip("bitsandbytes")
    layer = _linear4bit(bnb, double_quant=True)
    state = layer.weight.quant_state
    theirs = bnb.functional.dequantize_4bit(layer.weight.data, state)
    mine, scale_codes = production._nf4_bnb_map(LAYER.weight)
    differ = scale_codes != state.absmax                                   # (blocks,)
    assert 0 < int(differ.sum()) <= NF4_BLOCKS // 200                      # 3 of 2048 here
    same_blocks = ~differ.repeat_interleave(64).view(LAYER.weight.shape)
    assert torch.equal(mine[same_blocks], theirs[same_blocks])
    # each misrounded scale was a near tie: bitsandbytes' code is < 1e-4 farther than labkit's
    scales = quant.quantize_nf4(LAYER.weight, double_quant=False).scales
    normed = (scales - scales.mean()) / state.state2.absmax.repeat_interleave(256)
    excess = _near_ties(normed, scale_codes, state.absmax, optim8bit.dynamic_map(True))
    assert bool((excess >= 0).all()) and float(excess.max()) < 1e-4


def test_nf4_double_quant_bytes_and_the_bound_on_labkits_difference():
    bnb = pytest.importorskip("bitsandbytes")
    rows = production.weight_rows(LAYER)
    mine = _row(rows, implementation="labkit QuantLinear")
    theirs = _row(rows, implementation="Linear4bit")
    # same format; bitsandbytes also holds its 16-value NF4 map and 256-value dynamic map
    assert theirs.stored_bytes - mine.stored_bytes == 16 * 4 + 256 * 4
    assert abs(theirs.weight_error - mine.weight_error) < 1e-3 * mine.weight_error
    # labkit's int8-absmax scales and bitsandbytes' dynamic-map scales each err by at most half
    # a step of the scales' absmax in their group of 256 blocks (1/127 resp. the map's widest
    # step, 0.014, plus 1e-4 for a misround); a weight moves by its code (|c| <= 1) times that
    layer = _linear4bit(bnb, double_quant=True)
    difference = (quant.dequantize(quant.quantize_nf4(LAYER.weight))
                  - bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state))
    per_group = difference.abs().reshape(-1, 256 * 64).amax(dim=1)        # (groups,)
    scales = quant.quantize_nf4(LAYER.weight, double_quant=False).scales
    group_absmax = (scales - scales.mean()).abs().reshape(-1, 256).amax(dim=1)
    widest = float(optim8bit.dynamic_map(True).diff().max())
    assert bool((per_group <= group_absmax * (1 / 254 + widest / 2 + 1e-4)).all())
    assert 0 < float(per_group.max())


# ----------------------------------------------------------------------------- bitsandbytes int8

def test_linear8bitlt_keeps_labkits_bytes_and_quantises_the_fp16_weight():
    bnb = pytest.importorskip("bitsandbytes")
    rows = production.weight_rows(LAYER)
    assert _row(rows, implementation="Linear8bitLt").stored_bytes == N + 4 * OUT == \
        _row(rows, implementation="labkit quantize_int8").stored_bytes
    layer = production._linear(LAYER.weight, bnb.nn.Linear8bitLt, has_fp16_weights=False,
                               threshold=0.0)
    fp16_weight = LAYER.weight.half().float()
    assert torch.equal(layer.weight.SCB, fp16_weight.abs().amax(dim=1))
    # labkit on the fp16-rounded weight: the same codes but at rounding ties (x * (127 / s)
    # against x / (s / 127)), one apart
    mine = quant.quantize_int8(fp16_weight, "absmax", "channel").codes
    apart = (mine.int() - layer.weight.CB.int()).abs()
    assert int(apart.max()) == 1 and int((apart > 0).sum()) < N // 1000
    row = _row(production.agreement(LAYER), implementation="Linear8bitLt")
    assert row.codes_differing > 10 * int((apart > 0).sum())    # the fp16 rounding's doing


# ------------------------------------------------------------------------ bitsandbytes AdamW8bit

def test_adamw8bit_state_bytes_equal_and_the_first_step_is_bit_identical():
    pytest.importorskip("bitsandbytes")
    rows = production.optimizer_rows(LAYER, steps=1)
    expected = optim8bit.state_bytes(N) + optim8bit.MAP_BYTES                # 268,288
    assert _row(rows, implementation="labkit AdamW8bit").stored_bytes == expected
    assert _row(rows, implementation="bitsandbytes").stored_bytes == expected
    grads = production._gradients(LAYER.weight.shape, 1, seed=0)
    makers = production._optimizers()
    mine_p, mine = production._train(makers["labkit AdamW8bit"], LAYER.weight, grads)
    key = next(k for k in makers if k.startswith("bitsandbytes"))
    their_p, theirs = production._train(makers[key], LAYER.weight, grads)
    assert torch.equal(mine_p, their_p)
    m_state, b_state = mine.state[mine_p], theirs.state[their_p]
    assert torch.equal(m_state["m_absmax"], b_state["absmax1"])
    # codes differ only at near ties, where labkit's is the nearer
    m1 = (0.1 * grads[0]).reshape(-1, 256) / m_state["m_absmax"][:, None]    # (blocks, 256)
    excess = _near_ties(m1.reshape(LAYER.weight.shape), m_state["m_codes"], b_state["state1"],
                        optim8bit.dynamic_map(True))
    assert 0 < excess.numel() < N // 100
    assert bool((excess >= 0).all()) and float(excess.max()) < 1e-4


def test_adamw8bit_moments_agree_far_closer_than_either_to_fp32():
    pytest.importorskip("bitsandbytes")
    rows = production.optimizer_rows(LAYER, steps=5)
    mine = _row(rows, implementation="labkit AdamW8bit")
    theirs = _row(rows, implementation="bitsandbytes")
    agree = _rows(production.agreement(LAYER, steps=5), what="AdamW 8-bit")
    assert len(agree) == 2                                   # m and v
    for row in agree:
        assert row.relative_difference < 0.25 * min(mine.output_error, theirs.output_error)
    assert abs(mine.weight_error - theirs.weight_error) < 0.1 * mine.weight_error


# ----------------------------------------------------------------------------- torchao

def test_torchao_int8_bytes_come_from_the_tensors_inside_its_subclass():
    pytest.importorskip("torchao")
    weight = production._torchao_int8(LAYER.weight).weight
    assert weight.untyped_storage().nbytes() == 4 * N       # a placeholder of the fp32 size
    row = _row(production.weight_rows(LAYER), implementation="torchao")
    assert row.stored_bytes == N + 4 * OUT + OUT            # int8 codes, fp32 scale, int8 zero
    assert int(weight.zero_point.abs().max()) == 0
    scale = LAYER.weight.abs().amax(dim=1, keepdim=True) / 127.5           # (out, 1)
    assert torch.equal(weight.scale, scale)
    apart = (weight.qdata.int() - (LAYER.weight / scale).round().clamp(-128, 127).int()).abs()
    assert int(apart.max()) <= 1
    assert abs(row.weight_error - _row(production.weight_rows(LAYER),
                                       implementation="labkit quantize_int8").weight_error) < 1e-4


# ----------------------------------------------------------------------------- all of it

def _rows_per_layer() -> int:
    """5 labkit and torch rows, 3 for bitsandbytes, 1 for torchao."""
    present = {name for name, version in production.available().items() if version}
    return 5 + 3 * ("bitsandbytes" in present) + ("torchao" in present)


def test_side_by_side_gives_every_row_for_each_layer():
    small = production.synthetic_layer(256, 128, rows=16, seed=1)
    rows = production.side_by_side([LAYER, small], steps=2)
    assert [r.layer for r in rows] == [LAYER.name] * _rows_per_layer() + \
        [small.name] * _rows_per_layer()
    assert production.format_rows(rows).count("\n") == len(rows)   # a header, then the rows


@pytest.mark.slow
def test_side_by_side_defaults_to_the_trained_layer_and_a_synthetic_one():
    rows = production.side_by_side(steps=2)              # trains ``small`` first: ~10-30 s
    assert {r.layer for r in rows} == {"small block 0 mlp.w_up (trained)", LAYER.name}
    assert len(rows) == 2 * _rows_per_layer()
    trained = _row(rows, layer="trained", implementation="labkit QuantLinear")
    n = 704 * 256
    assert trained.stored_bytes == n // 2 + n // 64 + 4 * n // (64 * 256) + 4
    assert all(math.isfinite(r.weight_error) and math.isfinite(r.output_error) for r in rows)
