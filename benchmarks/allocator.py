"""The caching-allocator model's speed: a LLaMA-2-7B step on fake tensors measured with and
without the tracker's event log, its events replayed (native and expandable segments), the
smallest device it runs on found by bisection, and the replay exported as a memory snapshot.

    python benchmarks/allocator.py [--model llama-2-7b] [--seq 2048] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tracker import median_seconds  # noqa: E402  (benchmarks/tracker.py's median timer)

import labkit as lk  # noqa: E402
from labkit.host.allocator import AllocatorSettings, min_capacity, replay  # noqa: E402
from labkit.host.memory_snapshot import snapshot  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    step = dict(batch=1, seq=args.seq, precision="bf16-mixed", fake=True, device="cuda")
    plain = median_seconds(lambda: lk.measure_step(args.model, **step), args.repeats)
    logged = median_seconds(lambda: lk.measure_step(args.model, events=True, **step), args.repeats)
    m = lk.measure_step(args.model, events=True, **step)
    print(f"{args.model}, 1 x {args.seq}, bf16-mixed, fake tensors: {len(m.events):,} storage events")
    print(f"  measure_step              {plain:7.2f} s   with events=True {logged:7.2f} s "
          f"({logged / plain:.2f}x)")
    for label, settings in (("native", AllocatorSettings()),
                            ("expandable segments", AllocatorSettings(expandable_segments=True))):
        seconds = median_seconds(lambda: replay(m.events, settings), args.repeats)
        run = replay(m.events, settings)
        start = time.perf_counter()
        need = min_capacity(m.events, settings, tolerance=4 * 2**20)
        bisect = time.perf_counter() - start
        start = time.perf_counter()
        snap = snapshot(run)
        export = time.perf_counter() - start
        print(f"  {label:20s} replay {seconds:6.3f} s ({len(m.events) / seconds / 1e3:5.0f}k events/s); "
              f"reserved {lk.fmt_bytes(run.peak_reserved)}, needs {lk.fmt_bytes(need)} "
              f"(bisection {bisect:5.2f} s); snapshot of {len(snap['device_traces'][0]):,} "
              f"entries {export:5.3f} s")


if __name__ == "__main__":
    main()
