"""Pinned memory: the caching host allocator's power-of-two blocks, what a CPU-only build does
when asked to pin, and (on CUDA) pinned copies faster than pageable ones."""
import pytest
import torch

from labkit.host.pinned import (MODES, NeedsCuda, h2d_bandwidth, loader_pin_memory,
                                pinned_copy_cost, pinned_host_bytes)

MiB = 2**20
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build")


def test_a_pinned_request_takes_the_next_power_of_two():
    assert pinned_host_bytes(1) == 1
    assert pinned_host_bytes(4096) == 4096
    assert pinned_host_bytes(4097) == 8192
    assert pinned_host_bytes(600 * MiB) == 1024 * MiB           # a 600 MiB batch pins 1 GiB
    assert pinned_host_bytes(8 * 4096 * 8) == 256 * 1024         # already a power of two


def test_above_the_round_threshold_a_request_is_not_rounded():
    assert pinned_host_bytes(600 * MiB, max_round_threshold_mb=512) == 600 * MiB
    assert pinned_host_bytes(300 * MiB, max_round_threshold_mb=512) == 512 * MiB


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="nbytes must be a positive integer"):
        pinned_host_bytes(0)
    with pytest.raises(ValueError, match="sizes is empty"):
        h2d_bandwidth([])
    with pytest.raises(ValueError, match="each size must be a positive integer"):
        h2d_bandwidth([MiB, -1])
    with pytest.raises(ValueError, match="use device='cuda'"):
        h2d_bandwidth([MiB], device="cpu")
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        pinned_copy_cost(MiB, repeats=0)


def test_the_extra_host_copy_is_measured_on_any_machine():
    cost = pinned_copy_cost(MiB, repeats=3)
    assert cost.copy_ms > 0 and cost.copy_gbps > 0 and cost.pinned_bytes == MiB


@cpu_only
def test_on_a_cpu_only_build_pinning_says_it_needs_cuda():
    cost = pinned_copy_cost(MiB, repeats=1)
    assert not cost.available and cost.pin_ms is None
    assert cost.reason.startswith("needs CUDA") and "accelerator" in cost.reason
    with pytest.raises(NeedsCuda, match="needs a CUDA GPU"):
        h2d_bandwidth([MiB])


@cpu_only
def test_on_a_cpu_only_build_the_loader_warns_and_does_not_pin():
    result = loader_pin_memory()
    assert not result.pinned
    assert "no accelerator is found" in result.warning


@cuda
def test_on_cuda_the_loader_pins_without_a_warning():
    result = loader_pin_memory()
    assert result.pinned and result.warning == ""


@cuda
def test_on_cuda_pinned_copies_are_faster_and_non_blocking_does_not_wait():
    rows = {(t.nbytes, t.mode): t for t in h2d_bandwidth([64 * MiB], repeats=5)}
    assert {mode for _, mode in rows} == set(MODES)
    pageable, pinned, async_ = (rows[64 * MiB, mode] for mode in MODES)
    assert pinned.gbps > pageable.gbps
    assert async_.host_ms < pinned.host_ms                       # the call returns at once


@cuda
def test_on_cuda_the_host_allocator_holds_the_rounded_block():
    key = "allocated_bytes.current"                      # torch.cuda.host_memory_stats' name
    before = torch.cuda.host_memory_stats()[key]
    kept = torch.empty(600 * MiB + 1, dtype=torch.uint8, pin_memory=True)   # a 1 GiB bucket
    assert torch.cuda.host_memory_stats()[key] - before == pinned_host_bytes(600 * MiB + 1)
    del kept
