"""Hugging Face models: from_hf_config predicts them, and measure_step measures them as they are.

Small configs built with transformers (no download): each mapped config has the Hugging
Face model's parameter count, and labkit's model loaded with the Hugging Face weights
computes the same logits.
"""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from transformers import (AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config,  # noqa: E402
                          Gemma2Config, Gemma3Config, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, MixtralConfig, Olmo2Config, Olmo3Config, Phi3Config,
                          Qwen2Config, Qwen3Config, Qwen3MoeConfig)

import labkit as lk  # noqa: E402

transformers.logging.set_verbosity_error()

SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=300, max_position_embeddings=128)
MLA = dict(q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12, num_key_value_heads=4)
MOE = dict(n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
           moe_intermediate_size=32, first_k_dense_replace=1, num_hidden_layers=3)

CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL, num_key_value_heads=2),
    "mistral": lambda: MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=64),
    "qwen2": lambda: Qwen2Config(**SMALL, num_key_value_heads=2),
    "qwen2-tied": lambda: Qwen2Config(**SMALL, num_key_value_heads=1, tie_word_embeddings=True),
    "mixtral": lambda: MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2),
    # head_dim 32 with 4 heads of a 64-wide model: wider than hidden / heads, as Qwen3-0.6B's
    "qwen3": lambda: Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=32),
    "phi3": lambda: Phi3Config(**SMALL, num_key_value_heads=2, pad_token_id=0),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SMALL, num_key_value_heads=2, head_dim=32, num_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=32),
    # Gemma 3: four norms a layer, GeGLU, q and k norms, heads wider than hidden / heads, tied;
    # one RoPE base for both kinds of layer and a window longer than the test's rows, so that
    # the logits compare (both change values only); query_pre_attn_scalar = head_dim likewise
    "gemma3_text": lambda: Gemma3TextConfig(
        **SMALL, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
        rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0}
                         for kind in ("full_attention", "sliding_attention")}),
    # Gemma 2 with its soft-capping made to bite: the small model's scores and logits are
    # about 0.1-1 where released Gemma 2 caps at 50 and 30, so the caps are scaled down alike
    "gemma2": lambda: Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=32,
                                   query_pre_attn_scalar=32, sliding_window=64,
                                   attn_logit_softcapping=0.1, final_logit_softcapping=0.3),
    # OLMo 2: norms after each sub-layer only, q and k normalised over all heads; OLMo 3 adds
    # sliding-window layers (a window longer than the test's rows: the same logits)
    "olmo2": lambda: Olmo2Config(**SMALL, num_key_value_heads=2),
    "olmo3": lambda: Olmo3Config(**SMALL, num_key_value_heads=2, sliding_window=64),
    "deepseek_v2": lambda: DeepseekV2Config(**{**SMALL, **MLA, **MOE}),
    "deepseek_v3": lambda: DeepseekV3Config(**{**SMALL, **MLA, **MOE, "q_lora_rank": 20,
                                               "n_group": 2, "topk_group": 1}),
}
# DeepSeek's attention (MLA) alone: every layer dense, so the logits compare (see below)
DENSE_MLA = {
    "deepseek_v2": lambda: DeepseekV2Config(**SMALL, **MLA, first_k_dense_replace=2),
    "deepseek_v3": lambda: DeepseekV3Config(**{**SMALL, **MLA, "q_lora_rank": 20,
                                               "first_k_dense_replace": 2}),
}


def hf_model(config):
    torch.manual_seed(0)
    # Gemma 2 has no SDPA path in transformers (SDPA cannot soft-cap): eager
    attention = "eager" if config.model_type == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention)


# ---- the mapping ---------------------------------------------------------------------------
def component(name: str) -> str:
    """The count_params component a Hugging Face parameter belongs to."""
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm head"
    if ".self_attn." in name:
        return "attention"                # MLA's inner norms included, as count_params does
    if "layernorm" in name or name == "model.norm.weight":
        return "norms"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp.shared_experts." in name:
        return "shared experts"
    if ".mlp.experts." in name:
        return "routed experts"
    return "dense mlp"


def hf_counts(model) -> dict:
    """Parameters by component. DeepSeek-V3's router bias (e_score_correction_bias) is a
    buffer in transformers - it is not trained by gradients - and a parameter in labkit."""
    counts = {}
    tensors = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, p in tensors:
        counts[component(name)] = counts.get(component(name), 0) + p.numel()
    return counts


