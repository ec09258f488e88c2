"""Paged optimizers (QLoRA): which state bitsandbytes' paged AdamW puts in unified memory, by
its own rule, and the bytes of its state, equal to bitsandbytes' optimizer on the CPU."""
import inspect

import pytest
import torch

import labkit as lk
from labkit.predict.paged import (PAGED_MIN_NUMEL, paged_state, paging_seconds,
                                  trained_numels)
from labkit.quantisation import lora

bnb = pytest.importorskip("bitsandbytes")


def test_the_paging_threshold_is_bitsandbytes_own():
    source = inspect.getsource(bnb.optim.optimizer.Optimizer8bit.get_state_buffer)
    assert "p.numel() < 1e5" in source and PAGED_MIN_NUMEL == 1e5


def test_a_parameter_is_paged_from_the_threshold_on():
    below, at = paged_state([PAGED_MIN_NUMEL - 1]), paged_state([PAGED_MIN_NUMEL])
    assert (below.paged, below.paged_tensors) == (0, 0)
    assert at.paged == 2 * PAGED_MIN_NUMEL and at.paged_tensors == 1       # two 8-bit moments
    assert paged_state([4095], bits=8).resident == 8 * 4095 + 2 * 256 * 4  # fp32 m, v; the maps
    assert paged_state([PAGED_MIN_NUMEL], bits=32).paged == 8 * PAGED_MIN_NUMEL


def _state_bytes(optimizer) -> int:
    """Bytes of the distinct tensors in an optimizer's state (the shared 8-bit maps once)."""
    seen = {}
    for state in optimizer.state.values():
        for t in state.values():
            if torch.is_tensor(t) and t.numel() > 1:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
@pytest.mark.parametrize("bits, cls", [(8, "PagedAdamW8bit"), (32, "PagedAdamW")])
def test_the_state_bytes_equal_bitsandbytes_paged_adamw(bits, cls):
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("small", layers=2, ffn=2048))
    lora.apply_lora(model, r=64)          # adapters on both sides of 1e5 (64 x 2048 numbers)
    model.blocks[0].attn_norm.weight.requires_grad_(True)   # and one under min_8bit_size
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = getattr(bnb.optim, cls)(params, lr=1e-3)
    tokens = torch.randint(0, 4096, (2, 32))
    model(tokens, tokens).backward()
    optimizer.step()
    predicted = paged_state([p.numel() for p in params], bits)
    assert 0 < predicted.paged_tensors < predicted.tensors == len(params)
    assert _state_bytes(optimizer) == predicted.total


def test_the_adapters_counted_are_apply_loras():
    cfg = lk.preset("llama-2-7b", layers=2)
    with torch.device("meta"):
        model = lk.build_model(cfg)
    lora.apply_lora(model, r=16)
    trained = sorted(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == sorted(trained_numels(cfg, "lora", 16))
    assert sum(trained_numels(cfg, "all")) == lk.count_params(cfg).total


def test_qloras_8bit_state_at_rank_16_pages_only_the_mlps_wide_adapters():
    # LLaMA-2-7B: A of w_gate and w_up (16 x 4096) and B of w_down (4096 x 16) hold 65,536
    # numbers, under the threshold; B of w_gate, w_up and A of w_down hold 176,128
    state = paged_state(trained_numels("llama-2-7b", "lora", 16), bits=8)
    assert state.paged_tensors == 32 * 3 and state.paged == 32 * 3 * 2 * 176_128
    r64 = paged_state(trained_numels("llama-2-7b", "lora", 64), bits=32)     # qlora.py's
    assert r64.resident == 0 and r64.paged_tensors == r64.tensors              # all paged


def test_moving_the_state_out_and_back_costs_two_crossings():
    assert paging_seconds(25 * 10**9, pcie_gbps=25.0) == 2.0
    with pytest.raises(ValueError, match="pcie_gbps"):
        paging_seconds(1, pcie_gbps=0)
