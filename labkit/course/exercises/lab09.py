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
    "09-v2-lite-qlora-nf4-experts",
    question="""labkit's QLoRA keeps DeepSeek-V2-Lite's routed experts in bf16. Estimate the
QLoRA step on one GPU at batch 1 x 4096 tokens with full recomputation, then swap the routed
experts' bf16 bytes for NF4's (block 64, double-quantised scales): about how many GiB per GPU?
Does it fit an RTX 4090's 21.59 GiB usable?""",
    unit="GiB", rtol=0.02,
    hint="lk.estimate(..., recipe=lk.Recipe('bf16', trainable='lora', weight_format='nf4', "
         "recompute='full')); the experts' count is lk.count_params(...).by_component['routed "
         "experts']; NF4's bits per parameter: labkit.quantisation.quant.nf4_bits_per_param().",
    solution="""labkit's QLoRA step: {bf16:.2f} GiB, of which the routed experts' {experts:,}
parameters hold {experts_bf16:.2f} GiB in bf16. In NF4 they take {bits} bits each,
{experts_nf4:.2f} GiB, so the step needs about {answer:.2f} GiB: {verdict} the {usable:.2f} GiB an
RTX 4090 may use (usable_memory(GPUS["rtx-4090-24gb"]); section 2 did this at 2048 tokens).""",
)
def _v2_lite_qlora_nf4_experts():
    from labkit.core.gpus import GPUS, usable_memory
    from labkit.core.recipe import Recipe
    from labkit.predict import estimate
    from labkit.quantisation.quant import nf4_bits_per_param
    GiB_ = 2**30
    e = estimate("deepseek-v2-lite", 1, 4096, recipe=Recipe("bf16", trainable="lora",
                                                             weight_format="nf4",
                                                             recompute="full"))
    experts = count_params("deepseek-v2-lite").by_component["routed experts"]
    nf4 = round(experts * nf4_bits_per_param() / 8)
    answer = (e.total - 2 * experts + nf4) / GiB_
    usable = usable_memory(GPUS["rtx-4090-24gb"]) / GiB_
    return {"answer": answer, "usable": usable, "bf16": e.total / GiB_, "experts": experts,
            "experts_bf16": 2 * experts / GiB_, "bits": nf4_bits_per_param(),
            "experts_nf4": nf4 / GiB_, "verdict": "under" if answer < usable else "over"}
