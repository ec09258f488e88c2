"""Seconds per training step of `small` on 2 local gloo ranks: DDP and labkit's ZeRO stages
1-3 (no tracker). Prints the median over the steps after the first two, each rank's worst,
and the ratio to DDP: what the reduce-scatters, all-gathers and (stage 3) re-gathers cost.

    python benchmarks/zero_steps.py [batch] [seq]
"""
import statistics
import sys

from labkit.parallel.cluster import run
from zero_ranks import step_seconds

STEPS, WARMUP = 8, 2

if __name__ == "__main__":      # spawn re-imports this file in every rank: run only in the parent
    batch, seq = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4, 128)
    medians = {}
    for stage in (0, 1, 2, 3):
        ranks = run(step_seconds, 2, stage, "small", batch, seq, STEPS, timeout_s=600)
        medians[stage] = max(statistics.median(r[WARMUP:]) for r in ranks)
        name = "DDP" if stage == 0 else f"ZeRO-{stage}"
        print(f"small, {batch} x {seq} per rank, 2 ranks, {name:6s}: median step "
              f"{1e3 * medians[stage]:7.1f} ms (worst rank), {medians[stage] / medians[0]:.2f} x DDP")
