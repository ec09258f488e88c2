"""Median time of one ``labkit.estimate`` of DeepSeek-V3 per layout (prints; not a timed test).

    python benchmarks/estimate_speed.py [--repeat 21]

Run it at two commits (a ``git worktree`` of the older one, with PYTHONPATH pointing there) to
compare; a layout the older estimate refuses prints "refused".
"""
import argparse
import statistics
import time

import labkit as lk

CASES = {   # name -> (recompute, the layout's keywords)
    "one GPU, no recompute": ("none", {}),
    "ZeRO-3 over 256, tp 8": ("selective", dict(dp=256, zero_stage=3, tp=8, sp=True)),
    "ZeRO-1, tp 8, pp 32, zb-h1": ("selective", dict(dp=8, zero_stage=1, tp=8, sp=True, pp=32,
                                                     schedule="zb-h1", micro_batches=256)),
    "ep 64, pp 16, no ZeRO": ("full", dict(dp=128, ep=64, pp=16, micro_batches=120)),
    "ep 64, pp 16, ZeRO-1 (DeepSeek's)": ("full", dict(dp=128, ep=64, pp=16, zero_stage=1,
                                                       micro_batches=120)),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    for name, (recompute, layout) in CASES.items():
        times = []
        try:
            recipe, layout = lk.Recipe("bf16-master", recompute=recompute), lk.Layout(**layout)
            for _ in range(args.repeat):
                start = time.perf_counter()
                est = lk.estimate("deepseek-v3", 1, 4096, recipe=recipe, layout=layout,
                                  device="cuda")
                times.append(time.perf_counter() - start)
        except ValueError:
            print(f"{name:<36} refused")
            continue
        print(f"{name:<36} median {1e3 * statistics.median(times):7.2f} ms over {args.repeat}"
              f"  ({lk.fmt_bytes(est.total)} per GPU)")


if __name__ == "__main__":
    main()
