"""Seconds for labkit.parallel.cluster.run(all_reduce_demo, N): spawn, join the group, one
all-reduce, collect, end every rank. Prints the median of 3 runs for N = 1, 2, 4.

    python benchmarks/cluster_startup.py
"""
import statistics
import time

from labkit.parallel.cluster import all_reduce_demo, default_backend, run

REPEATS = 3


def seconds(world_size: int) -> float:
    start = time.perf_counter()
    run(all_reduce_demo, world_size, 1024)
    return time.perf_counter() - start


if __name__ == "__main__":      # spawn re-imports this file in every rank: run only in the parent
    for n in (1, 2, 4):
        times = [seconds(n) for _ in range(REPEATS)]
        print(f"N={n} ({default_backend(n)}): median {statistics.median(times):.2f} s "
              f"over {REPEATS} runs (min {min(times):.2f}, max {max(times):.2f})")
