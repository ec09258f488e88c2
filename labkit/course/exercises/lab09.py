"""Lab 09's exercises: the planner."""
from __future__ import annotations

from labkit.course.exercises.core import register
from labkit.predict.layers import count_params


@register(
    "09-fewest-a100s-7b",
    question="""Full fine-tuning of LLaMA-2-7B (bf16 weights and gradients, fp32 master weights
and AdamW state), sequences of 4096 tokens, one sequence per GPU per step, no offload: on how
few A100-80GB GPUs (1, 2, 4, 8, ...) does the planner find a layout that fits its usable
memory (the card less 10% headroom)?""",
    unit="GPUs", rtol=0,
    hint="First the paper bound: the states take 16 bytes per parameter, and ZeRO or tensor "
         "parallelism splits them; then ask labkit.course.plan.plan(..., offload=False) whether "
         "that many GPUs also hold the activations.",
    solution="""the model states alone are 16 B x {params:,} = {states:.1f} GiB, more than the
{usable:.1f} GiB one card may use, so at least two GPUs are needed. On {answer} GPUs the
fastest layout that fits is "{best}" at {total:.1f} GiB per GPU
(labkit.course.plan.plan(..., offload=False)).""",
)
def _fewest_a100s_7b():
    from labkit.course.plan import plan
    GiB_, n = 2**30, 1
    while not (p := plan("llama-2-7b", "a100-80gb", n, seq=4096, offload=False, top=1)).fits:
        n *= 2
    params = count_params("llama-2-7b").total
    best = p.fits[0]
    return {"answer": n, "params": params, "states": 16 * params / GiB_,
            "usable": p.usable / GiB_, "best": best.label(), "total": best.estimate.total / GiB_}


@register(
    "09-least-host-memory-one-4090",
    question="""On one RTX 4090, DeepSeek-V2-Lite at 2048 tokens fits only with part of the
step in host memory. With full fine-tuning, LoRA and QLoRA all allowed, what is the least host
memory per node, in GiB and a power of 2 (16, 32, 64, ...), with which the planner finds a
layout that fits?""",
    unit="GiB", rtol=0,
    hint="plan('deepseek-v2-lite', 'rtx-4090-24gb', 1, seq=2048, trainable=('all', 'lora', "
         "'qlora'), host_ram=n * 2**30) for n = 16, 32, 64, ...; a plan's .fits is empty when "
         "nothing fits. The planner keeps 80% of the host memory for pinned states.",
    solution="""with {answer} GiB of host memory the planner's first layout is "{best}":
{gpu:.2f} GiB per GPU and {host:.2f} GiB of pinned host memory, within 80% of {answer} GiB
({usable:.1f} GiB). With {less} GiB that layout is rejected: {why}.""",
)
def _least_host_memory_one_4090():
    from labkit.course.plan import plan
    GiB_, n, before = 2**30, 16, None
    while not (p := plan("deepseek-v2-lite", "rtx-4090-24gb", 1, seq=2048,
                         trainable=("all", "lora", "qlora"), host_ram=n * GiB_, top=1,
                         advice=False)).fits:
        n, before = 2 * n, p
    best = p.fits[0]
    why = before.rejected[best.family.label()] if before else "(it fits from 16 GiB)"
    return {"answer": n, "best": best.label(), "gpu": best.estimate.total / GiB_,
            "host": best.estimate.details.get("host memory", 0) / GiB_, "usable": 0.8 * n,
            "less": n // 2, "why": why}
