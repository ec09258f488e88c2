"""Presets load with the published shapes; impossible configurations say how to fix them."""
import pytest

import labkit as lk
from labkit.core.config import ModelConfig

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
    mixtral = lk.preset("mixtral-8x7b")
    assert (mixtral.routed_experts, mixtral.top_k, mixtral.shared_experts, mixtral.dense_layers,
            mixtral.kv_heads, mixtral.moe_ffn) == (8, 2, 0, 0, 8, 14336)
    assert (lk.preset("llama-3-8b").vocab_size, lk.preset("llama-3-8b").kv_heads) == (128256, 8)


def test_preset_accepts_changes():
    assert lk.preset("small", layers=8).layers == 8


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="known presets: .*llama-2-7b"):
        lk.preset("llama-5-8b")


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
    (dict(norms="peri"), "unknown norms 'peri'"),
    (dict(norm_style="t5"), "unknown norm_style 't5'"),
    (dict(qk_norm_width="heads"), "unknown qk_norm_width 'heads'"),
    (dict(activation="relu"), "unknown activation 'relu'"),
    (dict(global_every=2), "set sliding_window"),
    (dict(sliding_window=-1), "sliding_window must be an integer >= 0"),
    (dict(activation="gelu_tanh", routed_experts=4, top_k=2, moe_ffn=32),
     "use activation='silu' with routed_experts > 0"),
])
def test_impossible_configs_raise_a_value_error_naming_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_unknown_field_in_preset_changes_is_refused():
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        lk.preset("tiny", hiden=64)


def test_replace_derives_head_dim_and_kv_heads_again():
    small = lk.preset("small")                       # hidden 256, 8 heads, 4 kv heads (GQA)
    assert small.replace(hidden=512).head_dim == 64
    assert small.replace(heads=16).kv_heads == 4     # an explicit GQA width is kept
    llama = lk.preset("llama-2-7b")                  # multi-head: kv_heads == heads
    assert llama.replace(heads=16).kv_heads == 16    # ... stays multi-head
    assert llama.replace(heads=16).head_dim == 256
    assert llama.replace(layers=8).dense_layers == 8  # a dense model stays dense
    assert lk.preset("tiny-moe").replace(layers=6).dense_layers == lk.preset("tiny-moe").dense_layers
    assert llama.replace(head_dim=64, heads=32).head_dim == 64   # an explicit value wins


def test_presets_load_from_a_plain_non_editable_install(tmp_path):
    """``pip install .`` then the tests in the checkout: labkit is imported from the source
    folder, where the presets' package (mapped from data/models) does not exist."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    # the editable install's finder would map labkit.preset_data: run without it
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if 'editable' not in repr(f).lower()]; sys.path.insert(0, sys.argv[1]); "
            "import labkit; assert labkit.__file__.startswith(sys.argv[1]); "
            "print(labkit.preset('small').hidden)")
    done = subprocess.run([sys.executable, "-c", code, str(repo)], capture_output=True,
                          text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "256"


def test_q_and_k_norms_are_for_grouped_query_attention():
    assert lk.preset("small", qk_norm=True).qk_norm
    with pytest.raises(ValueError, match="qk_norm is for grouped-query attention"):
        lk.preset("deepseek-v2-lite", qk_norm=True)
