"""Seconds for labkit.parallel.cluster.run(all_reduce_demo, N): start the ranks, join the group,
one all-reduce, collect, end every rank. For each way of starting a rank - the forkserver that
cluster.run uses (its first call starts the server, which imports torch and labkit once) and a
fresh interpreter per rank (spawn) - prints the first call and the median of the next 3, for
N = 1, 2, 4.

    python benchmarks/cluster_startup.py
"""
import multiprocessing as mp
import statistics
import time

from labkit.parallel import cluster
from labkit.parallel.cluster import all_reduce_demo, default_backend, run

REPEATS = 3


def seconds(world_size: int) -> float:
    start = time.perf_counter()
    run(all_reduce_demo, world_size, 1024)
    return time.perf_counter() - start


if __name__ == "__main__":      # a spawned rank re-imports this file: run only in the parent
    ways = {"forkserver (cluster.run's)": cluster._start_method,
            "spawn (a fresh interpreter per rank)": lambda: mp.get_context("spawn")}
    for label, start_method in ways.items():
        cluster._start_method = start_method
        first = seconds(2)
        print(f"{label}: first call, N=2: {first:.2f} s")
        for n in (1, 2, 4):
            times = [seconds(n) for _ in range(REPEATS)]
            print(f"  N={n} ({default_backend(n)}): median {statistics.median(times):.2f} s "
                  f"over {REPEATS} runs (min {min(times):.2f}, max {max(times):.2f})")
