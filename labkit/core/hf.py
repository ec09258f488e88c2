"""Hugging Face ``transformers`` configs -> ``labkit.ModelConfig``: any public model, predicted.

``from_hf_config`` maps the configs of thirteen model types (``model_type`` in config.json):

| model_type      | transformers class   | what labkit builds                                 |
| --------------- | -------------------- | -------------------------------------------------- |
| ``llama``       | ``LlamaConfig``      | RMSNorm, RoPE, SwiGLU, grouped-query attention     |
| ``mistral``     | ``MistralConfig``    | as LLaMA (its sliding window: see below)           |
| ``qwen2``       | ``Qwen2Config``      | as LLaMA plus biases on q, k and v (``qkv_bias``)  |
| ``qwen3``       | ``Qwen3Config``      | as LLaMA plus an RMSNorm of each head's q and k    |
| ``phi3``        | ``Phi3Config``       | as LLaMA (its fused qkv and gate-up projections    |
|                 |                      | hold the same weights)                             |
| ``mixtral``     | ``MixtralConfig``    | as Mistral, an MoE block (top-k routed) per layer  |
| ``qwen3_moe``   | ``Qwen3MoeConfig``   | as Qwen3, an MoE block (top-k routed) per layer    |
| ``gemma2``      | ``Gemma2Config``     | sandwich norms, GeGLU, scaled embedding, tied head |
|                 |                      | and soft-capped scores and logits                  |
| ``gemma3_text`` | ``Gemma3TextConfig`` | as Gemma 2 plus Qwen3's q and k norms              |
| ``olmo2``       | ``Olmo2Config``      | as LLaMA, but each sub-layer's output normalised   |
|                 |                      | (not its input), q and k over all heads at once    |
| ``olmo3``       | ``Olmo3Config``      | as OLMo 2 (its sliding-window layers: see below)   |
| ``deepseek_v2`` | ``DeepseekV2Config`` | MLA attention, DeepSeekMoE (shared + routed)       |
| ``deepseek_v3`` | ``DeepseekV3Config`` | as V2 plus the router's selection bias             |

The mapped model has the Hugging Face model's parameter count and weight shapes, so the
model states (weights, gradients, optimizer state) are predicted exactly; its activations
are labkit's layers', which transformers' implementation of the same model differs from
in a few named tensors (``benchmarks/hf_models.py`` measures and lists them). Some
settings change the *values* a model computes but no tensor's shape, and are accepted as
they are: RoPE scaling (linear, dynamic, yarn, llama3: other frequencies), DeepSeek's
routing details (group-limited top-k, sigmoid scores, ``norm_topk_prob``,
``routed_scaling_factor``: other weights for the same number of chosen experts), Gemma's
``query_pre_attn_scalar`` and local RoPE base, and a
checkpoint's own storage format (``quantization_config``, ``torch_dtype``: the training
precision is ``estimate``'s and ``measure_step``'s ``precision``). Anything that changes
shapes and that labkit cannot build raises a ``ValueError`` naming it and what to do.

transformers is not imported here: a config object is read through ``to_dict()``, and a
plain dict (the contents of config.json) works the same, so labkit imports without it.
"""
from __future__ import annotations

from labkit.core.config import ModelConfig

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma2",
             "gemma3_text", "olmo2", "olmo3", "deepseek_v2", "deepseek_v3")

_BY_HAND = ("build a labkit.ModelConfig by hand, or measure the Hugging Face model itself "
            "with labkit.measure_step(lambda: AutoModelForCausalLM.from_config(cfg))")


