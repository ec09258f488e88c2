"""labkit.predict.sweep: savings over batch x sequence, and the edges where a verdict changes."""
import pytest

from labkit.predict import estimate
from labkit.predict.sweep import first, peak_leaves_optimizer, saving, sweep

FP32 = {"precision": "fp32"}


def test_autocast_saves_nothing_while_the_optimizer_step_sets_the_peak():
    changes = {p: {"precision": p} for p in ("bf16-mixed", "bf16-master", "bf16")}
    by = {r.label: r for r in sweep("llama-2-7b", changes, [1], [512], baseline=FP32)}
    assert by["bf16-mixed"].peak == by["bf16-mixed"].baseline_peak          # 0%: fp32 states
    assert by["bf16-master"].moment == "optimizer step"
    # 22 bytes per parameter (2 + 16 + fp32 gradient copies 4) against 20 (16 + foreach's 4)
    assert by["bf16-master"].peak / by["bf16-master"].baseline_peak == pytest.approx(22 / 20,
                                                                                    rel=1e-3)
    assert not by["bf16"].saves(50) and by["bf16"].saves(49)
    assert saving("llama-2-7b", 8, 8192, {"precision": "bf16-mixed"}, FP32).moment.startswith(
        "backward")


def test_a_saving_is_the_two_estimates_it_compares():
    s = saving("small", 2, 1024, {"recompute": "full"}, precision="bf16-mixed", device="cpu")
    step = dict(batch=2, seq=1024, precision="bf16-mixed", device="cpu")
    assert s.peak == estimate("small", recompute="full", **step).total
    assert s.baseline_peak == estimate("small", **step).total
    assert s.label == "recompute=full" and s.tokens == 2048
    assert s.saves(int(100 * s.saved)) and not s.saves(int(100 * s.saved) + 1)


def test_first_is_the_edge_of_a_condition_that_stays_true():
    calls = []

    def holds(n):
        calls.append(n)
        return n >= 1000
    assert first(holds, 0, 4096) == 1000
    assert len(calls) <= 14                                    # a bisection, not a scan
    assert first(lambda n: False, 0, 4096) is None
    assert first(lambda n: True, 0, 4096) == 1


def test_the_crossover_is_where_the_peak_leaves_the_optimizer_step():
    step = dict(precision="bf16-mixed")
    seq = peak_leaves_optimizer("llama-2-7b", **step)
    assert estimate("llama-2-7b", 1, seq, **step).peak_phase != "optimizer"
    assert estimate("llama-2-7b", 1, seq - 1, **step).peak_phase == "optimizer"
    # at batch 2 the same tokens per step come at about half the length
    assert peak_leaves_optimizer("llama-2-7b", batch=2, **step) == pytest.approx(seq / 2, rel=0.01)
    on_512 = peak_leaves_optimizer("llama-2-7b", multiple=512, **step)
    assert on_512 % 512 == 0 and on_512 - 512 < seq <= on_512
