"""Exercises accept labkit's own answer, reject a wrong one with a hint, and never raise on junk."""
import math

import numpy as np
import pytest
import torch

import labkit as lk
from labkit.course import exercises as ex

GiB = 2**30
ALL = ex.exercises()


def test_each_lab_notebook_uses_only_exercises_that_exist_and_every_exercise_is_used():
    import re
    from pathlib import Path
    notebooks = Path(__file__).resolve().parents[1] / "notebooks"
    used, labs = set(), set()
    for path in notebooks.glob("*.ipynb"):
        labs.add(path.name[:2])
        used |= set(re.findall(r'(?:check|solution|question)\(\\?"(\d\d-[a-z0-9-]+)', path.read_text()))
    assert used and used <= set(ALL), used - set(ALL)
    # a lab's exercises may land before its notebook; once the notebook exists it asks them all
    asked = {i for i in ALL if i[:2] in labs}
    assert asked <= used, f"exercises no notebook asks: {asked - used}"


# Eight answers take 2-10 s each on one core (replays, tracked steps, fake FSDP2 and serving
# profiles, a planner bisection; the rest a few seconds together, 2026-12-05). Each lab's
# solution notebook computes every answer twice, its worked one and labkit's inside check(),
# and prints the solution: tests/test_workshop.py, in the slow run, asserts a ✅ and filled
# placeholders for each. These eight are checked there (and lab 07's two against their closed
# forms below).
LEFT_TO_THE_SOLUTIONS = {"07-watermark-no-preemption", "03-varlen-saving", "08-max-split-needs",
                         "02-fsdp-autocast-cache-gib", "07-pool-share-tokens",
                         "01-foreach-over-for-loop", "07-tiled-peak-block", "09-no-p2p-link"}


def test_the_answers_left_to_the_solution_notebooks_are_exercises():
    assert LEFT_TO_THE_SOLUTIONS <= set(ALL)


@pytest.mark.parametrize("id", [i for i in ALL if i not in LEFT_TO_THE_SOLUTIONS])
def test_labkits_own_answer_is_right_and_the_solution_quotes_it(id):
    result = ex.check(id, ex.get(id).answer())
    assert result.correct and "✅" in repr(result) and "Hint" not in repr(result)
    text = ex.solution(id)
    assert text and "{" not in text                      # every placeholder was filled


@pytest.mark.parametrize("id", ALL)
def test_each_question_names_the_unit_of_its_answer(id):
    assert f"(answer in {ex.get(id).unit})" in ex.question(id)


def test_answers_equal_the_published_figures():
    assert ex.get("01-zero3-fewest-gpus").answer() == 5          # ZeRO-3: 16 B x 6.74B / 5 <= 24 GiB
    n = 7_241_732_096                         # Mistral-7B: Megatron's 18 bytes with fp32 grads
    assert ex.get("01-mistral-7b-megatron-states").answer() == pytest.approx(18 * n / GiB)
    assert ex.get("01-small-params-by-hand").answer() == lk.count_params("small").total
    c = lk.preset("deepseek-moe-16b")      # each idle expert's three matrices at 16 B/param
    assert ex.get("01-moe-idle-expert-states").answer() * GiB == (
        16 * 3 * c.hidden * c.moe_ffn * (c.routed_experts - c.top_k))


def test_the_published_rounded_figure_is_accepted():
    assert ex.check("01-mistral-7b-megatron-states", 121.4)


def test_a_wrong_answer_shows_the_hint_but_not_the_answer():
    result = ex.check("01-small-params-by-hand", 4_000_000)
    assert not result.correct
    assert "❌" in repr(result) and "too low" in result.message
    assert ex.get("01-small-params-by-hand").hint in repr(result)
    assert "Hint" in result._repr_html_()
    assert f'{ex.get("01-small-params-by-hand").answer():,}' not in result.message


def test_gb_instead_of_gib_is_pointed_out():
    n = lk.count_params("mistral-7b").total
    result = ex.check("01-mistral-7b-megatron-states", 18 * n / 1e9)   # 130.4 "GB"
    assert not result.correct and "GB" in result.message


def test_exact_exercises_reject_a_near_miss():
    assert not ex.check("01-small-params-by-hand", lk.count_params("small").total + 1)


