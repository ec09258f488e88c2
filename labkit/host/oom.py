"""Triage a CUDA out-of-memory error: read PyTorch's message, decide what is short of memory (the
step's tensors, fragmentation, another process, or memory outside PyTorch), and print the
allocator's statistics as ``torch.cuda.memory_summary()`` does.

The message is the caching allocator's (``c10/cuda/CUDACachingAllocator.cpp``), in its forms
since PyTorch 2.1; ``labkit.host.allocator`` raises the same one from a replayed step.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from labkit.core.units import fmt_bytes as _fmt

UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"([\d.]+) (bytes|B|KiB|MiB|GiB|TiB)"


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * UNITS[unit])


@dataclass(frozen=True)
class OomReport:
    """The numbers of one out-of-memory message, in bytes (rounded as the message prints them)."""

    requested: int                # "Tried to allocate"
    capacity: int                 # "a total capacity of"
    free: int                     # "of which ... is free" (on the device, for every process)
    allocated: int                # "allocated by PyTorch" (live tensors' blocks)
    cached: int                   # "reserved by PyTorch but unallocated"
    this_process: int | None      # "this process has ... memory in use" (None: not printed)
    others: int                   # "Process N has ... memory in use", summed

    @property
    def shortfall(self) -> int:
        """How much more free device memory the request needed."""
        return max(self.requested - self.free, 0)

    @property
    def outside_pytorch(self) -> int | None:
        """This process's memory that PyTorch's allocator did not reserve: the CUDA context,
        NCCL's buffers, cuBLAS/cuDNN workspaces, other libraries' allocations."""
        if self.this_process is None:
            return None
        return max(self.this_process - self.allocated - self.cached, 0)

    def verdict(self) -> str:
        """What is short of memory, and the first fix to try, in the order a triage checks."""
        short = self.shortfall
        if self.cached >= short:
            return ("fragmentation: the allocator holds more free memory in its segments "
                    f"({_fmt(self.cached)}) than the request lacked ({_fmt(short)}), in pieces "
                    "too small; set PYTORCH_ALLOC_CONF=expandable_segments:True")
        if self.others >= short:
            return (f"another process: other processes hold {_fmt(self.others)} of this GPU; "
                    "stop them, or give each job its own GPU")
        if self.outside_pytorch is not None and self.outside_pytorch >= short:
            return (f"memory outside PyTorch's allocator: {_fmt(self.outside_pytorch)} in this "
                    "process (CUDA context, NCCL, library workspaces); count it in the budget")
        return ("the step's tensors: live tensors take "
                f"{_fmt(self.allocated)} of {_fmt(self.capacity)}; lower the peak (a smaller "
                "micro-batch, recomputation, sharding: lk.estimate says by how much)")


def parse_oom(message: str) -> OomReport:
    """The numbers of PyTorch's CUDA out-of-memory message; ValueError if it is not one."""
    def find(pattern: str, required: bool = True):
        m = re.search(pattern, message)
        if m is None and required:
            raise ValueError("not a PyTorch CUDA out-of-memory message (it lacks "
                             f"{pattern.split('(')[0].strip()!r}); pass the whole text of the "
                             "torch.OutOfMemoryError")
        return m
    requested = find(r"Tried to allocate " + _SIZE)
    total = find(r"total capac\w+ of " + _SIZE + r" of which " + _SIZE + r" is free")
    held = find(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, and " + _SIZE
                + r" is reserved by PyTorch but unallocated")
    this = find(r"this process has " + _SIZE + r" memory in use", required=False)
    others = [_bytes(*m.groups()) for m in re.finditer(r"Process \d+ has " + _SIZE +
                                                       r" memory in use", message)]
    return OomReport(requested=_bytes(*requested.groups()), capacity=_bytes(*total.groups()[:2]),
                     free=_bytes(*total.groups()[2:]), allocated=_bytes(*held.groups()[:2]),
                     cached=_bytes(*held.groups()[2:]),
                     this_process=this and _bytes(*this.groups()), others=sum(others))


# ---- torch.cuda.memory_summary()'s table, from a memory_stats() dict -------------------------
SUMMARY_ROWS = (("Allocated memory", "allocated_bytes"), ("Active memory", "active_bytes"),
                ("Requested memory", "requested_bytes"), ("GPU reserved memory", "reserved_bytes"),
                ("Non-releasable memory", "inactive_split_bytes"), ("Allocations", "allocation"),
                ("Active allocs", "active"), ("GPU reserved segments", "segment"),
                ("Non-releasable allocs", "inactive_split"))


def memory_summary(stats: dict) -> str:
    """``torch.cuda.memory_summary()``'s main rows (current and peak, all pools) and its retry and
    OOM counts, from ``torch.cuda.memory_stats()`` or ``CachingAllocator.memory_stats()``."""
    lines = [f"{'Metric':<24}{'Cur Usage':>12}{'Peak Usage':>12}"]
    for label, key in SUMMARY_ROWS:
        current, peak = stats.get(f"{key}.all.current", 0), stats.get(f"{key}.all.peak", 0)
        show = _fmt if key.endswith("_bytes") else str
        lines.append(f"{label:<24}{show(current):>12}{show(peak):>12}")
    lines.append(f"cudaMalloc retries: {stats.get('num_alloc_retries', 0)}   "
                 f"CUDA OOMs: {stats.get('num_ooms', 0)}")
    return "\n".join(lines)

