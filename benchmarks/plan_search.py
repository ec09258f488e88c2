"""Median search time of ``labkit.course.plan`` for the issue's examples (prints; not a timed test).

    python benchmarks/plan_search.py [--repeat 3]
"""
import argparse
import statistics
import time

from labkit.course.plan import plan

# (model, GPU, GPUs, sequence): the examples, and long sequences (context parallelism)
CASES = [("deepseek-v2-lite", "a100-80gb", 8, 4096), ("llama-2-7b", "rtx-4090-24gb", 1, 4096),
         ("deepseek-v3", "h100-80gb", 2048, 4096), ("llama-3-8b", "h100-80gb", 16, 65536),
         ("llama-3-70b", "h100-80gb", 256, 131072)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for model, gpu, gpus, seq in CASES:
        times, result = [], None
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = plan(model, gpu, gpus, seq=seq)
            times.append(time.perf_counter() - start)
        best = result.fits[0].label() if result.fits else "nothing fits"
        print(f"{model} on {gpus} x {gpu}, seq {seq}: median {statistics.median(times):.2f} s over "
              f"{args.repeat} ({result.estimates} estimates); #1 {best}")


if __name__ == "__main__":
    main()
