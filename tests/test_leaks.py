"""Everyday leaks (labkit.training.leaks): each habit's growth per step is the bytes of what it
keeps, exactly, and its fix grows by nothing."""
import pytest

import labkit as lk
from labkit.training.leaks import LEAKS, run_leak

B, T = 2, 64


@pytest.fixture(scope="module")
def tiny():
    return lk.preset("tiny")


def test_kept_logits_grow_by_one_fp32_batch_of_logits_a_step(tiny):
    leaking, fixed = (run_leak("outputs kept", f, steps=3) for f in (False, True))
    assert leaking.per_step == B * T * tiny.vocab_size * 4
    assert fixed.per_step == 0 and fixed.after_step[0] == fixed.after_step[-1]


def test_a_hook_that_keeps_a_blocks_output_grows_by_it_a_step(tiny):
    leaking, fixed = (run_leak("hook keeps activations", f, steps=3) for f in (False, True))
    assert leaking.per_step == B * T * tiny.hidden * 4
    assert fixed.per_step == 0


def test_an_eval_loop_summing_tensor_losses_keeps_each_batchs_saved_activations(tiny):
    leaking, fixed = (run_leak("eval loss as a tensor", f, steps=3) for f in (False, True))
    # what one forward keeps for a backward that never comes, a batch at a time: the estimate's
    # saved activations (measured 1,547,780 bytes a batch, the estimate 1,547,796); the sum
    # itself is one 4-byte tensor. Under no_grad nothing stays
    saved = lk.estimate(tiny, B, T, precision="fp32").saved_activations
    assert leaking.per_step == pytest.approx(saved, abs=32)
    steps = [b - a for a, b in zip([4] + leaking.after_step, leaking.after_step)]
    assert steps == [leaking.per_step] * 3
    assert fixed.after_step == [0, 0, 0]


def test_the_faqs_train_loss_as_a_tensor_keeps_no_device_memory_after_backward():
    leaking = run_leak("train loss as a tensor", False, steps=3)
    assert leaking.per_step == 0       # backward freed the saved tensors; the graph is host memory


def test_an_unknown_leak_names_the_known_ones():
    with pytest.raises(ValueError, match="outputs kept"):
        run_leak("tensors everywhere")
    with pytest.raises(ValueError, match="steps=4"):
        run_leak(LEAKS[0], steps=1)
