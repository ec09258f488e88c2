"""Triage a CUDA out-of-memory error: read PyTorch's message, say what alone would have covered
the failed request (fragmentation, another process, memory outside PyTorch) or that the step's
tensors fill the card, and print the allocator's counters as ``torch.cuda.memory_summary()`` does.

The message is the native caching allocator's (``c10/cuda/CUDACachingAllocator.cpp``, PyTorch
2.1-2.13). Before raising it the allocator has freed every wholly free cached segment and
retried, so what it still reports as "reserved but unallocated" sits inside segments that also
hold live blocks: fragmentation. ``labkit.host.allocator`` raises the same message from a replay.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from labkit.core.units import fmt_bytes as _fmt

UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"([\d.]+) (bytes|B|KiB|MiB|GiB|TiB)"
# a CUDA context with its loaded kernels takes a few hundred MiB (more with many kernels
# loaded), and cannot be freed: memory outside PyTorch is to blame only above this (labkit's
# threshold, 1 GiB; verdict() and sufficient() apply it alike)
CONTEXT = 2**30
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"    # read by every version; 2.13 also reads PYTORCH_ALLOC_CONF


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
    allowed: int | None = None    # "... allowed;": a per-process memory fraction's cap
    guessed_this: bool = False    # this process read from a "Process N" line (a container)
    private_pools: int = 0        # "with ... allocated in private pools": free blocks that CUDA
                                  # graphs' pools hold, counted in "allocated by PyTorch"

    @property
    def reserved(self) -> int:
        return self.allocated + self.cached

    @property
    def shortfall(self) -> int:
        """How much more room the request needed: on the device, or under the fraction's cap."""
        room = self.free if self.allowed is None else min(self.free, self.allowed - self.reserved)
        return max(self.requested - max(room, 0), 0)

    @property
    def outside_pytorch(self) -> int | None:
        """This process's memory that PyTorch's allocator did not reserve: the CUDA context and
        loaded kernels, NCCL's own buffers, extensions' direct cudaMalloc. (cuBLAS and cuDNN
        workspaces come from the caching allocator: they are in "allocated".)"""
        if self.this_process is None:
            return None
        return max(self.this_process - self.reserved, 0)

    @property
    def live(self) -> int:
        """Bytes of live tensors: allocated, less the free blocks held in private pools."""
        return self.allocated - self.private_pools

    def sufficient(self) -> dict[str, int]:
        """Each memory that alone would have covered the shortfall, and its bytes. Memory outside
        PyTorch counts only above ``CONTEXT`` (1 GiB), as in verdict(): below, it is mostly the
        CUDA context, which no fix frees."""
        outside = self.outside_pytorch or 0
        found = {"CUDA graphs' private pools (free)": self.private_pools,
                 "fragmentation (reserved but unallocated)": self.cached,
                 "other processes": self.others,
                 "outside PyTorch": outside if outside > CONTEXT else 0}
        return {name: n for name, n in found.items() if n >= self.shortfall and n > 0}

    def verdict(self) -> str:
        """What ran short, and the first fix to try, in the order a triage checks."""
        short = self.shortfall
        where = " (read from a 'Process N' line: in a container PyTorch cannot tell it is this " \
                "process)" if self.guessed_this else ""
        if self.private_pools >= short > 0:
            return (f"CUDA graphs' private pools: {_fmt(self.private_pools)} of free blocks sit "
                    "in them, counted as allocated; release the graphs (or their MemPool), or "
                    "capture fewer (torch.compile's reduce-overhead mode captures them)")
        if self.cached >= short:
            return (f"fragmentation first: {_fmt(self.cached)} sits free inside PyTorch's "
                    f"segments, more than the request lacked ({_fmt(short)}), in pieces too "
                    f"small; set {ALLOC_CONF}=expandable_segments:True, and if the step still "
                    "fails, lower its peak")
        if self.others >= short > 0:
            return (f"another process: other processes hold {_fmt(self.others)} of this GPU; "
                    "stop them, or give each job its own GPU")
        outside = self.outside_pytorch or 0
        if outside >= short > 0 and outside > CONTEXT:
            return (f"memory outside PyTorch's allocator: {_fmt(outside)} in this process{where}, "
                    "more than a CUDA context takes (NCCL, extensions); count it in the budget")
        return (f"the step's tensors: live tensors take {_fmt(self.live)} of "
                f"{_fmt(self.allowed or self.capacity)}; lower the peak (a smaller micro-batch, "
                "recomputation, sharding: lk.estimate says by how much)")


