"""The host's AdamW step, as ZeRO-Offload runs it: how close each of torch's CPU implementations
comes to streaming its states at DRAM speed, which the planner's step-time model assumes.

    python benchmarks/cpu_adam.py [--millions 50] [--repeats 5] [--threads N]

Prints the median seconds of one step over ``--millions`` fp32 parameters for the for-loop,
foreach and fused implementations, the nanoseconds per parameter, the DRAM traffic that implies
at torch's 28 bytes per parameter (fp32: read weight, gradient, m and v; write three back), and
beside it the GB/s of a plain copy (read + write) of the same size on this machine. The
planner charges DeepSpeed's step 36 bytes (``steptime.HOST_STEP_BYTES``: its copies too).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tracker import median_seconds  # noqa: E402  (benchmarks/tracker.py's median timer)


ADAMW_BYTES = 28        # torch's fp32 AdamW: 16 bytes read, 12 written per parameter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--millions", type=int, default=50, help="fp32 parameters, millions")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.millions * 10**6
    src, dst = torch.randn(n), torch.empty(n)
    copy = 8 * n / median_seconds(lambda: dst.copy_(src), args.repeats) / 1e9
    print(f"{n / 1e6:.0f}M fp32 parameters, {torch.get_num_threads()} threads; "
          f"a copy moves {copy:.1f} GB/s (read + write)")
    param = torch.zeros(n, requires_grad=True)
    param.grad = torch.randn(n)
    for impl in ("for-loop", "foreach", "fused"):
        kwargs = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
                  "fused": dict(fused=True)}[impl]
        optimizer = torch.optim.AdamW([param], lr=1e-3, **kwargs)
        optimizer.step()                                           # the moments exist
        seconds = median_seconds(optimizer.step, args.repeats)
        print(f"AdamW {impl:9s} median {seconds * 1e3:7.1f} ms: {seconds / n * 1e9:5.2f} ns per "
              f"parameter, {ADAMW_BYTES * n / seconds / 1e9:5.1f} GB/s at {ADAMW_BYTES} B/param "
              f"({ADAMW_BYTES * n / seconds / 1e9 / copy:.2f}x the copy)")


if __name__ == "__main__":
    main()
