"""The papers' published numbers, typed in by hand, reproduced by ``labkit.predict.papers``."""
from fractions import Fraction

import pytest

import labkit as lk
from labkit.core.recipe import PRECISIONS

from labkit.predict.papers import (megatron_activation_bytes, megatron_params, model_state_bytes,
                                   pipeline_bubble, pipeline_bubble_ratio)

# ---------------------------------------------------------------------------------------------
# ZeRO (Rajbhandari et al., 2020), Table 1: 7.5B parameters, K = 12, GB (1e9 bytes) per device.
# Published values are strings so the test knows how many digits the table printed.
ZERO_DP = (1, 4, 16, 64, 256, 1024)
ZERO_TABLE_1 = {
    0: ("120", "120", "120", "120", "120", "120"),
    1: ("120", "52.5", "35.6", "31.4", "30.4", "30.1"),
    2: ("120", "41.3", "21.6", "16.6", "15.4", "15.1"),
    3: ("120", "30", "7.5", "1.88", "0.47", "0.12"),
}


def within_printed_rounding(value, published: str) -> bool:
    """True when ``value`` rounds to ``published`` at the digits the paper printed (half a unit)."""
    decimals = len(published.partition(".")[2])
    return abs(Fraction(value) - Fraction(published)) <= Fraction(1, 2 * 10**decimals)


@pytest.mark.parametrize("stage", sorted(ZERO_TABLE_1))
def test_zero_table_1_memory_per_device(stage):
    for dp, published in zip(ZERO_DP, ZERO_TABLE_1[stage]):
        got = Fraction(model_state_bytes(7_500_000_000, "fp16-master", "adamw", stage, dp), 10**9)
        assert within_printed_rounding(got, published), (stage, dp, float(got), published)


def test_zero_baseline_is_16_bytes_per_parameter_with_k_12():
    assert model_state_bytes(7_500_000_000) == (2 + 2 + 12) * 7_500_000_000 == 120 * 10**9


# ---------------------------------------------------------------------------------------------
# bytes per parameter of each format, and what a ZeRO rank holds

@pytest.mark.parametrize("precision, optimizer, per_param", [
    ("bf16-master", "adamw", 2 + 2 + 12),     # the ZeRO paper's mixed precision, K = 12
    ("fp16-master", "adamw", 2 + 2 + 12),
    ("bf16-mixed", "adamw", 4 + 4 + 8),       # autocast: fp32 weights, gradients and moments
    ("fp16-mixed", "adamw", 4 + 4 + 8),
    ("fp32", "adamw", 16),
    ("bf16", "adamw", 8),
    ("fp32", "sgd", 8),
    ("bf16-master", "sgd", 2 + 2 + 4),
    ("bf16-master", "sgd-momentum", 2 + 2 + 8),
    ("bf16-master", "adamw-8bit", 2 + 2 + 4 + 2),
    ("fp32", "adamw-8bit", 4 + 4 + 2),
])
def test_bytes_per_parameter(precision, optimizer, per_param):
    assert model_state_bytes(1000, precision, optimizer) == per_param * 1000


def test_one_name_one_meaning_master_weights_and_autocast_differ_under_zero_1():
    # 8 ranks: the master recipe shards its 12 optimizer bytes, autocast its 8
    assert model_state_bytes(8, "bf16-master", "adamw", zero_stage=1, dp=8) == 2 * 8 + 2 * 8 + 12
    assert model_state_bytes(8, "bf16-mixed", "adamw", zero_stage=1, dp=8) == 4 * 8 + 4 * 8 + 8


def test_the_estimate_and_the_paper_agree_on_the_model_states_of_every_precision():
    n = lk.count_params("llama-2-7b").total
    for precision in PRECISIONS:
        for stage in (0, 1, 2, 3):
            states = lk.estimate("llama-2-7b", precision=precision, zero_stage=stage,
                                 dp=8).details["model states"]
            # AdamW's step count: one per parameter tensor, or per flat ZeRO unit (stage 1:
            # the whole model; 2, 3: the embedding, final norm and head, and 32 blocks)
            counters = 4 * {0: 291, 1: 1, 2: 33, 3: 33}[stage]
            assert sum(states.values()) - counters == model_state_bytes(
                n, precision, "adamw", stage, 8), (precision, stage)


