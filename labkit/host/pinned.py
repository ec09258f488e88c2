"""Pinned (page-locked) host memory: what it does for host-to-device copies, and what it costs.

A GPU's copy engine reads host memory by DMA, which needs pages the OS will not move or swap
out. Ordinary (pageable) memory is not such, so the CUDA driver copies it in chunks through a
pinned staging buffer of its own: a host-to-host copy before every transfer, and the host thread
waits for it. From pinned memory the engine reads the tensor directly, and
``copy_(..., non_blocking=True)`` returns at once: the copy overlaps compute on the host and the
GPU. From pageable memory ``non_blocking=True`` cannot be asynchronous.

What it costs, following PyTorch's ``CachingHostAllocator`` (aten/src/ATen/core/
CachingHostAllocator.h, torch 2.13): allocating pinned memory (``cudaHostAlloc``) is slow, so
PyTorch caches every block it frees; it rounds each request up to the next power of two
(``c10::llvm::PowerOf2Ceil``, below ``pinned_max_round_threshold_mb``, unlimited by default) to
reuse blocks, so a 600 MiB batch pins 1 GiB; and those bytes stay locked, cached or in use:
never swapped, unavailable to the page cache and to other processes, until the process ends or
``torch.accelerator.empty_host_cache()`` hands the unused ones back (``torch.cuda.empty_cache()``
empties the GPU's cache, not this one). ``tensor.pin_memory()`` is itself a copy:
a pinned block, then a host-to-host copy into it; it pays off when the same pinned buffer is
reused (DataLoader's ``pin_memory=True`` thread) and the copy to the GPU overlaps compute.

On the CPU-only build there is no pinned allocator: ``pin_memory()`` raises
("Cannot access accelerator device when none is available.") and
``DataLoader(pin_memory=True)`` warns and returns ordinary tensors.

    pinned_host_bytes(600 * 2**20)           # 1 GiB: the power-of-two block it takes
    h2d_bandwidth([2**20, 2**26, 2**28])     # CUDA only: pageable vs pinned GB/s
    pinned_copy_cost(2**26)                  # any machine: the extra host copy; pinning if CUDA
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from labkit.core.units import check_positive

MODES = ("pageable", "pinned", "pinned, non_blocking")


class NeedsCuda(RuntimeError):
    """Raised by measurements that only a CUDA GPU can make (run them on a CUDA machine)."""


def _power_of_two_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length()


def pinned_host_bytes(nbytes: int, max_round_threshold_mb: int | None = None) -> int:
    """Bytes of pinned host memory PyTorch's caching host allocator takes for a request of
    ``nbytes``: the next power of two (up to ``pinned_max_round_threshold_mb``, if set)."""
    check_positive("nbytes", nbytes)
    if max_round_threshold_mb is not None:
        check_positive("max_round_threshold_mb", max_round_threshold_mb)
        if nbytes > max_round_threshold_mb * 2**20:
            return nbytes
    return _power_of_two_ceil(nbytes)


def _check_sizes(sizes) -> list:
    sizes = list(sizes)
    if not sizes:
        raise ValueError("sizes is empty; pass byte counts, e.g. [2**20, 2**26]")
    for n in sizes:
        check_positive("each size", n)
    return sizes


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise NeedsCuda(f"{what} needs a CUDA GPU: torch.cuda.is_available() is False "
                        f"(torch {torch.__version__}); run it on a CUDA machine")


@dataclass
class Transfer:
    """One host-to-device copy size and mode: medians over ``repeats`` timed copies."""

    nbytes: int
    mode: str            # "pageable", "pinned" or "pinned, non_blocking"
    gpu_ms: float        # between CUDA events around the copy, on its stream
    host_ms: float       # how long the calling thread waited inside copy_()
    repeats: int

    @property
    def gbps(self) -> float:
        """Decimal GB/s (1e9 bytes per second), as PCIe and NVLink bandwidths are quoted."""
        return self.nbytes / (self.gpu_ms * 1e-3) / 1e9


def _time_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool, repeats: int):
    """Median GPU time (CUDA events) and host time (perf_counter) of ``dst.copy_(src)``."""
    stream = torch.cuda.current_stream(dst.device)
    dst.copy_(src, non_blocking=non_blocking)            # warm-up: first-touch, lazy init
    torch.cuda.synchronize(dst.device)
    gpu, host = [], []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=non_blocking)
        host.append((time.perf_counter() - t0) * 1e3)
        end.record(stream)
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def h2d_bandwidth(sizes, repeats: int = 10, device: str = "cuda") -> list:
    """Host-to-device bandwidth per size: from pageable memory, from pinned memory, and from
    pinned memory with ``non_blocking=True`` (whose host time shows the call not waiting)."""
    sizes = _check_sizes(sizes)
    check_positive("repeats", repeats)
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device {device!r} is not a CUDA device; use device='cuda'")
    _require_cuda("h2d_bandwidth")
    out = []
    for n in sizes:
        dst = torch.empty(n, dtype=torch.uint8, device=dev)               # (n,) on the GPU
        pageable = torch.ones(n, dtype=torch.uint8)                        # pages touched
        pinned = torch.ones(n, dtype=torch.uint8).pin_memory()
        for mode, src, non_blocking in zip(MODES, (pageable, pinned, pinned), (False, False, True)):
            gpu_ms, host_ms = _time_copy(dst, src, non_blocking, repeats)
            out.append(Transfer(n, mode, gpu_ms, host_ms, repeats))
        del dst, pageable, pinned
    return out


@dataclass
class PinCost:
    """What ``tensor.pin_memory()`` costs for ``nbytes``: the host copy it makes (measured on
    any machine), and, on CUDA, the call itself the first and later times."""

    nbytes: int
    copy_ms: float                    # median host-to-host copy of nbytes into a ready buffer
    pinned_bytes: int                 # the power-of-two block the caching allocator takes
    available: bool                   # pinning works here
    reason: str = ""                  # why not, as torch says it
    pin_first_ms: float | None = None  # first pin_memory() of this size in this process
    pin_ms: float | None = None       # median of later calls (the allocator's cache hit)

    @property
    def copy_gbps(self) -> float:
        return self.nbytes / (self.copy_ms * 1e-3) / 1e9


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def pinned_copy_cost(nbytes: int, repeats: int = 5) -> PinCost:
    """Median cost of the extra host copy ``pin_memory()`` makes; on CUDA also the first
    (``cudaHostAlloc``) and later (cached) ``pin_memory()`` calls. On CPU: says it needs CUDA."""
    check_positive("nbytes", nbytes)
    check_positive("repeats", repeats)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.ones(nbytes, dtype=torch.uint8)          # touched: time the copy, not page faults
    cost = PinCost(nbytes, _median_ms(lambda: dst.copy_(src), repeats), pinned_host_bytes(nbytes),
                   available=False)
    try:
        t0 = time.perf_counter()
        src.pin_memory()
        cost.pin_first_ms = (time.perf_counter() - t0) * 1e3
    except RuntimeError as e:            # CPU-only build: no pinned memory allocator
        cost.reason = f"needs CUDA: {e}"
        return cost
    cost.available = True
    cost.pin_ms = _median_ms(lambda: src.pin_memory(), repeats)
    return cost


@dataclass
class LoaderPin:
    """What ``DataLoader(pin_memory=True)`` did here."""

    pinned: bool          # the batch came back in pinned memory
    warning: str          # the warning it gave ("" when none)


def loader_pin_memory() -> LoaderPin:
    """Ask a DataLoader for pinned batches and report what came back (a warning on CPU)."""
    data = torch.utils.data.TensorDataset(torch.zeros(4, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (batch,) = next(iter(torch.utils.data.DataLoader(data, batch_size=2, pin_memory=True)))
    messages = [str(w.message) for w in caught if "pin" in str(w.message).lower()]
    return LoaderPin(batch.is_pinned(), messages[0] if messages else "")
