"""Host memory of the input pipeline: /dev/shm held by a DataLoader per setting, and what pinned
memory does for host-to-device copies.

    python benchmarks/host_memory.py [--batch-mib 4] [--settings 1x2 2x2 4x2 2x4] [--runs 3]
                                     [--sizes-mib 1 16 256] [--repeats 10] [--shared]

/dev/shm: the median over ``--runs`` of the peak bytes above the baseline, per
workers x prefetch_factor and sharing strategy, beside the loader's steady holding
(in flight + 1 batch) and ``labkit.host.shm.shm_needed`` (in flight + 2). Each run is a child on a
private tmpfs when ``unshare`` allows it (else, or with ``--shared``, on this machine's /dev/shm,
where other processes add noise). Pinned memory: on CUDA the median host-to-device GB/s from
pageable memory, from pinned memory and from pinned memory with ``non_blocking=True`` (with the
host thread's wait); on a CPU-only build the median cost of the extra host copy that
``pin_memory()`` makes, and why pinning itself cannot run.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from labkit.core.units import fmt_bytes
from labkit.host.pinned import h2d_bandwidth, pinned_copy_cost
from labkit.host.shm import STRATEGIES, measure_loader_shm, namespaces_available

MiB = 2**20


def shm_table(batch_bytes: int, settings: list, runs: int, private: bool) -> None:
    where = "a private tmpfs" if private and namespaces_available()[0] else "the shared /dev/shm"
    print(f"/dev/shm held by a DataLoader, batches of {fmt_bytes(batch_bytes)}, on {where} "
          f"(median of {runs} runs)")
    print(f"{'workers x prefetch':>19}{'strategy':>17}{'peak':>12}{'batches':>9}"
          f"{'steady':>12}{'shm_needed':>12}")
    for setting in settings:
        workers, prefetch = map(int, setting.split("x"))
        for strategy in STRATEGIES:
            ms = [measure_loader_shm(batch_bytes, workers, prefetch, strategy=strategy,
                                     private=private) for _ in range(runs)]
            peak = statistics.median(m.peak for m in ms)
            print(f"{setting:>19}{strategy:>17}{fmt_bytes(peak):>12}"
                  f"{peak / ms[0].batch_shm:>9.2f}{fmt_bytes(ms[0].steady):>12}"
                  f"{fmt_bytes(ms[0].predicted):>12}")


def pinned_table(sizes: list, repeats: int) -> None:
    if torch.cuda.is_available():
        print(f"\nhost-to-device copies on {torch.cuda.get_device_name()} (median of {repeats})")
        print(f"{'size':>12}{'mode':>24}{'GB/s':>9}{'GPU ms':>10}{'host ms':>10}")
        for t in h2d_bandwidth(sizes, repeats=repeats):
            print(f"{fmt_bytes(t.nbytes):>12}{t.mode:>24}{t.gbps:>9.2f}{t.gpu_ms:>10.3f}"
                  f"{t.host_ms:>10.3f}")
    print(f"\nthe host copy pin_memory() makes (median of {repeats})")
    print(f"{'size':>12}{'copy ms':>10}{'GB/s':>8}{'pinned block':>14}{'first pin ms':>14}"
          f"{'pin ms':>9}")
    for n in sizes:
        c = pinned_copy_cost(n, repeats=repeats)
        first = f"{c.pin_first_ms:.3f}" if c.available else "-"
        later = f"{c.pin_ms:.3f}" if c.available else "-"
        print(f"{fmt_bytes(n):>12}{c.copy_ms:>10.3f}{c.copy_gbps:>8.2f}"
              f"{fmt_bytes(c.pinned_bytes):>14}{first:>14}{later:>9}")
    if not torch.cuda.is_available():
        print(f"pinning itself: {pinned_copy_cost(MiB, repeats=1).reason}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-mib", type=int, default=4)
    parser.add_argument("--settings", nargs="+", default=["1x2", "2x2", "4x2", "2x4"],
                        help="num_workers x prefetch_factor")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shared", action="store_true", help="measure on this /dev/shm")
    args = parser.parse_args()
    shm_table(args.batch_mib * MiB, args.settings, args.runs, private=not args.shared)
    pinned_table([n * MiB for n in args.sizes_mib], args.repeats)


if __name__ == "__main__":
    main()
