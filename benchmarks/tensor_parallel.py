"""Per-rank peak memory and seconds per training step of `small` split over 1, 2 and 4 local
gloo ranks by tensor parallelism (labkit.parallel.tensor.tensor_parallel), without and with sequence
parallelism, beside labkit.estimate's per-rank figures. Prints the worst rank's peak by
category, the bytes it sent in a step, the median step time over TIMED untracked steps (worst
rank, one thread per rank: 4 ranks share 2 cores here) and the ratios to one process.

    python benchmarks/tensor_parallel.py [batch] [seq] [precision]
"""
import statistics
import sys

import labkit as lk
from labkit.parallel.cluster import run
from labkit.parallel.tensor.tensor_parallel import tensor_parallel_step

MODEL, STEPS, TIMED = "small", 3, 5
CASES = ((1, False), (2, False), (2, True), (4, False), (4, True))      # (tp, sp)
SHOWN = ("params", "optimizer", "activations", "other")                  # grads: 0 at the peak


def mib(n: int) -> str:
    return f"{n / 2**20:6.2f}"


if __name__ == "__main__":      # spawn re-imports this file in every rank: run only in the parent
    batch, seq = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (1, 512)
    precision = sys.argv[3] if len(sys.argv) > 3 else "fp32"
    cfg = lk.preset(MODEL)
    print(f"{MODEL}, batch {batch} x seq {seq}, {precision}, AdamW; per rank, MiB, "
          "measured | estimate; step: median of 5, worst rank")
    print(f"tp sp  {'peak':>15} " + " ".join(f"{c:>15}" for c in SHOWN)
          + "  sent/step  step ms  peak, time vs tp=1")
    base = None
    for tp, sp in CASES:
        ranks = run(tensor_parallel_step, tp, MODEL, batch, seq, sp, precision, STEPS, TIMED,
                    timeout_s=600)
        worst = max(ranks, key=lambda r: r.peak)
        est = lk.estimate(cfg, batch=batch, seq=seq, precision=precision, optimizer="adamw",
                          tp=tp, sp=sp, device="cpu")
        seconds = max(statistics.median(r.seconds) for r in ranks)
        base = base or (worst.peak, seconds)
        print(f"{tp:>2} {'yes' if sp else 'no':>3} {mib(worst.peak)} | {mib(est.total)} "
              + " ".join(f"{mib(worst.peak_by_category[c])} | {mib(getattr(est, c))}"
                         for c in SHOWN)
              + f" {mib(sum(worst.sent.values())):>10} {1e3 * seconds:8.1f}  "
              f"{worst.peak / base[0]:.2f} x, {seconds / base[1]:.2f} x")
