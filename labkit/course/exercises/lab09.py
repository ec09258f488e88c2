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