def test_an_unanswered_exercise_shows_its_question():
    result = ex.check("01-mistral-7b-megatron-states", None)
    assert not result.correct
    assert "replace None with your answer" in result.message and "(answer in GiB)" in result.message


@pytest.mark.parametrize("answer", ["sixteen", "16 GiB", float("nan"), math.inf, [16],
                                    {"bytes": 16}, True, np.array([16, 2])])
def test_a_malformed_answer_says_what_is_expected(answer):
    result = ex.check("01-mistral-7b-megatron-states", answer)
    assert not result.correct
    assert "expected one number (in GiB)" in result.message


@pytest.mark.parametrize("answer", [kind(ex.get("01-zero3-fewest-gpus").answer()) for kind in (int, float, str, np.int64, np.float32, torch.tensor)])
def test_any_kind_of_number_is_accepted(answer):
    assert ex.check("01-zero3-fewest-gpus", answer).correct


def test_an_unknown_id_lists_the_known_ones():
    with pytest.raises(ValueError, match="01-zero3-fewest-gpus"):
        ex.check("01-no-such-exercise", 1)
    with pytest.raises(ValueError, match="known"):
        ex.solution("99")


def test_a_later_lab_registers_its_own(monkeypatch):
    monkeypatch.setattr(ex.core, "_REGISTRY", dict(ex.core._REGISTRY))   # the registry's home

    @ex.register("99-kv-bytes", question="KV cache of tiny at 128 tokens?", unit="bytes",
                 hint="lk.kv_cache_bytes", solution="{answer:,} bytes", rtol=0)
    def _():
        return {"answer": lk.kv_cache_bytes("tiny", seq=128)}

    assert "99-kv-bytes" in ex.exercises("99")
    assert ex.check("99-kv-bytes", lk.kv_cache_bytes("tiny", seq=128))
    with pytest.raises(ValueError, match="already registered"):
        ex.register("99-kv-bytes", question="", unit="", hint="", solution="")(_)


def test_the_autocast_copies_exercise_agrees_with_the_estimates_weight_cache():
    cache = lk.estimate("llama-2-7b", precision="bf16-mixed").saved_weight_cache
    assert ex.get("02-autocast-weight-copies").answer() == cache / GiB