def from_hf_config(hf_config) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face LLaMA, Mistral, Qwen2, Qwen3, Phi-3, Mixtral,
    Qwen3-MoE, Gemma 2, Gemma 3 (its language model), OLMo 2/3 or DeepSeek-V2/V3 config.

    ``hf_config``: a ``transformers`` config object or a plain dict (config.json's contents).
    Raises ``ValueError`` for a model type not listed in ``labkit.core.hf.SUPPORTED`` and for
    features labkit's model does not have (biases other than Qwen2's q/k/v, activations
    other than SiLU, MoE layers other than every layer after the first dense ones).
    """
    c = _as_dict(hf_config)
    model_type = c.get("model_type")
    if model_type == "gemma3":
        raise ValueError("gemma3 is Gemma 3's image-text model: from_hf_config maps its language "
                         "model - pass transformers.AutoConfig.from_pretrained(name).text_config "
                         "(a Gemma3TextConfig, its defaults filled in; config.json's text_config "
                         "lists only what differs from them); the vision tower is not counted")
    if model_type not in SUPPORTED:
        raise ValueError(f"unsupported model_type {model_type!r}: from_hf_config maps "
                         f"{', '.join(SUPPORTED)}; {_BY_HAND}")
    _check_common(c, model_type)
    heads = c["num_attention_heads"]
    fields = dict(
        name=c.get("_name_or_path") or model_type,
        family=model_type,
        hidden=c["hidden_size"],
        layers=c["num_hidden_layers"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        ffn=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq=c["max_position_embeddings"],
        norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(c),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )
    if model_type.startswith("gemma"):
        fields.update(_gemma_fields(c, model_type))
    if model_type.startswith("olmo"):
        # OLMo 2 and 3 (Walsh et al., 2025): each sub-layer's output normalised before the add,
        # no norm of its input; q and k normalised over all heads at once; the norms multiply
        # by their weight in fp32. OLMo 3's sliding-window layers: ``_window_fields``.
        fields.update(norms="post", norm_style="olmo", qk_norm_width="all")
    fields.update(_window_fields(c, model_type))
    if model_type.startswith("deepseek"):
        fields.update(_deepseek_fields(c, model_type))
    else:
        fields.update(head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                      qkv_bias=model_type == "qwen2",   # Qwen2's q, k, v always have biases
                      qk_norm=model_type.startswith(("qwen3", "gemma3", "olmo")))
        if model_type == "mixtral":
            fields.update(_mixtral_fields(c))
        if model_type == "qwen3_moe":
            fields.update(_qwen3_moe_fields(c))
        # Sliding windows (Mistral v0.1, Qwen2's use_sliding_window): below seq = window
        # transformers runs SDPA causal without a mask on unpadded rows, as labkit does; from
        # it on (and with padding or packed rows at any length), a mask that SDPA copies to a
        # float one in every windowed layer, with k and v repeated to every head, as labkit's
        # windowed layers do from seq = window (``model.windowed_sdpa``).
    return ModelConfig(**fields)


def _as_dict(hf_config) -> dict:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"expected a transformers config or a dict (config.json), got "
                    f"{type(hf_config).__name__}")


def _unsupported(model_type: str, what: str) -> ValueError:
    return ValueError(f"{model_type}: {what} - labkit's model cannot represent it; {_BY_HAND}")


def _check_common(c: dict, model_type: str) -> None:
    """Refuse what changes shapes and that labkit's layers do not have."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "vocab_size", "max_position_embeddings")
               if c.get(k) is None]
    if missing:
        raise ValueError(f"{model_type} config lacks {', '.join(missing)}; pass the whole "
                         f"config.json (or the transformers config object)")
    if c.get("hidden_act", "silu") != "silu" and not model_type.startswith("gemma"):
        raise _unsupported(model_type, f"hidden_act={c['hidden_act']!r} (labkit's MLP is "
                                       f"SwiGLU, which needs 'silu')")
    if c.get("attention_bias"):
        raise _unsupported(model_type, "attention_bias=True (biases on every attention "
                                       "projection; labkit has only Qwen2's q/k/v biases)")
    if c.get("mlp_bias"):
        raise _unsupported(model_type, "mlp_bias=True (labkit's MLP has no biases)")
    partial = c.get("partial_rotary_factor") or (c.get("rope_parameters") or {}).get(
        "partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise _unsupported(model_type, f"partial_rotary_factor={partial} (RoPE on part of each "
                                       f"head; labkit rotates the whole head)")


def _window_fields(c: dict, model_type: str) -> dict:
    """The sliding window and which layers attend beyond it: every ``global_every``-th (0: none).
    From ``layer_types`` (transformers 5) when given, else as transformers derives it: Gemma 3's
    ``sliding_window_pattern`` (config.json), Gemma 2 alternating (odd layers global), every
    layer for Mistral, Phi-3 and a Qwen2 whose ``use_sliding_window`` windows all of them.
    Windows on other layers (Qwen2's first ``max_window_layers`` kept full) are refused."""
    window, layers = c.get("sliding_window") or 0, c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is None and window:
        every = {"gemma3_text": c.get("sliding_window_pattern") or 6, "gemma2": 2}.get(model_type, 0)
        if model_type == "qwen2" and not c.get("use_sliding_window", False):
            return dict(sliding_window=0, global_every=0)
        full = c.get("max_window_layers", 0) if model_type == "qwen2" else 0
        types = ["full_attention" if i < full or (every and (i + 1) % every == 0)
                 else "sliding_attention" for i in range(layers)]
    windowed = [t == "sliding_attention" for t in (types or [])]
    if not window or not any(windowed):
        return dict(sliding_window=0, global_every=0)
    for every in [0] + list(range(2, layers + 1)):
        if windowed == [not (every and (i + 1) % every == 0) for i in range(layers)]:
            return dict(sliding_window=window, global_every=every)
    raise ValueError(f"{model_type}: sliding windows on layers "
                     f"{[i for i, w in enumerate(windowed) if w]}; labkit's windowed layers are "
                     f"all but every k-th - pass the config with sliding_window=None to estimate "
                     f"it without windows (training memory is the same up to seq = the window; "
                     f"the KV cache then counts every token)")


def _rope_theta(c: dict) -> float:
    """RoPE's base: top-level ``rope_theta`` (config.json, transformers 4.x) or
    ``rope_parameters["rope_theta"]`` (transformers 5). A ``rope_scaling`` / ``rope_type``
    other than default changes the frequencies only, no shape, so it is not mapped."""
    params = c.get("rope_parameters") or {}
    params = params.get("full_attention", params)      # Gemma 3: one set per kind of layer
    return float(c.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _gemma_fields(c: dict, model_type: str) -> dict:
    """Gemma 2 and 3: each sub-layer's input and output normalised (two RMSNorms around each,
    Gemma 3's q and k norms too, each scaling by 1 + weight in fp32), a GeGLU MLP (tanh GELU),
    the embedding times sqrt(hidden) and tied to the LM head unless the config says not.

    Their alternating sliding-window layers are not modelled in training, as Mistral's window
    is not (below: from T > window transformers adds a mask); ``kv_cache_bytes`` caps those
    layers' caches at the window.
    Gemma 2's soft-capping is mapped (``attn_softcap``, ``logit_softcap``): over the logits it
    keeps one more (tokens, vocab) tensor, the tanh's output; over the attention scores SDPA
    cannot apply it, so transformers runs Gemma 2 eagerly (``Recipe(attention="naive")`` keeps
    what that keeps) and labkit's "sdpa" runs its tiled core, as FlashAttention-2's ``softcap``.
    ``query_pre_attn_scalar`` (the scores' scale) is not mapped: labkit scales by the head
    width, which changes values, not tensors."""
    act = c.get("hidden_activation") or "gelu_pytorch_tanh"   # transformers ignores hidden_act
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise _unsupported(model_type, f"hidden_activation={act!r} (labkit's GeGLU uses the "
                                       f"tanh approximation, 'gelu_pytorch_tanh')")
    return dict(norms="sandwich", norm_style="gemma", activation="gelu_tanh", embed_scale=True,
                tie_embeddings=bool(c.get("tie_word_embeddings", True)),
                attn_softcap=float(c.get("attn_logit_softcapping") or 0.0),
                logit_softcap=float(c.get("final_logit_softcapping") or 0.0))


def _mixtral_fields(c: dict) -> dict:
    """Mixtral's sparse MoE block in every layer: a router and ``num_local_experts`` SwiGLU
    experts of ``intermediate_size``, ``num_experts_per_tok`` per token, no shared expert.
    Mixtral renormalises the chosen experts' weights, labkit does not: other values, the
    same tensors."""
    return dict(routed_experts=c["num_local_experts"], top_k=c["num_experts_per_tok"],
                moe_ffn=c["intermediate_size"], shared_experts=0, dense_layers=0)


def _qwen3_moe_fields(c: dict) -> dict:
    """Qwen3-MoE's block in every layer: a router and ``num_experts`` (transformers 5:
    ``num_local_experts``) SwiGLU experts of
    ``moe_intermediate_size``, ``num_experts_per_tok`` per token, no shared expert. Dense
    layers among them (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused: labkit
    puts its dense layers first."""
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise _unsupported("qwen3_moe", f"mlp_only_layers={c.get('mlp_only_layers')}, "
                                        f"decoder_sparse_step={c.get('decoder_sparse_step')} "
                                        f"(dense layers between MoE layers)")
    experts = c.get("num_experts") or c["num_local_experts"]   # config.json / transformers 5
    return dict(routed_experts=experts, top_k=c["num_experts_per_tok"],
                moe_ffn=c["moe_intermediate_size"], shared_experts=0, dense_layers=0)


def _deepseek_fields(c: dict, model_type: str) -> dict:
    """MLA and DeepSeekMoE sizes. Multi-token prediction (V3's ``num_nextn_predict_layers``)
    is not built by transformers' model either; it is left out of both."""
    if c.get("moe_layer_freq", 1) != 1:
        raise _unsupported(model_type, f"moe_layer_freq={c['moe_layer_freq']} (an MoE block "
                                       f"in every k-th layer; labkit puts one in every layer "
                                       f"after the first first_k_dense_replace)")
    # how experts are chosen: V2 by the top scores (optionally within the best groups),
    # V3 by scores plus a per-expert bias ("noaux_tc"); transformers builds no other
    methods = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}
    known = methods[model_type]
    if c.get("topk_method", known[0]) not in known:
        raise _unsupported(model_type, f"topk_method={c['topk_method']!r} (transformers' "
                                       f"{model_type} routes by {' or '.join(known)})")
    fields = dict(
        attention="mla",
        kv_heads=c["num_attention_heads"],        # MLA: every head reads the one latent
        q_lora_rank=c.get("q_lora_rank") or 0,    # None: queries straight from hidden
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_dim=c["qk_nope_head_dim"],
        qk_rope_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
    )
    routed = c.get("n_routed_experts") or 0
    first_dense = c.get("first_k_dense_replace") or 0
    if routed and first_dense < c["num_hidden_layers"]:     # else every layer is dense
        fields.update(
            routed_experts=routed,
            shared_experts=c.get("n_shared_experts") or 0,
            top_k=c["num_experts_per_tok"],
            moe_ffn=c["moe_intermediate_size"],
            dense_layers=first_dense,     # MoE blocks from layer first_k_dense_replace on
            # V3's "noaux_tc" routing adds a per-expert bias to the scores that choose the
            # experts (transformers: e_score_correction_bias, a buffer; labkit: a frozen
            # parameter, counted by count_params)
            router_bias=model_type == "deepseek_v3",
        )
    return fields