def test_zero3_rank_holds_a_quarter_of_the_states():
    n = 1_000_000
    assert model_state_bytes(n, zero_stage=3, dp=4) * 4 == model_state_bytes(n)


def test_zero_stages_shard_optimizer_then_grads_then_params():
    n, dp = 1_000_000, 4
    assert model_state_bytes(n, zero_stage=1, dp=dp) == 2 * n + 2 * n + 12 * n // dp
    assert model_state_bytes(n, zero_stage=2, dp=dp) == 2 * n + (2 + 12) * n // dp
    assert model_state_bytes(n, zero_stage=0, dp=dp) == model_state_bytes(n)


def test_a_shard_is_never_smaller_than_its_share():
    # 10 params over dp=3: each component rounds up (7 + 7 + 40 bytes), never down
    assert model_state_bytes(10, zero_stage=3, dp=3) == 7 + 7 + 40
    assert model_state_bytes(10, zero_stage=3, dp=3) * 3 >= model_state_bytes(10)


def test_zero_params_hold_zero_bytes():
    assert model_state_bytes(0, zero_stage=3, dp=8) == 0


# ---------------------------------------------------------------------------------------------
# Korthikanti et al., 2022, Table 2, for the GPT-3 175B shape with t = 8.
s, b, h, a, L, t = 2048, 1, 12288, 96, 96, 8
TABLE_2 = {  # (tp, sp, recompute) -> per-layer bytes, written as the table's expressions
    "no parallelism": ((1, False, "none"), s*b*h*(34 + 5*a*s/h)),
    "tensor parallel": ((t, False, "none"), s*b*h*(10 + 24/t + 5*a*s/(h*t))),
    "tensor + sequence parallel": ((t, True, "none"), s*b*h*(34/t + 5*a*s/(h*t))),
    "tensor parallel + selective recompute": ((t, False, "attention-core"), s*b*h*(10 + 24/t)),
    "tensor + sequence parallel + selective recompute": ((t, True, "attention-core"), s*b*h*34/t),
    "full recompute": ((1, False, "full"), s*b*h*2),
    "full recompute + sequence parallel": ((t, True, "full"), s*b*h*2/t),
}


@pytest.mark.parametrize("row", sorted(TABLE_2))
def test_korthikanti_table_2_rows_for_gpt3(row):
    (tp, sp, recompute), expected = TABLE_2[row]
    assert megatron_activation_bytes(s, b, h, a, tp=tp, sp=sp, recompute=recompute) == expected
    assert megatron_activation_bytes(s, b, h, a, L, tp, sp, recompute) == expected * L


def test_for_gpt3_the_attention_term_5as_over_h_outweighs_the_34():
    per_token = Fraction(megatron_activation_bytes(s, b, h, a), s * b * h)
    assert per_token == 34 + 80 and 5 * a * s / h == 80 > 34


def test_korthikantis_selective_is_called_attention_core():
    with pytest.raises(ValueError, match="their 'selective' is 'attention-core'"):
        megatron_activation_bytes(s, b, h, a, recompute="selective")


def test_sequence_parallel_plus_attention_core_recompute_needs_34_over_t_sbh():
    got = megatron_activation_bytes(s, b, h, a, tp=t, sp=True, recompute="attention-core")
    assert got == s * b * h * 34 // t == 106_954_752


def test_attention_core_recompute_drops_only_the_5as_over_h_term():
    for sp in (False, True):
        kept = megatron_activation_bytes(s, b, h, a, tp=t, sp=sp, recompute="none")
        selective = megatron_activation_bytes(s, b, h, a, tp=t, sp=sp, recompute="attention-core")
        assert kept - selective == 5 * a * s * s * b // t


def test_sequence_parallel_and_attention_core_recompute_cut_tensor_parallel_memory_5x():
    baseline = megatron_activation_bytes(s, b, h, a, tp=t)
    both = megatron_activation_bytes(s, b, h, a, tp=t, sp=True, recompute="attention-core")
    assert baseline / both > 5  # 23 / 4.25 = 5.4 for GPT-3


def test_odd_shapes_round_the_exact_value():
    # 34/3 * 1*1*1 = 11.33... -> 11, computed with fractions, not floats
    assert megatron_activation_bytes(1, 1, 1, 3, tp=3, sp=True, recompute="attention-core") == 11


