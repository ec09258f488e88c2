"""Lab 09's exercises: the planner."""
from __future__ import annotations

from labkit.course.exercises.core import register
from labkit.predict.layers import count_params


@register(
    "09-fewest-a100s-13b",
    question="""Full fine-tuning of LLaMA-2-13B (bf16 weights and gradients, fp32 master weights
and AdamW state, with torch's default AdamW: foreach), sequences of 4096 tokens, a global
batch of one sequence per GPU, no offload: on how few A100-80GB GPUs does the planner find a
layout that fits its usable memory (the card less 10% headroom)?""",
    unit="GPUs", rtol=0,
    hint="First the paper bound: the states take 16 bytes per parameter, and ZeRO or tensor "
         "parallelism splits them over the GPUs. Then ask labkit.course.plan.plan(..., "
         "offload=False) whether that many GPUs also hold the activations and the optimizer "
         "step's temporaries; if not, try one more.",
    solution="""
- Answer {answer}. Paper bound {bound}: 16 B x {params:,} = {states:.1f} GiB over {usable:.1f}
  GiB usable.
- On {bound}, foreach's step temporary tips every recipe over: {z3:.1f} GiB with labkit's
  recipe, {z3_fsdp2:.1f} GiB with fp32 shards as the master. So {answer} holds for PyTorch too.
- With fused=True, FSDP2 fits on {bound}: {z3_fsdp2_fused:.2f} GiB under autocast over fp32
  shards ({fused_margin:.0%}); MixedPrecisionPolicy needs less. labkit's recipe does not fit
  there: ZeRO-3 states 18 B/param = {states18:.1f} GiB, backward peak {z3_fused:.1f} GiB. The
  planner therefore needs {answer}.
- On {answer} GPUs: "{best}", {total:.1f} GiB ({margin:.0%}).""",
)
def _fewest_a100s_13b():
    import dataclasses
    import math

    from labkit.core.gpus import GPUS
    from labkit.course.plan import plan
    from labkit.core.config import preset
    from labkit.predict import estimate
    from labkit.predict.plan_search import Family, family_candidates
    GiB_, n = 2**30, 1
    while not (p := plan("llama-2-13b", "a100-80gb", n, seq=4096, offload=False, top=1)).fits:
        n += 1                             # plan() also tries fused AdamW when foreach fits nowhere
    params = count_params("llama-2-13b").total
    bound = math.ceil(16 * params / p.usable)

    def zero3(optimizer, fsdp2=False):     # ZeRO-3 over the bound, full recomputation, mb 1
        f = Family("all", bound, 3, False, 1, 1, 1, optimizer=optimizer)
        k = family_candidates(preset("llama-2-13b"), GPUS["a100-80gb"], bound, f, seq=4096,
                              recompute=("full",))[0]
        recipe = (dataclasses.replace(k.recipe, precision="bf16-mixed", autocast_cache=False)
                  if fsdp2 else k.recipe)  # autocast over fp32 shards (no param_dtype), no copies
        return estimate("llama-2-13b", 1, 4096, recipe=recipe, layout=k.layout).total / GiB_
    best, fsdp2_fused = p.fits[0], zero3("adamw-fused", True)
    assert best.recipe.optimizer_impl in (None, "foreach"), best.label()
    return {"answer": n, "params": params, "states": 16 * params / GiB_, "bound": bound,
            "states18": 18 * params / bound / GiB_,     # labkit's ZeRO-3: fp32 gradient shards
            "usable": p.usable / GiB_, "z3": zero3("adamw"), "z3_fused": zero3("adamw-fused"),
            "z3_fsdp2": zero3("adamw", True), "z3_fsdp2_fused": fsdp2_fused,
            "best": best.label(), "total": best.estimate.total / GiB_,
            "margin": best.estimate.total / p.usable,
            "fused_margin": fsdp2_fused * GiB_ / p.usable}


@register(
    "09-no-p2p-link",
    question="""The RTX 4090 has no peer-to-peer transfers: two of them talk through host
memory, below the 32 GB/s the planner assumes (measure yours with nccl-tests:
all_reduce_perf's busbw for tp's traffic, sendrecv_perf's for pp's). Plan DeepSeek-V2-Lite at
2048 tokens on two RTX 4090s (full fine-tuning, LoRA and QLoRA allowed): below what
GPU-to-GPU bandwidth, per direction, is the fastest tp 2 layout's modelled step slower than the
fastest layout without tp?""",
    unit="GB/s", rtol=0.05,
    hint="dataclasses.replace(labkit.core.gpus.GPUS['rtx-4090-24gb'], intra_node_gbps=g) is a "
         "GPU of your own; pass it to plan(..., top=None) and compare the smallest "
         ".time.dp_overlapped of the fits with layout.tp == 2 and of the others. Bisect g "
         "between 1 and 32 GB/s.",
    solution="""the modelled times cross at {answer:.1f} GB/s per direction: that is the
number to compare with your measured busbw. At {high:g} GB/s the first layout is "{best_high}",
{t_high:.2f} s a step; at {low:g} GB/s it is "{best_low}", {t_low:.2f} s, and tp 2 takes
{tp_low:.2f} s. The planner's first place flips a little higher ({flip:.1f} GB/s), because within
2% it breaks the tie by the smaller peak ({peak_low:.1f} GiB against tp 2's {peak_tp:.1f} GiB).
Below the crossover, pp's few hops of activations per micro-batch (one per model chunk) cost less
than tp's all-reduces in every layer.""",
)
def _no_p2p_link():
    import dataclasses

    from labkit.core.gpus import GPUS
    from labkit.course.plan import plan

    def fits(gbps, top=1):
        gpu = dataclasses.replace(GPUS["rtx-4090-24gb"], intra_node_gbps=gbps)
        return plan("deepseek-v2-lite", gpu, 2, seq=2048, trainable=("all", "lora", "qlora"),
                    top=top, advice=False).fits

    def gap(gbps):                         # fastest tp 2 layout's time less the fastest other's
        every = fits(gbps, top=None)
        return (min(k.time.dp_overlapped for k in every if k.layout.tp == 2)
                - min(k.time.dp_overlapped for k in every if k.layout.tp != 2))

    def bisect(tp_first):                  # the bandwidth where tp_first(g) turns true
        lo, hi = 1.0, 32.0
        while hi - lo > 0.05:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if tp_first(mid) else (mid, hi)
        return lo, hi
    lo, hi = bisect(lambda g: fits(g)[0].layout.tp == 2)
    cross = sum(bisect(lambda g: gap(g) < 0)) / 2
    high, low = fits(8)[0], fits(6, top=None)
    tp_low = next(k for k in low if k.layout.tp == 2)
    below = fits(lo, top=None)
    tp_below = next(k for k in below if k.layout.tp == 2)
    GiB_ = 2**30
    return {"answer": cross, "flip": hi, "high": 8, "low": 6, "best_high": high.label(),
            "t_high": high.time.dp_overlapped, "best_low": low[0].label(),
            "t_low": low[0].time.dp_overlapped, "tp_low": tp_low.time.dp_overlapped,
            "cross": cross, "peak_low": below[0].estimate.total / GiB_,
            "peak_tp": tp_below.estimate.total / GiB_}