@pytest.mark.parametrize("kind", CONFIGS)
def test_mapped_config_has_the_hugging_face_parameter_count(kind):
    config = CONFIGS[kind]()
    model = hf_model(config)
    ours = lk.count_params(lk.from_hf_config(config))
    assert ours.by_component == hf_counts(model)
    bias = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    assert ours.total == sum(p.numel() for p in model.parameters()) + bias


@pytest.mark.parametrize("kind", CONFIGS)
def test_a_config_dict_maps_like_the_config_object(kind):
    config = CONFIGS[kind]()
    assert lk.from_hf_config(config.to_dict()) == lk.from_hf_config(config)


def test_maps_every_named_field_of_a_deepseek_v3_config():
    cfg = lk.from_hf_config(CONFIGS["deepseek_v3"]())
    assert (cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.qk_rope_dim,
            cfg.v_head_dim) == ("mla", 20, 24, 16, 8, 12)
    assert (cfg.routed_experts, cfg.shared_experts, cfg.top_k, cfg.moe_ffn, cfg.dense_layers,
            cfg.router_bias) == (8, 2, 2, 32, 1, True)
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.ffn, cfg.vocab_size, cfg.max_seq) == (
        64, 3, 4, 160, 300, 128)


def _as_config_json(config) -> dict:
    """A config as an older config.json has it: no ``layer_types``."""
    return {k: v for k, v in config.to_dict().items() if k != "layer_types"}


GEMMA3_12 = Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 12}, sliding_window=64)


@pytest.mark.parametrize("config, window, every, windowed", [
    (MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=64), 64, 0, 2),  # every layer
    (MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=None), 0, 0, 0),
    (Qwen2Config(**SMALL, num_key_value_heads=2), 0, 0, 0),      # use_sliding_window=False
    (GEMMA3_12, 64, 6, 10),                                        # 5 windowed : 1 global
    ({**_as_config_json(GEMMA3_12), "sliding_window_pattern": 6}, 64, 6, 10),   # config.json
    (_as_config_json(Gemma2Config(**{**SMALL, "num_hidden_layers": 4}, sliding_window=64,
                                  final_logit_softcapping=None, attn_logit_softcapping=None)),
     64, 2, 2),                                                    # alternating
    (Olmo3Config(**{**SMALL, "num_hidden_layers": 8}, sliding_window=64), 64, 4, 6),  # 3 : 1
])
def test_maps_the_sliding_window_and_the_layers_that_use_it(config, window, every, windowed):
    cfg = lk.from_hf_config(config)
    assert (cfg.sliding_window, cfg.global_every, cfg.windowed_layers) == (window, every, windowed)
    assert cfg.replace(layers=1).windowed_layers == (1 if window else 0)   # any depth


def test_windows_labkit_cannot_place_are_refused_with_the_fix():
    qwen = Qwen2Config(**SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=64,
                       max_window_layers=1)                        # layer 0 full, layer 1 windowed
    with pytest.raises(ValueError, match=r"windows on layers \[1\].*sliding_window=None"):
        lk.from_hf_config(qwen)


