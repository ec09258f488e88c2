"""Expert parallelism on local gloo processes: step time and each rank's peak for tiny-moe at
ep 1, 2 and 4, with the unbiased router (about balanced) and one that sends every token to
rank 0's experts (``hot=1.0``); with ``--deepseek-v3``, DeepSeek-V3's per-rank memory at
ep 8 to 64 (labkit.predict.layers and the estimate) and one rank at ep 64 on fake tensors.

    python benchmarks/expert_parallel.py [--model tiny-moe] [--seq 256] [--steps 6]
    python benchmarks/expert_parallel.py --deepseek-v3 [--seq 4096]

Bytes come from ``labkit.parallel.expert.expert_parallel.ep_step`` (the tracker, exact on CPU, last
of 2 steps). Seconds: ``time_ep_steps`` (no tracker; the ranks start each step together), the
median over ranks' steps after the first, of the slowest rank. Every rank trains ``--seq``
tokens, so ep ranks train ep times the tokens of one; on a 2-core machine 4 ranks share 2
cores, and their seconds show the oversubscription as much as the messages.
"""
from __future__ import annotations

import argparse
import statistics

from labkit.core.units import fmt_bytes
from labkit.parallel.cluster import run
from labkit.parallel.expert.expert_parallel import ep_memory, ep_steps, fake_ep_peak, time_ep_steps

EPS = (1, 2, 4)
ROUTERS = {"balanced": 0.0, "skewed": 1.0}      # router bias on rank 0's experts


def deepseek_v3(seq: int):
    """Per rank, bf16-master, AdamW (CUDA's foreach), batch 1: states from labkit.predict.layers,
    the estimate's peak, and one rank at ep 64 measured on fake tensors (balanced routing)."""
    print(f"deepseek-v3, bf16-master, AdamW, batch 1 x seq {seq}, only the experts split")
    print(f"{'ep':>3} {'experts':>7} {'routed params':>14} {'replicated':>14} "
          f"{'routed states':>13} {'estimate peak':>13} {'at':>9}")
    for row in ep_memory("deepseek-v3", seq=seq):
        print(f"{row['ep']:>3} {row['experts_per_rank']:>7} {row['routed_params']:>14,} "
              f"{row['replicated_params']:>14,} {fmt_bytes(row['routed_state_bytes']):>13} "
              f"{fmt_bytes(row['estimate']):>13} {row['estimate_phase']:>9}")
    fake = fake_ep_peak("deepseek-v3", 64, seq=seq)
    print(f"ep 64 on fake tensors: peak {fmt_bytes(fake['peak'])} ({fake['peak']:,} B) in the "
          f"{fake['peak_phase']} step, {fake['seconds']:.1f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--deepseek-v3", action="store_true",
                        help="DeepSeek-V3's per-rank memory at ep 8-64 instead (no processes)")
    args = parser.parse_args()
    if args.deepseek_v3:
        return deepseek_v3(args.seq)
    print(f"{args.model}, fp32, AdamW, batch 1 x seq {args.seq} per rank; seconds: median of "
          f"{args.steps - 1} steps (slowest rank); peaks: rank 0, 1, ...")
    print(f"{'ep':>3} {'router':>9} {'seconds':>8} {'rank 0 rows':>11} {'share':>6}  peaks")
    for ep in EPS:
        settings = [dict(model_name=args.model, seq=args.seq, hot=hot) for hot in ROUTERS.values()]
        steps = run(ep_steps, ep, settings, timeout_s=600)        # [rank][setting]
        for i, (name, setting) in enumerate(zip(ROUTERS, settings)):
            seconds = run(time_ep_steps, ep, steps=args.steps, timeout_s=600, **setting)
            slowest = [max(step) for step in zip(*seconds)][1:]      # each step's slowest rank
            ranks = [per_rank[i] for per_rank in steps]
            rows = [sum(r.received) for r in ranks]
            print(f"{ep:>3} {name:>9} {statistics.median(slowest):>8.3f} {rows[0]:>11,} "
                  f"{rows[0] / sum(rows):>6.2f}  " + ", ".join(fmt_bytes(r.peak) for r in ranks),
                  flush=True)


if __name__ == "__main__":      # spawn re-imports this file in every rank: run only in the parent
    main()
