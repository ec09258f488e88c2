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
    assert paged_state([4095], bits=8).resident == 8 * 4095    # fp32 m, v; no 8-bit: no maps
    assert paged_state([4096], bits=8).resident == 2 * 4096 + 2 * 4 * 16 + 2 * 256 * 4
    assert paged_state([PAGED_MIN_NUMEL], bits=32).paged == 8 * PAGED_MIN_NUMEL
    assert paged_state([4096], bits=8, min_8bit_size=8192).resident == 8 * 4096


SIZES = [100, 4095, 4096, 99_999, 100_000, 300_000]      # both sides of 4096 and of 100,000


@pytest.mark.parametrize("make, bits", [
    (lambda ps: bnb.optim.PagedAdamW8bit(ps), 8),
    (lambda ps: bnb.optim.PagedAdamW(ps), 32),
    (lambda ps: bnb.optim.AdamW(ps, optim_bits=8, is_paged=True), 8),     # HF Trainer's route
    (lambda ps: bnb.optim.PagedAdamW8bit(ps, min_8bit_size=200_000), 8),
], ids=["PagedAdamW8bit", "PagedAdamW", "AdamW-paged-8bit", "min_8bit_size"])
def test_the_paged_split_is_bitsandbytes_own(monkeypatch, make, bits):
    """bitsandbytes' own init_state on meta parameters (no GPU): what it sends to unified
    memory (get_paged, recorded) and what it keeps on the device, against the rule."""
    from bitsandbytes.optim import optimizer
    paged = []

    def get_paged(*shape, dtype=torch.float32, device=None):
        paged.append(torch.empty(*shape, dtype=dtype, device="meta"))
        return paged[-1]
    monkeypatch.setattr(optimizer.F, "get_paged", get_paged)
    monkeypatch.setattr(optimizer.F, "fill", lambda *args, **kwargs: None)
    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in SIZES]
    opt = make(params)
    for i, p in enumerate(params):
        opt.init_state(opt.param_groups[0], p, 0, i)
    held = {id(t): t.numel() * t.element_size() for p in params for t in opt.state[p].values()
            if torch.is_tensor(t) and t.numel() > 1}
    predicted = paged_state(SIZES, bits, opt.args.min_8bit_size)
    assert sum(t.numel() * t.element_size() for t in paged) == predicted.paged
    assert len(paged) == 2 * predicted.paged_tensors                       # two moments each
    assert sum(held.values()) == predicted.total


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


def test_a_step_moves_out_and_back_what_it_overshoots_up_to_the_paged_state():
    pcie = 32e9 * 0.8                                               # an A100's link, at 80%
    assert paging_seconds(10**9, 4 * 10**9) == pytest.approx(2 * 10**9 / pcie)   # all of it
    assert paging_seconds(10**9, 10**8) == pytest.approx(2 * 10**8 / pcie)      # what it needs
    assert paging_seconds(10**9, 0) == 0
    with pytest.raises(ValueError, match="efficiency"):
        paging_seconds(1, 1, efficiency=0)


def test_states_of_two_groups_add_up_with_the_maps_once():
    a, b = paged_state([200_000], 8), paged_state([300_000, 100], 8)
    assert (a + b) == paged_state([200_000, 300_000, 100], 8)
    assert (paged_state([131_072_000], 32) + a).total == 8 * 131_072_000 + a.total


def test_bad_choices_name_what_is_expected():
    with pytest.raises(ValueError, match="bits"):
        paged_state([100_000], bits=4)
    with pytest.raises(ValueError, match="trainable"):
        trained_numels("llama-2-7b", "qlora")
    with pytest.raises(ValueError, match="numel"):
        paged_state([0])
