"""labkit's estimate against Hugging Face models' own training steps (benchmarks/hf_models.py),
one point a family: batch 4 x 4096, bf16 weights with fp32 master weights (the planner's
recipe), foreach AdamW, on fake tensors, where the activations set the peak (not the optimizer). Full-size configs from the public config.json files; no download.
"""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")
_path = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_models.py"
_spec = importlib.util.spec_from_file_location("hf_models", _path)
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)

# measured (transformers 5.25, torch 2.13): dense 0.977-1.003. Phi-3-mini's 0.977: transformers'
# Phi-3 attention keeps a concatenation and a clone around RoPE (24,576 bytes per token and layer
# in bf16; hf_models.py --layers). Mistral v0.1 at its window (4096) and Gemma 3 past its own
# (512): a sliding-window mask that SDPA copies in every windowed layer, with k and v repeated to
# every head, as labkit's windowed layers run (0.996 and 1.002; 0.948 and 0.977 before they did:
# they are held to 1.5%, which the old figures miss). All on CPU fake tensors.
DENSE = [(name, 4096) for name in hf.DENSE]
WINDOWED = {"mistral-7b": 0.015, "gemma-3-1b": 0.015}
# MoE in pure bf16 (with master weights their optimizer step holds the peak), each with the
# tensors that differ named in the benchmark's notes: Mixtral 1.019; Qwen3-MoE 1.071, labkit
# keeps each token's gate-weighted expert outputs (top_k x hidden), which
# transformers sums without keeping
MOE = {"mixtral-8x7b": (0.95, 1.05), "qwen3-30b-a3b": (1.05, 1.09)}


@pytest.mark.slow
@pytest.mark.parametrize("name, seq", DENSE)
def test_dense_models_within_5_percent_of_the_hugging_face_step(name, seq):
    with hf.grouped_mm_only_for_bf16():
        row, ratio = hf.compare(name, "bf16-master", "foreach", 4, seq)
    print(row)
    assert ratio == pytest.approx(1, abs=WINDOWED.get(name, 0.05)), row
    assert row.split("|")[-1].split()[0] != "optimizer", row           # the activations' peak


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE)
def test_moe_models_differ_from_the_hugging_face_step_by_their_named_tensors(name):
    with hf.grouped_mm_only_for_bf16():
        row, ratio = hf.compare(name, "bf16", "foreach", 4, 4096)     # bf16-master: optimizer
    low, high = MOE[name]
    assert low <= ratio <= high, row
    assert row.split("|")[-1].split()[0] != "optimizer", row
