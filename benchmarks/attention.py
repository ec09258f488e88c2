"""Peak memory and time of one attention core's forward + backward: naive, labkit's tiled
(FlashAttention's online softmax in PyTorch) and F.scaled_dot_product_attention.

    python benchmarks/attention.py [--seqs 512 1024 ... 16384] [--heads 8] [--head-dim 64]
                                   [--naive-budget-gib 4] [--repeats 3] [--block 128]

B = 1, causal, fp32, on this CPU. Peak: the tracker's bytes beyond q, k, v and the output's
gradient (exact, the same on every run). Time: the median of up to ``--repeats`` runs after a
warm-up (fewer once a size has taken 20 s). Naive runs while its peak - three (H, N, N) fp32
matrices in the softmax's backward - fits in ``--naive-budget-gib``. Then the FlashAttention
paper's HBM accesses (Theorem 2, ``labkit.transformer.attention.hbm_accesses``) for one head at each
N, for the on-chip memory of an A100, H100 SXM and H200 (bf16 numbers).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from labkit.core.units import fmt_bytes
from labkit.transformer.attention import (SRAM_PER_SM, core, core_inputs, core_peak_bytes,
                                          hbm_accesses)

GiB = 1024 ** 3


def fwd_bwd(core, q, k, v, grad_out):
    core(q, k, v).backward(grad_out)
    q.grad = k.grad = v.grad = None


def median_seconds(core, q, k, v, grad_out, repeats: int, budget_s: float = 20.0) -> float:
    fwd_bwd(core, q, k, v, grad_out)                                          # warm-up
    times, spent = [], 0.0
    while len(times) < repeats and (not times or spent < budget_s):
        start = time.perf_counter()
        fwd_bwd(core, q, k, v, grad_out)
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+",
                        default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--naive-budget-gib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    H, d = args.heads, args.head_dim
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B=1, H={H}, d={d}, "
          f"causal, fp32, tiled block {args.block}; peak beyond q, k, v and dO\n")
    print(f"{'N':>6} {'impl':>6} {'peak':>11} {'ms':>10}  {'peak / sdpa':>11} {'time / sdpa':>11}")
    for n in args.seqs:
        q, k, v, grad_out = core_inputs(n, H, d)
        rows = {}
        for name in ("naive", "tiled", "sdpa"):
            if name == "naive" and 3 * H * n * n * 4 > args.naive_budget_gib * GiB:
                continue                               # P, dP and dS would not fit the budget
            rows[name] = (core_peak_bytes(name, n, H, d, block=args.block),
                          median_seconds(core(name, args.block), q, k, v, grad_out, args.repeats))
        sdpa_peak, sdpa_time = rows["sdpa"]
        for name, (peak, seconds) in rows.items():
            print(f"{n:>6} {name:>6} {fmt_bytes(peak):>11} {seconds * 1000:>10.1f}  "
                  f"{peak / sdpa_peak:>10.2f}x {seconds / sdpa_time:>10.2f}x", flush=True)
    print("\nHBM accesses of one head's forward (FlashAttention, Theorem 2; bf16 numbers):")
    print(f"{'N':>6} {'standard':>14} " + " ".join(f"{name + ' tiled':>16} {'ratio':>6}"
                                                    for name in SRAM_PER_SM))
    for n in args.seqs:
        standard = hbm_accesses(n, d, 1, "naive")
        cells = [(t, standard / t) for t in (hbm_accesses(n, d, sram.per_sm, "tiled")
                                             for sram in SRAM_PER_SM.values())]
        print(f"{n:>6} {standard:>14,} " + " ".join(f"{t:>16,} {r:>5.1f}x" for t, r in cells))


if __name__ == "__main__":
    main()
