"""DDP's gradient buckets on a 2-rank gloo cluster: per-rank peak, buckets and seconds for the
``small`` model, for bucket_cap_mb in (1, 25, 100, torch's default) x gradient_as_bucket_view.

    python benchmarks/ddp_buckets.py [--model small] [--repeats 3]

Bytes come from ``labkit.parallel.data.ddp.ddp_step`` (the tracker, exact on CPU); seconds are the
median of ``--repeats`` whole runs (start 2 ranks, build, 3 tracked steps), so they show the
cost of a setting only where it exceeds the start-up and the tracker's overhead.
"""
from __future__ import annotations

import argparse
import statistics
import time

from labkit.core.units import fmt_bytes
from labkit.parallel.cluster import run
from labkit.parallel.data.ddp import ddp_step, ddp_steps

N = 2
CAPS = (1, 25, 100, None)            # None: torch's default, 25 MiB with a 1 MiB first bucket


def seconds(setting: dict) -> float:
    start = time.perf_counter()
    run(ddp_step, N, timeout_s=600, **setting)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = [dict(model_name=args.model, bucket_cap_mb=cap, gradient_as_bucket_view=view)
                for cap in CAPS for view in (False, True)]
    steps = run(ddp_steps, N, settings, timeout_s=600)[0]          # rank 0 (ranks are alike)
    print(f"{args.model}, N={N}, fp32, batch 1 x seq 32 per rank; "
          f"gradients {fmt_bytes(steps[0].grad_bytes)} per rank")
    print(f"{'cap MiB':>8} {'views':>5} {'buckets':>7} {'bucket bytes':>13} {'peak':>11} "
          f"{'at':>9} {'grads at peak':>13} {'seconds':>8}")
    for setting, step in zip(settings, steps):
        times = [seconds(setting) for _ in range(args.repeats)]
        cap = setting["bucket_cap_mb"]
        print(f"{'default' if cap is None else cap:>8} "
              f"{'on' if setting['gradient_as_bucket_view'] else 'off':>5} "
              f"{len(step.buckets):>7} {sum(step.buckets):>13,} {step.peak:>11,} "
              f"{step.peak_phase:>9} {step.peak_by_category['grads']:>13,} "
              f"{statistics.median(times):>8.2f}")


if __name__ == "__main__":      # spawn re-imports this file in every rank: run only in the parent
    main()
