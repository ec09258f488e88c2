"""Transparent huge pages for one process's host buffers, measured without changing the host.

Common advice says ``echo always > /sys/kernel/mm/transparent_hugepage/enabled``: a change to
every process on the machine. Under ``madvise`` mode (the default of many distributions'
kernels; the kernel's own build default is ``always``) a program can ask for
2 MiB pages for its own buffers, and PyTorch's CPU allocator does so for allocations of 2 MiB
and more when ``THP_MEM_ALLOC_ENABLE=1`` (c10's alloc_cpu: 2 MiB alignment and
``madvise(MADV_HUGEPAGE)``). ``first_touch`` runs a child process either way and measures the
first write to a large tensor (the page faults that back it) and how much of it huge pages back
(``AnonHugePages`` of /proc/self/smaps_rollup). Host memory only: GPU memory is not paged so.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

from labkit.core.units import check_positive

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

# The child: allocate, write every byte once (the first touch faults each page in), report.
_CHILD = r"""
import json, sys, time, torch
nbytes, repeats = int(sys.argv[1]), int(sys.argv[2])
def huge_bytes():
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
times, huge = [], []
for _ in range(repeats):
    t = torch.empty(nbytes, dtype=torch.uint8)
    start = time.perf_counter()
    t.fill_(1)
    times.append(time.perf_counter() - start)
    huge.append(huge_bytes())
    del t
print(json.dumps({"seconds": times, "huge": huge}))
"""


@dataclass(frozen=True)
class FirstTouch:
    """The first write to an ``nbytes`` tensor in a fresh process: median seconds over the
    repeats, and the bytes huge pages backed (None where the kernel does not say)."""

    nbytes: int
    thp_alloc: bool          # THP_MEM_ALLOC_ENABLE=1 in the child
    seconds: float
    huge_bytes: int | None

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / self.seconds / 2**30


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's THP mode: "always", "madvise", "never", or "unknown" (no such file)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def first_touch(nbytes: int, thp_alloc: bool, repeats: int = 3, threads: int = 1,
                timeout: float = 120) -> FirstTouch:
    """Allocate and fill an ``nbytes`` tensor ``repeats`` times in a child process with
    ``THP_MEM_ALLOC_ENABLE`` on or off; only that child's own allocations are affected."""
    check_positive("nbytes", nbytes)
    check_positive("repeats", repeats)
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1" if thp_alloc else "0",
           "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(nbytes), str(repeats)], env=env,
                          capture_output=True, text=True, timeout=timeout, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    huge = [h for h in out["huge"] if h is not None]
    return FirstTouch(nbytes, thp_alloc, statistics.median(out["seconds"]),
                      max(huge) if huge else None)
