"""Speed of labkit's memory tracker: against PyTorch's MemTracker, and its overhead.

    python benchmarks/tracker.py [--repeats 5]

Prints medians of ``--repeats`` runs and the ratios DESIGN.md sets targets for:
tracker >= 5x faster than MemTracker on a fake LLaMA-2-7B step; overhead on a real CPU
step of ``small`` <= 1.5x; ``measure_step`` of LLaMA-2-7B on fake tensors < 15 s; and the
process's memory after 10 real ``measure_step`` calls (nothing measured may stay alive).
"""
from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import labkit as lk
from labkit.training.measure import init_optimizer_state
from labkit.training.train import make_optimizer, train_step


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_setup(name: str, seq: int):
    cfg = lk.preset(name)
    model = lk.build_model(cfg)
    opt = make_optimizer(model.parameters())
    init_optimizer_state(model, opt)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1))
    return model, opt, tokens[:, :-1], tokens[:, 1:]


def tracked_step(model, opt, x, y):
    with lk.MemoryTracker(model, opt) as mt:
        train_step(model, opt, x, y, "fp32", tracker=mt)
    return mt.peak


def memtracker_step(model, opt, x, y):
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        train_step(model, opt, x, y, "fp32")
    return next(iter(mt.get_tracker_snapshot("peak").values()))["Total"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    r = args.repeats
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {r}\n")

    with FakeTensorMode():
        model, opt, x, y = step_setup("llama-2-7b", 2048)
        ours = median_seconds(lambda: tracked_step(model, opt, x, y), r)
        theirs = median_seconds(lambda: memtracker_step(model, opt, x, y), r)
        same = tracked_step(model, opt, x, y) == memtracker_step(model, opt, x, y)
    print(f"fake llama-2-7b step (seq 2048): labkit tracker {ours:.2f} s, "
          f"MemTracker {theirs:.2f} s -> {theirs / ours:.1f}x faster (target >= 5x); "
          f"same peak: {same}")

    model, opt, x, y = step_setup("small", 1024)
    plain = median_seconds(lambda: train_step(model, opt, x, y, "fp32"), r)
    tracked = median_seconds(lambda: tracked_step(model, opt, x, y), r)
    print(f"real small step (seq 1024, CPU): untracked {plain:.3f} s, tracked {tracked:.3f} s "
          f"-> overhead {tracked / plain:.2f}x (target <= 1.5x)")

    wall = median_seconds(lambda: lk.measure_step("llama-2-7b", seq=2048, fake=True), r)
    print(f"measure_step(llama-2-7b, seq 2048, fake): {wall:.2f} s (target < 15 s)")

    rss = [current_rss()]
    for _ in range(10):
        lk.measure_step("small", seq=512, precision="fp32", fake=False)
        rss.append(current_rss())
    print("resident memory over 10 measure_step('small', fake=False) calls: "
          + " -> ".join(lk.fmt_bytes(v) for v in (rss[0], rss[1], rss[-1]))
          + f" (first, after one, after ten; growth after the first: {lk.fmt_bytes(rss[-1] - rss[1])})")


def current_rss() -> int:
    """This process's resident memory now (bytes), after a collection."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


if __name__ == "__main__":
    main()