def parse_oom(message: str) -> OomReport:
    """The numbers of PyTorch's CUDA out-of-memory message (any line breaks); ValueError naming
    what is missing if it is not the native allocator's message."""
    text = " ".join(message.split())

    def find(pattern: str, what: str):
        m = re.search(pattern, text)
        if m is None:
            async_hint = (" (backend:cudaMallocAsync words its errors differently: "
                          "it is not read here)" if "cudaMallocAsync" in text
                          or "would exceed allowed memory" in text else "")
            raise ValueError(f"not PyTorch's CUDA out-of-memory message: no {what!r} in it"
                             f"{async_hint}; pass the whole text of the torch.OutOfMemoryError "
                             f"(PyTorch 2.1 or later)")
        return m
    requested = find(r"Tried to allocate " + _SIZE, "Tried to allocate")
    total = find(r"total capac\w+ of " + _SIZE + r" of which " + _SIZE + r" is free",
                 "total capacity of ... of which ... is free")
    held = find(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch,"
                r"(?: with " + _SIZE + r" allocated in private pools \([^)]*\),)? and " + _SIZE
                + r" is reserved by PyTorch but unallocated", "Of the allocated memory")
    allowed = re.search(_SIZE + r" allowed;", text)
    this = re.search(r"this process has " + _SIZE + r" memory in use", text)
    processes = [_bytes(*m.groups()) for m in re.finditer(r"Process \d+ has " + _SIZE +
                                                          r" memory in use", text)]
    groups = held.groups()
    allocated, cached = _bytes(*groups[:2]), _bytes(*groups[4:])
    private = _bytes(*groups[2:4]) if groups[2] else 0
    guessed = None
    if this is None:        # a PID namespace: this process may be printed as "Process N"
        guessed = min((n for n in processes if n >= allocated + cached), default=None)
        if guessed is not None:
            processes.remove(guessed)
    return OomReport(requested=_bytes(*requested.groups()), capacity=_bytes(*total.groups()[:2]),
                     free=_bytes(*total.groups()[2:]), allocated=allocated, cached=cached,
                     this_process=_bytes(*this.groups()) if this else guessed,
                     others=sum(processes), allowed=allowed and _bytes(*allowed.groups()),
                     guessed_this=guessed is not None, private_pools=private)


# ---- torch.cuda.memory_summary()'s table, from a memory_stats() dict -------------------------
SUMMARY_ROWS = (("Allocated memory", "allocated_bytes"), ("Active memory", "active_bytes"),
                ("Requested memory", "requested_bytes"), ("GPU reserved memory", "reserved_bytes"),
                ("Non-releasable memory", "inactive_split_bytes"), ("Allocations", "allocation"),
                ("Active allocs", "active"), ("GPU reserved segments", "segment"),
                ("Non-releasable allocs", "inactive_split"))


def memory_summary(stats: dict) -> str:
    """``torch.cuda.memory_summary()``'s main rows (current and peak, all pools) and its retry and
    OOM counts, from ``torch.cuda.memory_stats()`` or ``CachingAllocator.memory_stats()``."""
    if "allocated_bytes.all.current" not in stats:
        raise ValueError("not a memory_stats() dict (no 'allocated_bytes.all.current'): pass "
                         "torch.cuda.memory_stats() or CachingAllocator.memory_stats()")
    lines = [f"{'Metric':<24}{'Cur Usage':>12}{'Peak Usage':>12}"]
    for label, key in SUMMARY_ROWS:
        current, peak = stats.get(f"{key}.all.current", 0), stats.get(f"{key}.all.peak", 0)
        show = _fmt if key.endswith("_bytes") else str
        lines.append(f"{label:<24}{show(current):>12}{show(peak):>12}")
    lines.append(f"cudaMalloc retries: {stats.get('num_alloc_retries', 0)}   "
                 f"CUDA OOMs: {stats.get('num_ooms', 0)}")
    return "\n".join(lines)
