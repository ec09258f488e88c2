"""KV-cached generation gives the uncached model's tokens and logits, MLA's absorbed attention
equals the decompressed one, and a cache holds the bytes ``kv_cache_bytes`` predicts."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import labkit as lk
from labkit.transformer.generate import (DEEPSEEK_LLM_67B, KVCache, LatentCache,
                                         cache_bytes_by_context, cache_bytes_per_token, causal_mask,
                                         cross_layer_sharing, deepseek_v2_headline, generate,
                                         mla_attention, mla_reduction, new_cache, step)

CONFIGS = {                                   # one small model per attention type
    "GQA": lk.preset("tiny"),                                  # 4 heads, 2 KV heads
    "MHA": lk.preset("tiny", kv_heads=4),
    "MQA": lk.preset("tiny", kv_heads=1),
    "MLA": lk.preset("tiny-moe"),                              # queries straight from hidden
    "MLA, low-rank queries": lk.preset("tiny-moe", q_lora_rank=16),   # as DeepSeek-V2
    "GQA, sliding window": lk.preset("tiny", sliding_window=4, global_every=2),  # from token 4
}
NORMED = {                                    # GQA with q and k norms
    "Qwen3": lk.preset("tiny", qk_norm=True),
    "OLMo 2": lk.preset("tiny", qk_norm=True, qk_norm_width="all", norms="post",
                        norm_style="olmo"),
    "Gemma 3": lk.preset("tiny", qk_norm=True, norms="sandwich", norm_style="gemma",
                         activation="gelu_tanh", embed_scale=True, tie_embeddings=True),
}


def model_and_prompt(cfg, batch=2, tokens=7, seed=0):
    torch.manual_seed(seed)
    return lk.build_model(cfg), torch.randint(0, cfg.vocab_size, (batch, tokens))


@pytest.mark.parametrize("kind", CONFIGS)
def test_cached_generation_equals_uncached(kind, one_thread):
    model, prompt = model_and_prompt(CONFIGS[kind])
    cached = generate(model, prompt, 6)
    uncached = generate(model, prompt, 6, cache=False)          # the model's forward each step
    assert torch.equal(cached.tokens, uncached.tokens)
    torch.testing.assert_close(cached.logits, uncached.logits, atol=1e-5, rtol=0)
    assert cached.cache.length == cached.cache.capacity == 7 + 6 - 1
    assert uncached.cache is None and uncached.cache_bytes == 0


@pytest.mark.parametrize("kind", NORMED)
def test_cached_generation_normalises_q_and_k_as_the_forward_does(kind, one_thread):
    """The cached step runs the model's q and k norms (and Gemma's post norms and scaled
    embedding): the same tokens and logits as the uncached forward."""
    model, prompt = model_and_prompt(NORMED[kind])
    with torch.no_grad():                                       # norm weights away from 1 (0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    cached, uncached = generate(model, prompt, 6), generate(model, prompt, 6, cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    torch.testing.assert_close(cached.logits, uncached.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["GQA", "MLA"])
def test_a_prompt_prefilled_in_two_chunks_gives_the_forward_logits(kind, one_thread):
    model, prompt = model_and_prompt(CONFIGS[kind], tokens=9)
    cache = new_cache(model, 2, 9)
    with torch.no_grad():
        first = step(model, prompt[:, :4], cache)               # positions 0..3
        second = step(model, prompt[:, 4:], cache)              # 4..8, causal inside the chunk
        whole = model(prompt)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["MLA", "MLA, low-rank queries"])
def test_mla_absorbed_generation_equals_decompressed(kind, one_thread):
    model, prompt = model_and_prompt(CONFIGS[kind])
    absorbed = generate(model, prompt, 6)
    decompressed = generate(model, prompt, 6, absorb=False)
    assert torch.equal(absorbed.tokens, decompressed.tokens)
    torch.testing.assert_close(absorbed.logits, decompressed.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("new", [1, 3])                          # a decoding step, a chunk
def test_mla_absorbed_attention_equals_decompressed_on_one_layer(new):
    cfg = CONFIGS["MLA"]
    model, _ = model_and_prompt(cfg)
    attn = model.blocks[0].attn
    x = torch.randn(2, 5 + new, cfg.hidden)
    cache = LatentCache(cfg, 2, 5 + new)
    rope = model.rope
    with torch.no_grad():
        mla_attention(attn, x[:, :5], (rope.cos[:5], rope.sin[:5]), causal_mask(5, 0), cache, 0)
        cache.length = 5                                        # as ``step`` does after a layer
        rotary = (rope.cos[5:5 + new], rope.sin[5:5 + new])
        outs = [mla_attention(attn, x[:, 5:], rotary, causal_mask(new, 5), cache, 0, absorb)
                for absorb in (True, False)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


class LargestOutput(TorchDispatchMode):
    """The most elements of any operator's output with ``length`` in its shape: what grows with
    the prefix (the weights are left out)."""

    def __init__(self, length: int):
        super().__init__()
        self.length, self.numel = length, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and self.length in t.shape:
                self.numel = max(self.numel, t.numel())
        return out


def test_absorbed_decoding_never_builds_per_head_keys_or_values():
    cfg = lk.preset("tiny-moe", kv_lora_rank=16)               # latent narrower than H x d_h
    model, _ = model_and_prompt(cfg)
    attn, L = model.blocks[0].attn, 200
    cache = LatentCache(cfg, 1, L)
    cache.slots[0]["latent"].normal_()
    cache.length = L - 1
    rotary = (model.rope.cos[L - 1:L], model.rope.sin[L - 1:L])
    per_head_keys = L * cfg.heads * cfg.qk_nope_dim             # one layer's K of the prefix
    largest = {}
    for absorb in (True, False):
        with torch.no_grad(), LargestOutput(L) as mode:
            mla_attention(attn, torch.randn(1, 1, cfg.hidden), rotary, None, cache, 0, absorb)
        largest[absorb] = mode.numel
    assert largest[True] < per_head_keys <= largest[False]
    assert largest[True] == L * cfg.kv_lora_rank                # the cached latent it reads


@pytest.mark.parametrize("kind", CONFIGS)
def test_measured_cache_bytes_per_token_equal_kv_cache_bytes(kind):
    model, _ = model_and_prompt(CONFIGS[kind])
    r = cache_bytes_per_token(model)
    assert r.measured == r.predicted == lk.kv_cache_bytes(model.cfg, 1, 1, "fp32")
    assert r.kind == kind.split(",")[0]


def test_bytes_per_token_of_each_type_on_the_small_models():
    per_token = {kind: cache_bytes_per_token(lk.build_model(cfg)).measured
                 for kind, cfg in CONFIGS.items()}
    # fp32, 2 layers x 2 (k, v) x kv_heads x 16; MLA 3 layers x (32 latent + 8 RoPE key)
    # (labkit's cache keeps every token of a sliding-window layer too)
    assert per_token == {"GQA": 512, "MHA": 1024, "MQA": 256, "MLA": 480,
                         "MLA, low-rank queries": 480, "GQA, sliding window": 512}


@pytest.mark.parametrize("name, per_token", [
    ("llama-2-7b", 32 * 2 * 32 * 128 * 2),                      # 512 KiB: MHA
    ("llama-2-70b", 80 * 2 * 8 * 128 * 2),                      # GQA, 8 KV heads
    ("deepseek-v2", 60 * (512 + 64) * 2),                       # MLA
])
def test_full_size_caches_measured_on_fake_tensors(name, per_token):
    r = cache_bytes_per_token(name)                             # bf16, no real memory
    assert r.measured == r.predicted == per_token


def test_cross_layer_sharing_halves_the_cache_and_decodes_like_its_uncached_self(one_thread):
    model, prompt = model_and_prompt(CONFIGS["GQA"])           # 2 layers: one shared slot
    r = cross_layer_sharing(model, prompt, 6)
    assert (r.slots, r.shared_bytes * 2) == (1, r.unshared_bytes)
    assert r.max_logit_change > 1e-3                            # another model, not the same
    cached = generate(model, prompt, 6, share=2)
    uncached = generate(model, prompt, 6, share=2, cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    torch.testing.assert_close(cached.logits, uncached.logits, atol=1e-5, rtol=0)


def test_cross_layer_sharing_of_mla_keeps_ceil_of_half_the_layers(one_thread):
    model, prompt = model_and_prompt(CONFIGS["MLA"])           # 3 layers -> 2 slots
    r = cross_layer_sharing(model, prompt, 3)
    assert (r.layers, r.slots) == (3, 2)
    assert r.shared_bytes * 3 == r.unshared_bytes * 2


def test_mla_reduction_reproduces_deepseek_v2_table_1():
    r = mla_reduction("deepseek-v2")
    assert (r.mla_per_layer, r.mha_per_layer) == (512 + 64, 2 * 128 * 128)
    assert r.in_head_dims == 4.5 and r.gqa_groups == 2.25         # the paper's 9/2 d_h, 2.25
    assert r.ratio == pytest.approx(56.9, abs=0.05)
    assert any("same n_h = 128" in a for a in r.assumptions)


def test_deepseek_v2_headline_93_percent_needs_its_6_bit_cache():
    h = deepseek_v2_headline()
    assert h.baseline_bytes == lk.kv_cache_bytes(DEEPSEEK_LLM_67B, 1, 1, "bf16") == 389_120
    assert round(h.saved * 100, 1) == 93.3                      # "reduces the KV cache by 93.3%"
    assert round(h.saved_bf16 * 100, 1) == 82.2                 # both in bf16


def test_cache_memory_by_context_grows_linearly():
    table = cache_bytes_by_context(["llama-2-7b", "deepseek-v2"], contexts=(4096, 131072))
    assert table["llama-2-7b"][4096] == 2 * 2**30               # 0.5 MiB per token
    assert table["deepseek-v2"][131072] == 32 * table["deepseek-v2"][4096]


def test_bad_requests_name_the_fix():
    model, prompt = model_and_prompt(CONFIGS["GQA"])
    too_long = torch.zeros(1, model.cfg.max_seq + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="build the model with max_seq >= 2050"):
        generate(model, too_long, 1)
    with pytest.raises(ValueError, match="shorten the prompt"):
        generate(model, prompt, model.cfg.max_seq)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="new_tokens must be a positive integer"):
            generate(model, prompt, bad)
    with pytest.raises(ValueError, match=r"prompt\[None\]"):
        generate(model, prompt[0], 3)
    with pytest.raises(ValueError, match="share"):
        generate(model, prompt, 3, share=0)
    cache = KVCache(model.cfg, 2, 4)
    with pytest.raises(ValueError, match="larger capacity"), torch.no_grad():
        step(model, prompt, cache)
    with pytest.raises(ValueError, match="compares an MLA config"):
        mla_reduction("llama-2-7b")

