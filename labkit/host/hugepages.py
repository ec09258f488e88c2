"""Transparent huge pages for one process's host buffers, measured without changing the host.

Common advice says ``echo always > /sys/kernel/mm/transparent_hugepage/enabled``: a change to
every process on the machine. Under ``madvise`` mode (the default of many distributions'
kernels; the kernel's own build default is ``always``) a program can ask for
2 MiB pages for its own buffers, and PyTorch's CPU allocator does so for allocations of 2 MiB
and more when ``THP_MEM_ALLOC_ENABLE=1`` (c10's alloc_cpu: 2 MiB alignment and
``madvise(MADV_HUGEPAGE)``). ``first_touch`` runs a child process either way and times three
writes apart: the first allocation's first write (the page faults that back it, and with THP any
compaction), later allocations of the same size (which fault in the blocks just freed), and a
write to memory already faulted in (what a buffer kept across steps pays); and it reads how much
of it huge pages back (``AnonHugePages`` of /proc/self/smaps_rollup). Host memory only: GPU
memory is not paged so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from labkit.core.units import check_positive

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

# The child: three timings of writing every byte of an ``nbytes`` tensor.
#  first:   the first allocation's first write: every page faults in (with THP, 2 MiB pages the
#           kernel must find free, or assemble by compaction);
#  again:   each later allocation of the same size: faults again, on the 2 MiB blocks just freed;
#  retouch: the first tensor written again, its pages already mapped: what a buffer that lives
#           across steps (an optimizer's moments kept in pageable host memory) pays every step.
# compact_stall is a host-wide counter of /proc/vmstat, read around `first`.
_CHILD = r"""
import json, sys, time, torch
nbytes, repeats, retouches = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def huge_bytes():
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
def vmstat():
    try:
        with open("/proc/vmstat") as f:
            return {k: int(v) for k, v in (line.split() for line in f)}
    except (OSError, ValueError):
        return {}
def write(t, value):
    start = time.perf_counter()
    t.fill_(value)
    return time.perf_counter() - start
before = vmstat()
t = torch.empty(nbytes, dtype=torch.uint8)
first = write(t, 1)
after, huge = vmstat(), huge_bytes()
retouch = [write(t, 2 + i % 200) for i in range(retouches)]
del t
again = []
for _ in range(repeats - 1):
    t = torch.empty(nbytes, dtype=torch.uint8)
    again.append(write(t, 1))
    del t
delta = {k: after[k] - before[k] for k in ("compact_stall",) if k in before and k in after}
print(json.dumps({"first": first, "again": again, "retouch": retouch, "huge": huge, "vmstat": delta}))
"""


@dataclass(frozen=True)
class FirstTouch:
    """Writing every byte of an ``nbytes`` tensor in a fresh process, in seconds: the first
    allocation (``first``: a real first touch), the fastest of later allocations of the same size
    (``again``: None with one allocation), the fastest write to memory already faulted in
    (``retouch``; the fastest, because other processes' noise only adds); the bytes huge pages
    backed after the first touch and the compaction stalls the kernel counted during it
    (host-wide; None where the kernel does not say)."""

    nbytes: int
    thp_alloc: bool          # THP_MEM_ALLOC_ENABLE=1 in the child
    first: float
    again: float | None
    retouch: float
    huge_bytes: int | None
    compact_stalls: int | None

    @property
    def gib_per_s(self) -> float:
        """The first touch's rate."""
        return self.nbytes / self.first / 2**30


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's THP mode: "always", "madvise", "never", or "unknown" (no such file)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def first_touch(nbytes: int, thp_alloc: bool, repeats: int = 3, retouches: int = 15,
                threads: int = 1, timeout: float = 120) -> FirstTouch:
    """Allocate and fill an ``nbytes`` tensor ``repeats`` times, and fill the first one again
    ``retouches`` times, in a child process with ``THP_MEM_ALLOC_ENABLE`` on or off; only that
    child's own allocations are affected."""
    check_positive("nbytes", nbytes)
    check_positive("repeats", repeats)
    check_positive("retouches", retouches)
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1" if thp_alloc else "0",
           "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(nbytes), str(repeats), str(retouches)],
                          env=env, capture_output=True, text=True, timeout=timeout, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return FirstTouch(nbytes, thp_alloc, out["first"], min(out["again"], default=None),
                      min(out["retouch"]), out["huge"],
                      out["vmstat"].get("compact_stall"))
