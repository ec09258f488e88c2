"""Speed of a full-scale MoE training step on fake tensors (``labkit.measure_step``).

    python benchmarks/moe_fake_step.py [--repeats 3] [--seq 1024] [--skip-v3]

Prints the median seconds of ``--repeats`` steps of DeepSeek-V2-Lite and one step of
DeepSeek-V3 (671B), with the machine's core count. Target: the V3 step in under a minute on
2 cores. The routed experts are stacked weights run as three grouped matmuls per layer, so the
cost does not grow with the number of experts (V3: 256 per layer, 58 MoE layers).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import labkit as lk


def seconds(name: str, seq: int) -> float:
    start = time.perf_counter()
    lk.measure_step(name, seq=seq, fake=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--skip-v3", action="store_true", help="time DeepSeek-V2-Lite only")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
          f"seq {args.seq}, batch 1, bf16-mixed, AdamW, fake tensors")
    lite = [seconds("deepseek-v2-lite", args.seq) for _ in range(args.repeats)]
    print(f"deepseek-v2-lite: {statistics.median(lite):7.2f} s  (median of {args.repeats}: "
          + ", ".join(f"{t:.2f}" for t in lite) + ")", flush=True)
    if not args.skip_v3:
        print(f"deepseek-v3:      {seconds('deepseek-v3', args.seq):7.2f} s  (one run; "
              f"target < 60 s on 2 cores)")


if __name__ == "__main__":
    main()
