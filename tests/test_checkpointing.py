"""Recompute policies trade memory for compute without changing a single gradient bit."""
import pytest
import torch

import labkit as lk
from labkit.checkpointing import (RECOMPUTE_POLICIES, Unit, apply_recompute, blocks_of,
                                  keep_matmuls_and_attention, plan, recompute_cost)
from torch.utils.checkpoint import CheckpointPolicy

POLICIES = ["none", "selective", "every-k", "every-3", "sqrt", "full"]


def _gradients(model, tokens):
    model.zero_grad(set_to_none=True)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_every_policy_gives_bit_identical_gradients_to_keeping_everything(name):
    torch.manual_seed(0)
    model = lk.build_model(lk.preset(name))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 33))
    reference = _gradients(apply_recompute(model, "none"), tokens)
    for policy in POLICIES:
        grads = _gradients(apply_recompute(model, policy), tokens)
        # the recomputed forward runs the same kernels on the same inputs: equal to the bit
        assert all(torch.equal(a, b) for a, b in zip(reference, grads)), policy


def test_every_k_recomputes_one_block_in_every_k():
    assert [u.recompute for u in plan(6, "every-k", every=3)] == [False, False, True] * 2
    assert plan(6, "every-3") == plan(6, "every-k", every=3)
    assert plan(6, "every-k", every=1) == plan(6, "full")
    assert not any(u.recompute for u in plan(2, "every-3"))     # fewer blocks than k


def test_sqrt_cuts_n_blocks_into_segments_of_about_sqrt_n():
    assert plan(9, "sqrt") == [Unit(0, 3, True), Unit(3, 6, True), Unit(6, 9, True)]
    assert plan(3, "sqrt") == [Unit(0, 2, True), Unit(2, 3, True)]
    assert len(plan(64, "sqrt")) == 8


def test_switching_policies_keeps_the_same_parameters_and_restores_their_names():
    model = lk.build_model(lk.preset("tiny-moe"))
    names, params = list(model.state_dict()), list(model.parameters())
    apply_recompute(model, "sqrt")
    assert len(model.blocks) == 2 and len(blocks_of(model)) == 3
    assert all(a is b for a, b in zip(params, model.parameters()))
    apply_recompute(model, "full")
    assert list(model.state_dict()) == names and model.recompute == [True] * 3


def test_selective_saves_matmuls_and_attention_and_recomputes_elementwise_ops():
    aten = torch.ops.aten
    assert keep_matmuls_and_attention(None, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert keep_matmuls_and_attention(
        None, aten._scaled_dot_product_flash_attention_for_cpu.default) == CheckpointPolicy.MUST_SAVE
    for op in (aten.rsqrt.default, aten.silu.default, aten.mul.Tensor):
        assert keep_matmuls_and_attention(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


def test_saved_activations_fall_from_none_through_selective_and_every_k_to_full():
    saved = {p: lk.measure_step("tiny-moe", seq=64, precision="fp32", recompute=p,
                                fake=False).saved_activations for p in POLICIES}
    assert saved["none"] > saved["selective"] > saved["full"]
    assert saved["none"] > saved["every-k"] > saved["full"]
    assert saved["every-3"] == saved["every-k"]      # 3 layers: each recomputes one MoE block


def test_sqrt_keeps_fewer_inputs_than_full_but_rebuilds_a_whole_segment_at_once():
    full, sqrt = (lk.measure_step("tiny-moe", seq=64, precision="fp32", recompute=p,
                                  fake=False) for p in ("full", "sqrt"))
    h = lk.preset("tiny-moe").hidden
    # one block input fewer: the second block of the first segment is not kept
    assert full.saved_activations - sqrt.saved_activations == 64 * h * 4
    assert sqrt.total > full.total                   # two blocks recomputed together


def test_recompute_costs_about_one_more_forward_of_the_recomputed_blocks():
    cost = {p: recompute_cost("tiny", p, seq=64, fake=False).extra for p in POLICIES}
    assert cost["none"] == 0 and cost["selective"] == 0    # no matmul runs twice
    assert 0.15 < cost["full"] < 1 / 3                # 1/3 if the LM head recomputed too
    assert cost["every-k"] == pytest.approx(cost["full"] / 2)   # 1 of tiny's 2 equal blocks
    moe = {p: recompute_cost("tiny-moe", p, seq=64, fake=False).extra for p in ("sqrt", "full")}
    assert moe["sqrt"] > moe["full"]                 # a segment also rebuilds its inner outputs


def test_bad_policy_names_raise_listing_the_valid_ones():
    model = lk.build_model(lk.preset("tiny"))
    for bad in ("checkpoint", "every-x", None):
        with pytest.raises(ValueError, match=", ".join(RECOMPUTE_POLICIES)):
            apply_recompute(model, bad)
    with pytest.raises(ValueError, match="every=1 recomputes every block"):
        apply_recompute(model, "every-k", every=0)
    with pytest.raises(ValueError, match="unknown recompute policy 'sqrt-n'"):
        lk.measure_step("tiny", seq=64, recompute="sqrt-n")