def test_reads_rope_theta_from_an_old_style_config_json():
    old = {**CONFIGS["llama"]().to_dict(), "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    old.pop("rope_parameters")
    assert lk.from_hf_config(old).rope_theta == 500000.0


# ---- the same model: Hugging Face weights in labkit's Transformer -----------------------------
def interleaved_to_halves(d: int) -> torch.Tensor:
    """DeepSeek rotates pairs (x0, x1), (x2, x3), ...; labkit rotates (x_i, x_i+d/2): the
    rows that make a RoPE part, reordered, give the same attention scores."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def labkit_state_dict(hf, cfg: lk.ModelConfig) -> dict:
    """Hugging Face LLaMA / Mistral / Qwen2 / DeepSeek (dense layers) names -> labkit's."""
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "lm_head.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
             "self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk",
             "self_attn.v_proj": "attn.wv", "self_attn.o_proj": "attn.wo",
             "self_attn.q_a_proj": "attn.wq_a", "self_attn.q_a_layernorm": "attn.q_norm",
             "self_attn.q_b_proj": "attn.wq_b", "self_attn.kv_a_proj_with_mqa": "attn.wkv_a",
             "self_attn.kv_a_layernorm": "attn.kv_norm", "self_attn.kv_b_proj": "attn.wkv_b",
             "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up",
             "mlp.down_proj": "mlp.w_down", "mlp.gate": "mlp.router",
             "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}
    if cfg.post_norms:            # Gemma: a norm before and after each sub-layer; OLMo 2: after
        names.update({"post_attention_layernorm": "attn_post_norm",
                      "pre_feedforward_layernorm": "mlp_norm",
                      "post_feedforward_layernorm": "mlp_post_norm"})
    for key, value in sd.items():
        if not key.startswith("model.layers."):
            continue
        _, _, i, rest = key.split(".", 3)
        module, param = rest.rsplit(".", 1)
        if module == "self_attn.qkv_proj":          # Phi-3: q, k and v stacked by rows
            q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
            for name, part in zip(("wq", "wk", "wv"), value.split([q, kv, kv])):
                out[f"blocks.{i}.attn.{name}.weight"] = part
            continue
        if module == "mlp.gate_up_proj":            # Phi-3: gate above up
            gate, up = value.chunk(2)
            out.update({f"blocks.{i}.mlp.w_gate.weight": gate, f"blocks.{i}.mlp.w_up.weight": up})
            continue
        if module == "mlp.experts":       # Mixtral: (E, 2f, h) with gate above up; (E, h, f)
            stacked = value.chunk(2, dim=1) if param == "gate_up_proj" else (value,)
            names_of = ("w_gate", "w_up") if param == "gate_up_proj" else ("w_down",)
            out.update({f"blocks.{i}.mlp.experts.{n}": v for n, v in zip(names_of, stacked)})
            continue
        order = interleaved_to_halves(cfg.qk_rope_dim) if cfg.attention == "mla" else None
        if order is not None and module in ("self_attn.q_proj", "self_attn.q_b_proj"):
            q = value.view(cfg.heads, cfg.qk_head_dim, -1)          # rope rows of each head
            q[:, cfg.qk_nope_dim:] = q[:, cfg.qk_nope_dim:][:, order]
        if order is not None and module == "self_attn.kv_a_proj_with_mqa":
            value[cfg.kv_lora_rank:] = value[cfg.kv_lora_rank:][order]  # the shared rope key
        out[f"blocks.{i}.{names[module]}.{param}"] = value
    return out


def assert_same_logits(config):
    hf = hf_model(config)
    with torch.no_grad():                 # random biases and norm weights too
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    cfg = lk.from_hf_config(config)
    ours = lk.build_model(cfg)
    ours.load_state_dict(labkit_state_dict(hf, cfg))
    tokens = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        torch.testing.assert_close(ours(tokens), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen2-tied", "qwen3", "phi3",
                                  "gemma3_text", "gemma2", "olmo2", "olmo3"])
def test_labkit_model_with_hugging_face_weights_gives_the_same_logits(kind):
    assert_same_logits(CONFIGS[kind]())


@pytest.mark.parametrize("kind", DENSE_MLA)
def test_deepseek_attention_with_hugging_face_weights_gives_the_same_logits(kind):
    # Only DeepSeek's dense layers compare: transformers stacks the routed experts into
    # (experts, 2 x ffn, hidden) tensors and routes differently from labkit's softmax top-k
    # (V3: sigmoid scores, the best groups first, normalised weights x 2.5), so the MoE
    # layers are checked by parameter counts per component above, not by their values.
    assert_same_logits(DENSE_MLA[kind]())


def test_mixtral_with_one_expert_gives_the_same_logits():
    # one expert, chosen for every token with weight 1 in both (Mixtral renormalises the chosen
    # experts' weights, labkit does not; with one they agree): the MoE block is that expert's
    # SwiGLU, so the router, the stacked experts and attention are checked by their values
    assert_same_logits(MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=1,
                                     num_experts_per_tok=1))


