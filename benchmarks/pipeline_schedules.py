"""Idle fraction and per-stage memory of each pipeline schedule on p local gloo ranks, beside
the simulator's: with equal op costs (the papers' formulas) and with the ops' measured median
durations (unequal stages, messages free). Idle: the median of 3 untracked runs after a
warm-up. Memory: one tracked run, the activations each stage held at most (exact bytes,
beside ``predicted_held``) and the tracker's peak beside the estimate's for that stage (the
executor runs forward and backward, no optimizer step: the estimate with optimizer="sgd").

    python benchmarks/pipeline_schedules.py [p ...]        # default: 2 4
"""
import dataclasses
import statistics
import sys

import labkit as lk
from labkit.core.config import preset
from labkit.parallel.pipeline.pipeline_parallel import measure_schedules, predicted_held
from labkit.parallel.pipeline.schedules import measured_durations, simulate, zb_h1_bubble
from labkit.predict.papers import pipeline_bubble

CFG = dataclasses.replace(preset("small"), layers=8)    # 8 layers: p = 4 with v = 2 chunks
BATCH, SEQ, RUNS = 1, 128, 3
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]


def formula(name, p, m, v):
    if name == "zb-h1":
        return zb_h1_bubble(p, m) if m >= p else float("nan")
    return pipeline_bubble(p, m, name, v)


def kib(values):
    return "/".join(f"{x / 1024:.0f}" for x in values)


if __name__ == "__main__":      # spawn re-imports this file in every rank: run only in the parent
    ps = [int(a) for a in sys.argv[1:]] or [2, 4]
    for p in ps:
        cases = [(name, m, v) for m in (4, 8) for name, v in SCHEDULES]
        tracked = measure_schedules(CFG, p, cases, BATCH, SEQ, track=True, timeout_s=900)
        timed = measure_schedules(CFG, p, cases * (1 + RUNS), BATCH, SEQ, track=False,
                                  timeout_s=900)[len(cases):]       # the first round warms up
        print(f"\nsmall with 8 layers, {p} stages, micro-batch {BATCH} x {SEQ} tokens, "
              f"idle: median of {RUNS} runs")
        print(f"{'schedule':12s} {'m':>2s} {'v':>2s} | {'idle':>6s} {'sim':>6s} {'formula':>7s} "
              f"| held KiB per stage (= predicted) | peak KiB per stage (estimate, off by)")
        for i, (name, m, v) in enumerate(cases):
            repeats = timed[i::len(cases)]
            idle = statistics.median(float(r.timeline.idle_fraction) for r in repeats)
            sim = statistics.median(float(simulate(r.schedule, measured_durations(r.timeline))
                                          .idle_fraction) for r in repeats)
            run = tracked[i]
            held = [s.held for s in run.stages]
            same = "=" if held == predicted_held(run.schedule, CFG, BATCH, SEQ) else "!="
            est = lk.estimate(CFG, BATCH, SEQ, precision="fp32", device="cpu",   # no step:
                              optimizer="sgd", layout=lk.Layout(                   # no state
                                  pp=p, micro_batches=m, schedule=name, virtual_stages=v))
            peaks = ", ".join(f"{s.peak / 1024:.0f} ({e['total'] / 1024:.0f}, "
                              f"{(e['total'] - s.peak) / s.peak:+.1%})"
                              for s, e in zip(run.stages, est.details["stages"]))
            print(f"{name:12s} {m:2d} {v:2d} | {idle:6.1%} {sim:6.1%} "
                  f"{formula(name, p, m, v):7.1%} | {kib(held):>24s} ({same}) | {peaks}")
