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
    "09-no-p2p-link",
    question="""The RTX 4090 has no peer-to-peer transfers: two of them talk through host
memory, far below the 32 GB/s the planner assumes. Plan DeepSeek-V2-Lite at 2048 tokens on two
RTX 4090s (full fine-tuning, LoRA and QLoRA allowed) with their link at 8 GB/s per direction:
what is the modelled step time of the first layout, in seconds?""",
    unit="s", rtol=0.01,
    hint="dataclasses.replace(labkit.core.gpus.GPUS['rtx-4090-24gb'], intra_node_gbps=8) is a "
         "GPU of your own; pass it to plan(...) and read .fits[0].time.dp_overlapped.",
    solution="""at 8 GB/s the first layout is still "{best}", {answer:.2f} s a step (at 32 GB/s
{fast:.2f} s), but only {lead:.0%} ahead of "{second}" ({second_time:.2f} s); FSDP's layouts,
which gather the frozen base every pass, go from {fsdp_fast:.2f} s to {fsdp:.2f} s.""",
)
def _no_p2p_link():
    import dataclasses

    from labkit.core.gpus import GPUS
    from labkit.course.plan import plan

    def firsts(gbps):
        gpu = dataclasses.replace(GPUS["rtx-4090-24gb"], intra_node_gbps=gbps)
        p = plan("deepseek-v2-lite", gpu, 2, seq=2048, trainable=("all", "lora", "qlora"),
                 top=None, advice=False)
        out = {}
        for k in p.fits:                           # each family's fastest, fastest first
            out.setdefault(k.family.label(), k)
        return list(out.values())
    slow, fast = firsts(8), firsts(32)
    fsdp = lambda ks: next(k for k in ks if "sharded" in k.label()).time.dp_overlapped
    return {"answer": slow[0].time.dp_overlapped, "best": slow[0].label(),
            "fast": fast[0].time.dp_overlapped, "second": slow[1].label(),
            "second_time": slow[1].time.dp_overlapped,
            "lead": slow[1].time.dp_overlapped / slow[0].time.dp_overlapped - 1,
            "fsdp_fast": fsdp(fast), "fsdp": fsdp(slow)}