# ---- what from_hf_config refuses --------------------------------------------------------------
@pytest.mark.parametrize("config, match", [
    ({"model_type": "gpt2", "n_embd": 64}, "unsupported model_type 'gpt2'"),
    ({}, "unsupported model_type None"),
    ({**SMALL, "model_type": "llama", "attention_bias": True}, "attention_bias=True"),
    ({**SMALL, "model_type": "llama", "mlp_bias": True}, "mlp_bias=True"),
    ({**SMALL, "model_type": "mistral", "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**SMALL, "model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
    ({**SMALL, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
    ({**SMALL, **MLA, **MOE, "model_type": "deepseek_v2", "moe_layer_freq": 2},
     "moe_layer_freq=2"),
    ({**SMALL, **MLA, **MOE, "model_type": "deepseek_v2", "topk_method": "noaux_tc"},
     "topk_method='noaux_tc'"),
    ({"model_type": "llama", "hidden_size": 64}, "lacks num_hidden_layers"),
    ({**Gemma3TextConfig(**SMALL).to_dict(), "hidden_activation": "gelu"},
     "hidden_activation='gelu'"),
    (Gemma3Config(text_config=dict(SMALL)).to_dict(), r"from_pretrained\(name\).text_config"),
])
def test_refuses_what_labkit_cannot_build(config, match):
    with pytest.raises(ValueError, match=match):
        lk.from_hf_config(config)


def test_maps_gemma2s_soft_capping_and_without_it():
    capped = lk.from_hf_config(Gemma2Config(**SMALL).to_dict())          # transformers' defaults
    assert (capped.attn_softcap, capped.logit_softcap) == (50.0, 30.0)
    plain = lk.from_hf_config({**Gemma2Config(**SMALL).to_dict(), "final_logit_softcapping": None,
                               "attn_logit_softcapping": None})
    assert (plain.attn_softcap, plain.logit_softcap) == (0.0, 0.0)


def test_soft_capping_changes_the_logits_it_is_checked_by():
    # the logits test above would pass with the caps ignored if they did not bite
    config = CONFIGS["gemma2"]()
    hf = hf_model(config)
    uncapped = hf_model(Gemma2Config(**{**config.to_dict(), "attn_logit_softcapping": None,
                                        "final_logit_softcapping": None}))
    uncapped.load_state_dict(hf.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        gap = (hf(input_ids=tokens).logits - uncapped(input_ids=tokens).logits).abs().max()
    assert gap > 1e-2


def test_refuses_an_unknown_config_object():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*by hand"):
        lk.from_hf_config(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4))


def test_labkit_imports_without_transformers():
    code = "import sys; sys.modules['transformers'] = None; import labkit; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


# ---- measure_step on a Hugging Face module ------------------------------------------------------
def test_measures_a_real_hugging_face_step_with_exact_model_states():
    model = hf_model(CONFIGS["llama"]())
    n = sum(p.numel() for p in model.parameters())
    m = lk.measure_step(model, batch=2, seq=16, precision="fp32", optimizer_impl="for-loop")
    assert not m.fake and m.device == "cpu" and m.loss > 0
    assert m.peak_phase == "optimizer"
    # fp32 AdamW: 4 bytes of weights, 4 of gradients, 8 of moments per parameter, and a
    # 4-byte step counter per parameter tensor
    assert (m.params, m.grads) == (4 * n, 4 * n)
    assert m.optimizer == 8 * n + 4 * len(list(model.parameters()))


def test_a_module_built_under_fake_tensors_is_measured_in_its_own_mode():
    with FakeTensorMode():
        model = hf_model(CONFIGS["qwen2"]())
    n = sum(p.numel() for p in model.parameters())
    m = lk.measure_step(model, batch=2, seq=16, precision="fp32")
    assert m.fake and m.loss is None and m.params == 4 * n and m.optimizer_impl == "foreach"


def test_a_function_builds_the_module_in_the_precision_s_dtype_on_fake_tensors():
    config = CONFIGS["deepseek_v2"]()
    torch.set_default_dtype(torch.bfloat16)
    try:
        weights = sum(p.nbytes for p in hf_model(config).parameters())
    finally:
        torch.set_default_dtype(torch.float32)
    m = lk.measure_step(lambda: AutoModelForCausalLM.from_config(config), batch=2, seq=16,
                        precision="bf16")
    # bf16 weights (recent transformers keep DeepSeek's router weights in fp32)
    assert m.fake and m.params == weights
    assert weights < 2.1 * sum(p.numel() for p in hf_model(config).parameters())


def test_a_loss_function_replaces_the_causal_lm_call():
    calls = []

    def loss_fn(model, tokens):
        calls.append(tokens.shape)
        return model(input_ids=tokens).logits.float().logsumexp(-1).mean()

    lk.measure_step(hf_model(CONFIGS["llama"]()), batch=2, seq=8, precision="fp32",
                    loss_fn=loss_fn)
    assert calls == [(2, 8)]


def test_measure_step_names_the_fix_for_a_module_it_cannot_step():
    model = hf_model(CONFIGS["llama"]())
    with pytest.raises(ValueError, match="gradient_checkpointing_enable"):
        lk.measure_step(model, seq=16, precision="fp32", recompute="full")
    with pytest.raises(ValueError, match="build the module under FakeTensorMode"):
        lk.measure_step(model, seq=16, precision="fp32", fake=True)
    with pytest.raises(ValueError, match="stores weights in torch.bfloat16"):
        lk.measure_step(model, seq=16, precision="bf16")
    with pytest.raises(ValueError, match="vocabulary size"):
        lk.measure_step(torch.nn.Linear(4, 4), seq=16, precision="fp32")
