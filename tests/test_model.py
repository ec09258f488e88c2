"""The transformer builds from every preset, trains, and its layers do what the papers say."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import labkit as lk
from labkit.transformer.model import (LatentAttention, MoE, Rotary, SwiGLU, attention_core,
                                      grouped_mm)


@pytest.mark.parametrize("name", lk.presets())
def test_count_params_equals_the_module_built_on_fake_tensors(name):
    cfg = lk.preset(name)
    with FakeTensorMode():
        model = lk.build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == lk.count_params(cfg).total


def test_llama_2_7b_has_its_published_parameter_count():
    assert lk.count_params("llama-2-7b").total == 6_738_415_616


@pytest.mark.parametrize("name, total", [
    ("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496),
    ("qwen2.5-7b", 7_615_616_512), ("mixtral-8x7b", 46_702_792_704),
    ("qwen3-30b-a3b", 30_532_122_624), ("llama-3.1-405b", 405_853_388_800),
    ("qwen2.5-72b", 72_706_203_648), ("qwen3-8b", 8_190_735_360),
    ("gemma-3-1b", 999_885_952), ("gemma-2-9b", 9_241_705_984)])
def test_current_presets_have_their_hugging_face_parameter_counts(name, total):
    # the checkpoints' model.safetensors.index.json: total_size / 2 bytes of bf16; gemma-3-1b
    # (one model.safetensors): the count of transformers' Gemma3ForCausalLM on the meta device;
    # gemma-2-9b: 18,483,411,968 bytes in its index, also Gemma2ForCausalLM's count on meta
    assert lk.count_params(name).total == total


@pytest.mark.parametrize("name, active", [("mixtral-8x7b", 12.9e9), ("qwen3-30b-a3b", 3.3e9)])
def test_current_moe_presets_have_their_published_active_counts(name, active):
    assert lk.count_params(name).active == pytest.approx(active, rel=0.02)


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
    # the attention output depends on x only through wq(x) and wkv_a(x) (kv_lora + rope numbers
    # per token: what the KV cache holds): replace wkv_a's output and the output follows
    torch.manual_seed(0)
    cfg = lk.preset("tiny-moe")
    attn, rope = LatentAttention(cfg), Rotary(cfg.rope_dim, 64, cfg.rope_theta)
    x = torch.randn(1, 6, cfg.hidden)
    latent = attn.wkv_a(x)                                          # (1, 6, kv_lora + rope)
    assert latent.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_dim
    attn.wkv_a.forward = lambda _: latent                           # same latent, any input
    attn.wq.forward = lambda _, q=attn.wq(x): q
    torch.testing.assert_close(attn(torch.zeros_like(x), rope), attn(x, rope))


def _moe(**overrides):
    torch.manual_seed(0)
    cfg = lk.preset("tiny-moe", **overrides)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return cfg, moe


def _per_token_reference(moe, cfg, x):
    """y[t] = sum over the k chosen experts e of weight(t, e) * expert_e(x[t]) (+ shared(x[t]))."""
    weights, ids = moe.route(x.view(-1, cfg.hidden))
    rows = []
    for t in range(x.shape[1]):
        y = sum(weights[t, j] * moe.experts.expert(int(ids[t, j]), x[0, t]) for j in range(cfg.top_k))
        rows.append(y + moe.shared(x[0, t]) if moe.shared is not None else y)
    return torch.stack(rows)


def test_moe_sends_each_token_to_top_k_experts_and_weights_them():
    cfg, moe = _moe(shared_experts=0)
    x = torch.randn(1, 5, cfg.hidden)
    torch.testing.assert_close(moe(x)[0], _per_token_reference(moe, cfg, x), rtol=1e-5, atol=1e-6)


def test_one_routed_expert_is_a_swiglu_on_views_of_the_stacked_weights():
    cfg, moe = _moe()
    swiglu = SwiGLU(cfg.hidden, cfg.moe_ffn)
    with torch.no_grad():
        for name in ("w_gate", "w_up", "w_down"):
            getattr(swiglu, name).weight.copy_(getattr(moe.experts, name)[3])
    x = torch.randn(7, cfg.hidden)
    torch.testing.assert_close(moe.experts.expert(3, x), swiglu(x), rtol=0, atol=0)
    w = moe.experts.w_gate
    assert w[3].untyped_storage().data_ptr() == w.untyped_storage().data_ptr()    # a view


def test_grouped_moe_gives_the_per_expert_outputs_and_gradients():
    # fp32, only the order of the sums differs: a few ulps
    TIGHT = dict(rtol=1e-5, atol=1e-5)
    cfg, moe = _moe()
    x = torch.randn(2, 24, cfg.hidden, requires_grad=True)
    target = torch.randn(2, 24, cfg.hidden)
    (moe(x) * target).sum().backward()
    grouped = {name: p.grad.clone() for name, p in moe.named_parameters()}
    grouped_x = x.grad.clone()
    # reference: each token through each of its experts, one at a time, on views of the weights
    moe.zero_grad()
    x.grad = None
    reference = torch.stack([_per_token_reference(moe, cfg, x[b:b + 1]) for b in range(2)])
    torch.testing.assert_close(moe(x), reference, **TIGHT)
    (reference * target).sum().backward()
    torch.testing.assert_close(grouped_x, x.grad, **TIGHT)
    for name, p in moe.named_parameters():
        if name.startswith("experts."):                  # (E, out, in)
            for e in range(cfg.routed_experts):          # slice by slice: expert e's weights
                torch.testing.assert_close(grouped[name][e], p.grad[e], **TIGHT)
        else:
            torch.testing.assert_close(grouped[name], p.grad, **TIGHT)


def test_an_expert_that_gets_no_tokens_gets_a_zero_gradient():
    torch.manual_seed(0)
    x, w = torch.randn(5, 16, requires_grad=True), torch.randn(3, 8, 16, requires_grad=True)
    y = grouped_mm(x, w, [2, 0, 3])                                        # expert 1 unused
    torch.testing.assert_close(y, torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T]))
    y.square().sum().backward()
    assert torch.equal(w.grad[1], torch.zeros(8, 16)) and w.grad[0].abs().sum() > 0


def test_grouped_matmul_runs_in_bf16_under_autocast_and_on_fake_tensors():
    cfg, moe = _moe()
    x = torch.randn(1, 8, cfg.hidden, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    y.sum().backward()
    assert moe.experts.w_down.grad.dtype == torch.float32 and moe.experts.w_down.grad.abs().sum() > 0
    with FakeTensorMode():
        moe = MoE(cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(torch.randn(1, 8, cfg.hidden))
        y.sum().backward()
    assert moe.experts.w_gate.grad.shape == (cfg.routed_experts, cfg.moe_ffn, cfg.hidden)


def test_flop_counter_counts_the_grouped_matmuls_as_matmuls():
    from torch.utils.flop_counter import FlopCounterMode
    cfg, moe = _moe(shared_experts=0)
    N = 10
    x = torch.randn(1, N, cfg.hidden, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        moe(x).sum().backward()
    router = 2 * N * cfg.hidden * cfg.routed_experts
    experts = 3 * 2 * N * cfg.top_k * cfg.hidden * cfg.moe_ffn                # gate, up, down
    assert counter.get_total_flops() == 3 * (router + experts)            # backward: 2x forward


def test_stacked_expert_weights_are_initialised_like_every_matrix():
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("tiny-moe", routed_experts=64))
    w = model.blocks[1].mlp.experts.w_gate
    assert w.shape == (64, 32, 64)                                         # (E, moe_ffn, hidden)
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001


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
    assert model.blocks[3].mlp.experts.w_down.grad.shape == (256, 7168, 2048)     # (E, hidden, moe_ffn)


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


def test_deepseek_v3s_router_bias_is_moved_by_its_rule_not_trained():
    """Top-k selection has no gradient: the bias is frozen (Hugging Face: a buffer), so no
    optimizer decays it or keeps state for it, and the estimate counts its bytes but no
    gradient or state."""
    cfg = lk.preset("tiny-moe").replace(router_bias=True)
    model = lk.build_model(cfg)
    rows = torch.randint(0, cfg.vocab_size, (2, 17))
    model(rows[:, :-1], rows[:, 1:]).backward()
    biases = [m.router_bias for m in model.modules() if getattr(m, "router_bias", None) is not None]
    assert biases and all(not b.requires_grad and b.grad is None for b in biases)
    with_bias, without = (lk.estimate(c, 1, 16, precision="bf16-master", device="cpu")
                          for c in (cfg, cfg.replace(router_bias=False)))
    frozen = sum(b.numel() for b in biases) * 2                          # bf16
    states, plain = with_bias.details["model states"], without.details["model states"]
    assert states == plain | {"params": plain["params"] + frozen}
