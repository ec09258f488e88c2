"""Presets load with the published shapes; impossible configurations say how to fix them."""
import pytest

import labkit as lk
from labkit.config import ModelConfig

DESIGN_PRESETS = {"llama-2-7b", "llama-2-13b", "llama-2-70b", "mistral-7b", "deepseek-moe-16b",
                  "deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "tiny", "small", "tiny-moe"}


def test_every_preset_named_in_the_design_exists():
    assert DESIGN_PRESETS <= set(lk.presets())


def test_presets_carry_the_published_shapes():
    v3 = lk.preset("deepseek-v3")
    assert (v3.hidden, v3.layers, v3.dense_layers, v3.routed_experts, v3.top_k) == (7168, 61, 3, 256, 8)
    assert (v3.kv_lora_rank, v3.qk_rope_dim, v3.router_bias) == (512, 64, True)
    assert lk.preset("llama-2-70b").kv_heads == 8
    assert lk.preset("llama-2-7b").head_dim == 128


def test_preset_accepts_changes():
    assert lk.preset("small", layers=8).layers == 8


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="known presets: .*llama-2-7b"):
        lk.preset("llama-3-8b")


@pytest.mark.parametrize("fields, message", [
    (dict(hidden=100, heads=8), "heads=8 does not divide hidden=100"),
    (dict(heads=8, kv_heads=3), "kv_heads=3 does not divide heads=8"),
    (dict(hidden=-4), "hidden must be a positive integer"),
    (dict(layers=0), "layers must be a positive integer"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(routed_experts=4, top_k=6, moe_ffn=32), "top_k=6 is larger than routed_experts=4"),
    (dict(top_k=2), "need routed_experts > 0"),
    (dict(attention="linear"), "unknown attention 'linear'"),
    (dict(attention="mla"), "kv_lora_rank must be a positive integer"),
])
def test_impossible_configs_raise_a_value_error_naming_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_unknown_field_in_preset_changes_is_refused():
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        lk.preset("tiny", hiden=64)
