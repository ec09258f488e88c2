"""Recompute policies trade memory for compute without changing a single gradient bit."""
import pytest
import torch

import labkit as lk
from labkit.transformer.checkpointing import (RECOMPUTE_POLICIES, Unit, apply_recompute,
                                              counted_step_flops, keep_matmuls_and_attention, plan,
                                              recompute_cost, step_flops)
from torch.utils.checkpoint import CheckpointPolicy

POLICIES = ["none", "selective", "every-k", "every-3", "sqrt", "full"]


def _gradients(model, tokens, autocast, **packing):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(tokens[:, :-1], tokens[:, 1:], **packing)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_every_policy_gives_bit_identical_gradients_to_keeping_everything(name, autocast):
    torch.manual_seed(0)
    model = lk.build_model(lk.preset(name))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 33))
    reference = _gradients(apply_recompute(model, "none"), tokens, autocast)
    for policy in POLICIES:
        grads = _gradients(apply_recompute(model, policy), tokens, autocast)
        # the recomputed forward runs the same kernels on the same inputs: equal to the bit
        assert all(torch.equal(a, b) for a, b in zip(reference, grads)), policy


def test_packed_rows_recompute_with_their_mask_and_positions_to_the_same_gradients():
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("tiny-moe"))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 33))
    doc_ids = torch.tensor([[0] * 12 + [1] * 20, [0] * 25 + [-1] * 7])        # (B, T)
    position_ids = torch.cat([torch.arange(12), torch.arange(20), torch.arange(32)]).view(2, 32)
    packing = dict(position_ids=position_ids, doc_ids=doc_ids)
    reference = _gradients(apply_recompute(model, "none"), tokens, False, **packing)
    assert not all(torch.equal(a, b) for a, b in zip(reference, _gradients(model, tokens, False)))
    for policy in POLICIES:
        grads = _gradients(apply_recompute(model, policy), tokens, False, **packing)
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


def test_switching_policies_keeps_the_same_parameters_and_their_names():
    model = lk.build_model(lk.preset("tiny-moe"))
    names, params = list(model.state_dict()), list(model.parameters())
    for policy, recompute in (("sqrt", [2, 0, 1]), ("full", [1, 1, 1]), ("none", [0, 0, 0]),
                              ("every-3", [0, 0, 1]), ("sqrt", [2, 0, 1])):
        apply_recompute(model, policy)
        assert model.recompute == recompute, policy
        assert list(model.state_dict()) == names, policy
        assert all(a is b for a, b in zip(params, model.parameters(), strict=True)), policy


def test_selective_saves_matmuls_and_attention_and_recomputes_elementwise_ops():
    aten = torch.ops.aten
    for op in (aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert keep_matmuls_and_attention(None, op) == CheckpointPolicy.MUST_SAVE
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


@pytest.mark.parametrize("policy", ["none", "full", "selective", "every-2", "every-3", "sqrt"])
def test_step_flops_summed_block_by_block_equal_the_whole_models_count(policy):
    # 7 blocks, 2 dense and 5 MoE: sqrt's first unit (blocks 0-2) holds both kinds
    cfg = lk.preset("tiny-moe").replace(layers=7, dense_layers=2)
    assert step_flops(cfg, policy, seq=64) == counted_step_flops(cfg, policy, seq=64)


def test_bad_policy_names_raise_listing_the_valid_ones():
    model = lk.build_model(lk.preset("tiny"))
    for bad in ("checkpoint", "every-x", None):
        with pytest.raises(ValueError, match=", ".join(RECOMPUTE_POLICIES)):
            apply_recompute(model, bad)
    with pytest.raises(ValueError, match="every=1 recomputes every block"):
        apply_recompute(model, "every-k", every=0)
    with pytest.raises(ValueError, match="unknown recompute policy 'sqrt-n'"):
        lk.measure_step("tiny", seq=64, recompute="sqrt-n")