def test_the_lab_05_answers_agree_with_the_closed_forms_and_the_estimate():
    per_gpu = lk.estimate("llama-2-7b", 1, 16, layout=lk.Layout(tp=8)).details[
        "parameters on this device"]
    assert ex.get("05-tp8-param-share").answer() == pytest.approx(
        100 * per_gpu / lk.count_params("llama-2-7b").total, rel=1e-12)
    assert not ex.check("05-tp8-param-share", 12.5)              # the norms are replicated
    assert ex.get("05-1f1b-in-flight").answer() == 8             # min(m, p - s) at s = 0
    assert ex.get("05-bubble-m").answer() == 134                 # 7/(m + 7) < 0.05: m > 133
    assert not ex.check("05-bubble-m", 133)                      # 7/140 is 5%, not under
    assert ex.get("05-bubble-m").compute()["interleaved"] == 72  # groups of p = 8: 72, not 67
    v3 = 58 * (256 // 256) * 3 * 7168 * 2048                     # DeepSeek-V3's config
    assert ex.get("05-v3-experts-per-gpu").answer() == v3 / 1e9


def test_the_lab_06_answers_agree_with_the_closed_forms_and_the_estimate():
    c, n = lk.preset("llama-2-7b"), lk.count_params("llama-2-7b").total
    assert ex.get("06-nf4-bits").answer() == 4 + 8 / 64 + 32 / (64 * 256)   # QLoRA: 4.127
    assert ex.check("06-nf4-bits", 4.127) and not ex.check("06-nf4-bits", 4.5)
    # r (in + out) per target: wq, wo (h <-> heads x head_dim), wk, wv, and the three SwiGLU ones
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    per_layer = 16 * (2 * (c.hidden + q) + 2 * (c.hidden + kv) + 3 * (c.hidden + c.ffn))
    share = ex.get("06-lora-share").compute()
    assert share["answer"] == pytest.approx(100 * c.layers * per_layer / n, rel=1e-12)
    assert share["qv"] == c.layers * 8 * (2 * c.hidden + q + kv)
    # every LLaMA-2-7B tensor holds a multiple of 256 numbers and none is under 4096
    assert ex.get("06-adamw8bit-state").answer() * GiB == n * (2 + 2 * 4 / 256)
    eight_bit = lk.estimate(c, precision="fp32", optimizer="adamw-8bit").optimizer
    assert ex.get("06-adamw8bit-state").answer() * GiB == eight_bit - 2 * 256 * 4  # less the maps
    assert not ex.check("06-adamw8bit-state", 2 * n / GiB)       # the absmax scales forgotten
    qlora = lk.estimate(c, 1, 2048, recipe=lk.Recipe("bf16-master", trainable="lora",
                                                     weight_format="nf4"))
    assert ex.get("06-qlora-7b-peak").answer() == qlora.total / GiB
    assert not ex.check("06-qlora-7b-peak", ex.get("06-qlora-7b-peak").compute()["lora"])


def test_the_lab_07_answers_agree_with_the_closed_forms_and_the_caches():
    c7, T = lk.preset("llama-2-7b"), 4096
    saved = {a: lk.estimate(c7, 1, T, precision="bf16-mixed", attention=a).saved_activations
             for a in ("naive", "sdpa")}
    # MHA: the estimates differ by every layer's probabilities (fp32 softmax (4) + bf16 copy
    # (2) per pair), less SDPA's fp32 log-sum-exp
    assert saved["naive"] - saved["sdpa"] == c7.layers * (c7.heads * T * T * 6 - 4 * c7.heads * T)
    # GQA (mistral-7b, 32 heads on 8 kv heads): naive also keeps k and v repeated to 32 heads
    m7 = lk.preset("mistral-7b")
    H, Hkv, d, L = m7.heads, m7.kv_heads, m7.head_dim, m7.layers
    gap = L * (H * T * T * 6 + 2 * (H - Hkv) * T * d * 2 - 4 * H * T)
    assert ex.get("07-naive-minus-sdpa-gqa").answer() * GiB == gap
    assert not ex.check("07-naive-minus-sdpa-gqa", L * (H * T * T * 6 - 4 * H * T) / GiB)  # no k, v
    assert not ex.check("07-naive-minus-sdpa-gqa", L * (H * T * T * 4 - 4 * H * T) / GiB)  # no copy
    all_heads = gap + L * 2 * Hkv * T * d * 2                    # k and v counted at all 32 heads
    assert not ex.check("07-naive-minus-sdpa-gqa", all_heads / GiB)
    # the tiled core (4 (H, N, d) tensors, 2 (H, N) rows, 5 (H, b, b) tiles, fp32) passes SDPA's
    # 5 (H, N, d) tensors at N = 2048 from 256-row tiles: 5 H b^2 > H N d - 2 H N (numbers)
    tiled = ex.get("07-tiled-peak-block").compute()
    H, N, d = 8, 2048, 64
    assert tiled["answer"] == 256 and tiled["sdpa"] * 2**20 == 5 * H * N * d * 4
    for b, peak in tiled["measured"].items():
        assert peak == 4 * H * N * d * 4 + 2 * H * N * 4 + 5 * H * b * b * 4
        assert (peak > tiled["sdpa"] * 2**20) == (b == 256)
    assert min(b for b in (64, 128, 256, 512) if 5 * H * b * b > H * N * d - 2 * H * N) == 256
    assert not ex.check("07-tiled-peak-block", 128)                  # the default tiles stay below
    # the paged server of section 5: none sent back from a 25% watermark (steps of 5%)
    w = ex.get("07-watermark-no-preemption").compute()
    assert w["answer"] == 25 and w["running"] < w["eager"] and w["eager_preempted"] > 0
    assert not ex.check("07-watermark-no-preemption", 20)
    # LLaMA-2-13B in fp16: 2 x 40 layers x 40 heads x 128 x 2 bytes per token; 15 empty slots
    paged = ex.get("07-paged-waste").compute()
    per_token = 2 * 40 * 40 * 128 * 2
    assert paged["answer"] * 2**20 == 15 * per_token == paged["measured"]
    assert paged["contiguous"] * 2**20 == (2048 - 300) * per_token
    assert paged["paged_used"] * 2**20 == (19 * 16 - 300) * per_token
    assert not ex.check("07-paged-waste", 16 * per_token / 2**20)  # a whole block is not wasted
