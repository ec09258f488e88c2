"""The transformer builds from every preset, trains, and its layers do what the papers say."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import labkit as lk
from labkit.model import LatentAttention, MoE, attention_core


SLOW_TO_BUILD = {"deepseek-v2", "deepseek-v3"}      # tens of thousands of expert modules


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TO_BUILD
                                  else n for n in lk.presets()])
def test_count_params_equals_the_module_built_on_fake_tensors(name):
    cfg = lk.preset(name)
    with FakeTensorMode():
        model = lk.build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == lk.count_params(cfg).total


def test_llama_2_7b_has_its_published_parameter_count():
    assert lk.count_params("llama-2-7b").total == 6_738_415_616


@pytest.mark.parametrize("name, total, active", [
    ("deepseek-v2", 236e9, 21e9), ("deepseek-v3", 671e9, 37e9), ("deepseek-moe-16b", 16.4e9, 2.8e9),
])
def test_moe_totals_and_active_counts_round_to_the_published_figures(name, total, active):
    pc = lk.count_params(name)
    assert pc.total == pytest.approx(total, rel=0.01)
    assert pc.active == pytest.approx(active, rel=0.03)


def test_deepseek_v2_lite_published_active_count_excludes_the_input_embedding():
    pc = lk.count_params("deepseek-v2-lite")
    assert pc.active / 1e9 > 2.6                                          # 2.66B with it
    assert 2.4 <= (pc.active - pc.by_component["embedding"]) / 1e9 < 2.5  # "2.4B" without


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_a_few_steps_lower_the_loss_on_a_repeated_batch(name):
    torch.manual_seed(0)
    model = lk.build_model(lk.preset(name))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 65))
    losses = []
    for _ in range(8):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


def test_grouped_query_attention_equals_repeating_the_key_value_heads():
    torch.manual_seed(0)
    q = torch.randn(2, 8, 16, 32)
    k, v = torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    reference = F.scaled_dot_product_attention(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True)
    torch.testing.assert_close(attention_core(q, k, v), reference)


def test_mla_pads_values_to_the_query_width_without_changing_the_result():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 16, 24), torch.randn(1, 4, 16, 24)
    v = torch.randn(1, 4, 16, 16)
    padded = attention_core(q, k, F.pad(v, (0, 8)))[..., :16]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(padded, reference)


def test_mla_keys_and_values_come_from_the_latent_and_one_shared_rope_key():
    cfg = lk.preset("tiny-moe")
    attn = LatentAttention(cfg)
    # what the KV cache would hold: the wkv_a output, kv_lora + rope numbers per token
    assert attn.wkv_a.out_features == cfg.kv_lora_rank + cfg.qk_rope_dim
    assert attn.wkv_b.in_features == cfg.kv_lora_rank


def test_moe_sends_each_token_to_top_k_experts_and_weights_them():
    torch.manual_seed(0)
    cfg = lk.preset("tiny-moe", shared_experts=0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 5, cfg.hidden)
    weights, ids = moe.route(x.view(5, -1))
    expected = torch.stack([
        sum(weights[t, j] * moe.experts[ids[t, j]](x[0, t]) for j in range(cfg.top_k))
        for t in range(5)])
    torch.testing.assert_close(moe(x)[0], expected, rtol=1e-5, atol=1e-6)


def test_moe_on_fake_tensors_assumes_balanced_routing():
    cfg = lk.preset("tiny-moe")
    with FakeTensorMode():
        moe = MoE(cfg)
        ids = torch.zeros(10, cfg.top_k, dtype=torch.long)
        counts = moe.tokens_per_expert(ids)
    assert sum(counts) == 10 * cfg.top_k and max(counts) - min(counts) <= 1


def test_deepseek_v3_builds_and_runs_a_step_on_fake_tensors():
    cfg = lk.preset("deepseek-v3", layers=4)      # 3 dense + 1 MoE layer of full width
    with FakeTensorMode():
        model = lk.build_model(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (1, 17))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    assert model.blocks[3].mlp.experts[0].w_down.weight.grad.shape == (7168, 2048)


def test_sequence_longer_than_the_rope_tables_is_refused():
    model = lk.build_model(lk.preset("tiny", max_seq=32))
    with pytest.raises(ValueError, match="exceeds max_seq=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_full_recompute_gives_identical_gradients():
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("tiny-moe"))
    tokens = torch.randint(0, 256, (2, 33))
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        model.recompute = [recompute] * len(model.blocks)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