# ---------------------------------------------------------------------------------------------
# Megatron-LM (Narayanan et al., 2021), Table 1: V = 51200, s = 2048.
MEGATRON_TABLE_1 = [  # (billions of parameters, layers, hidden)
    (1.7, 24, 2304), (3.6, 30, 3072), (7.5, 36, 4096), (18.4, 40, 6144), (39.1, 48, 8192),
    (76.1, 60, 10240), (145.6, 80, 12288), (310.1, 96, 16384), (529.6, 105, 20480),
    (1008.0, 128, 25600),
]


@pytest.mark.parametrize("billions, layers, hidden", MEGATRON_TABLE_1)
def test_megatron_table_1_parameter_counts(billions, layers, hidden):
    assert round(megatron_params(layers, hidden, 51200, 2048) / 1e9, 1) == billions


def test_megatron_params_is_the_papers_factored_formula():
    l, hh, V, ss = 96, 12288, 51200, 2048
    factored = 12 * l * hh**2 * (1 + Fraction(13, 12 * hh) + Fraction(V + ss, 12 * l * hh))
    assert megatron_params(l, hh, V, ss) == factored


# ---------------------------------------------------------------------------------------------
# pipeline bubble (GPipe; Narayanan et al., 2021)

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_share_the_same_bubble(schedule):
    assert pipeline_bubble(4, 8, schedule) == pytest.approx(3 / 11)
    assert pipeline_bubble_ratio(4, 8, schedule) == pytest.approx(3 / 8)


def test_interleaving_shrinks_the_bubble_by_v():
    assert pipeline_bubble(4, 8, "interleaved", v=2) == pytest.approx(3 / 19)
    assert pipeline_bubble_ratio(4, 8, "interleaved", v=2) == pytest.approx(3 / 16)


def test_one_stage_has_no_bubble():
    assert pipeline_bubble(1, 8) == 0 == pipeline_bubble_ratio(1, 8)


def test_idle_fraction_is_ratio_over_one_plus_ratio():
    r = pipeline_bubble_ratio(8, 32)
    assert pipeline_bubble(8, 32) == pytest.approx(r / (1 + r))


# ---------------------------------------------------------------------------------------------
# bad input: the message names the fix

@pytest.mark.parametrize("call, message", [
    (lambda: model_state_bytes(100, dp=0), r"dp must be a positive integer, got 0"),
    (lambda: model_state_bytes(-1), r"n_params must be a non-negative integer, got -1"),
    (lambda: model_state_bytes(7.5e9 + 0.5), r"n_params must be a non-negative integer, got 7500000000.5"),
    (lambda: model_state_bytes(100, zero_stage=4), r"zero_stage must be one of 0, 1, 2, 3, got 4"),
    (lambda: model_state_bytes(100, precision="fp8"), r"unknown precision 'fp8'; use one of fp32, bf16, bf16-master, .*'bf16-master'\)"),
    (lambda: model_state_bytes(100, optimizer="lion"), r"unknown optimizer 'lion'; use one of adamw, "),
    (lambda: megatron_activation_bytes(2048, 1, 4096, 32, tp=3),
     r"tp=3 does not divide heads=32; choose tp among the divisors of 32"),
    (lambda: megatron_activation_bytes(0, 1, 4096, 32), r"seq must be a positive integer, got 0"),
    (lambda: megatron_activation_bytes(2048, 1, 4096, 32, recompute="some"),
     r"unknown recompute 'some' for Korthikanti et al.'s formula; use one of none, attention-core, full"),
    (lambda: pipeline_bubble(0, 8), r"p must be a positive integer, got 0"),
    (lambda: pipeline_bubble(4, 0), r"m must be a positive integer, got 0"),
    (lambda: pipeline_bubble(4, 8, v=0), r"v must be a positive integer, got 0"),
    (lambda: pipeline_bubble(4, 8, "zb"), r"unknown schedule 'zb'; use one of gpipe, 1f1b, interleaved"),
    (lambda: pipeline_bubble_ratio(4, 8, "1f1b", v=2),
     r"v=2 virtual stages needs schedule='interleaved'; use v=1 with '1f1b'"),
    (lambda: megatron_params(0, 4096, 51200, 2048), r"layers must be a positive integer, got 0"),
])
def test_bad_input_names_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_parameter_counts_written_as_the_paper_writes_them_are_accepted():
    assert model_state_bytes(7.5e9) == model_state_bytes(7_500_000_000) == 16 * 7_500_000_000
