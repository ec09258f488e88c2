"""Per-rank memory of FSDP2 (ZeRO-3) at 8 to 1024 ranks: fake tensors, a fake process group.

    python benchmarks/fsdp_fake_scaling.py [--models llama-2-7b deepseek-v2-lite]
        [--worlds 8 16 ... 1024] [--seq 4096] [--placement dim0|even] [--figure out.png]

For each model prints one row per N: the tracker's peak on rank 0 of one bf16-master training
step (``labkit.parallel.data.fsdp.fake_fsdp2_peak``), ``labkit.estimate(zero_stage=3, dp=N)``, their
ratio, the bytes by category where they differ, and the seconds the case took. Target: the
LLaMA-2-7B sweep well under a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from labkit.core.units import CATEGORIES, fmt_bytes
from labkit.course.plot import scaling_figure
from labkit.parallel.data.fsdp import WORLDS, fake_fsdp2_scaling


def table(name: str, rows: list) -> str:
    lines = [f"{name}: {fmt_bytes(rows[0]['n_params'] * 16)} of model states (16 bytes per "
             f"parameter), batch 1",
             f"{'N':>5} {'measured':>11} {'estimate':>11} {'ratio':>7} {'seconds':>8}  "
             f"measured - estimate, by category"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['world_size']:>5} {'-':>11} {fmt_bytes(r['estimate']):>11} "
                         f"{'-':>7} {'-':>8}  could not run: {r['error']}")
            continue
        differ = ", ".join(f"{k} {fmt_bytes(r['by_category'][k] - r['estimate_by_category'][k])}"
                           for k in CATEGORIES
                           if r["by_category"][k] != r["estimate_by_category"][k])
        lines.append(f"{r['world_size']:>5} {fmt_bytes(r['peak']):>11} "
                     f"{fmt_bytes(r['estimate']):>11} {r['ratio']:>7.4f} {r['seconds']:>8.1f}  "
                     f"{differ}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama-2-7b", "deepseek-v2-lite"])
    parser.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--placement", default="dim0", choices=["dim0", "even"])
    parser.add_argument("--figure", help="save the log-log figure to this file")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; FSDP2 fully_shard per block, "
          f"bf16-master, seq {args.seq}, placement {args.placement}, fake process group, "
          f"CUDA defaults (AdamW foreach)")
    rows_by_model = {}
    for name in args.models:
        start = time.perf_counter()
        rows = fake_fsdp2_scaling(name, args.worlds, seq=args.seq, placement=args.placement)
        print(table(name, rows))
        print(f"{name}: {time.perf_counter() - start:.1f} s for {len(rows)} cases\n", flush=True)
        rows_by_model[name] = rows
    if args.figure:
        scaling_figure(rows_by_model).savefig(args.figure, dpi=120)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
