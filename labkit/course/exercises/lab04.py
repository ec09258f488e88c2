"""Lab 04's exercises: data parallelism, ZeRO and FSDP."""
from __future__ import annotations

from labkit.course.exercises.core import GiB, register
from labkit.predict.layers import count_params
from labkit.predict.papers import model_state_bytes


@register(
    "04-zero2-bytes-per-parameter",
    question="""The ZeRO paper's mixed-precision AdamW keeps, per parameter, a bf16 weight and
gradient, an fp32 master weight and two fp32 moments. With ZeRO stage 2 over 8 GPUs, how many
bytes per parameter of model states does each GPU hold?""",
    unit="bytes per parameter",
    hint="Stage 2 shards the optimizer state (master and moments: 12 bytes) and the gradients "
         "(2 bytes); the weights stay whole.",
    solution="""Weights 2 + (gradients 2 + optimizer state 12) / 8 = {answer:g} bytes per parameter
(lk.model_state_bytes(n, "bf16-master", "adamw", zero_stage=2, dp=8) / n), against 16 without
ZeRO: {saving:.0f}% less. Stage 3 would hold 16 / 8 = 2.""",
)
def _zero2_bytes_per_parameter():
    n = 8 * 10**6                                        # any count that 8 divides
    answer = model_state_bytes(n, "bf16-master", "adamw", zero_stage=2, dp=8) / n
    return {"answer": answer, "saving": 100 * (1 - answer / 16)}


@register(
    "04-bucket-view-saves",
    question="""LLaMA-2-13B trains in fp32 with AdamW under DDP over 8 GPUs, 1 x 16 tokens per GPU
(CUDA defaults). How many GiB per GPU does `gradient_as_bucket_view=True` save at the peak?""",
    unit="GiB",
    hint="DDP's buckets hold a flat copy of every gradient for the whole run; with bucket views "
         "the .grad tensors are views of them instead of a second copy. Compare "
         "lk.estimate(..., layout=lk.Layout(dp=8, gradient_as_bucket_view=...)).",
    solution="""{answer:.2f} GiB: one fp32 copy of the gradients, 4 x {n:,} bytes. Peak per GPU
{off:.2f} GiB with DDP's default, {on:.2f} GiB with bucket views, both during {phase}:
.grad is still alive there, so the saving is whole.""",
)
def _bucket_view_saves():
    from labkit.predict import estimate
    from labkit.core.recipe import Layout
    step = dict(batch=1, seq=16, precision="fp32")
    off, on = (estimate("llama-2-13b", **step, layout=Layout(dp=8, gradient_as_bucket_view=v))
               for v in (False, True))
    assert off.peak_phase == on.peak_phase == "optimizer", (off.peak_phase, on.peak_phase)
    return {"answer": (off.total - on.total) / GiB, "n": count_params("llama-2-13b").total,
            "off": off.total / GiB, "on": on.total / GiB, "phase": "the optimizer step"}


@register(
    "04-zero3-bytes-sent",
    question="""LLaMA-2-7B trains with the ZeRO paper's mixed precision (bf16 weights and
gradients on the wire) under ZeRO-3 over 64 GPUs, with ring collectives (each rank sends
(N - 1)/N of each buffer). How many GiB does one GPU send per step?""",
    unit="GiB",
    hint="Stage 3 all-gathers the weights before each layer's forward and again before its "
         "backward, and reduce-scatters the gradients: 3Ψ numbers in the paper. A ring sends "
         "(N - 1)/N of each buffer from every rank.",
    solution="""3 x (63/64) x {n:,} parameters x 2 bytes = {answer:.2f} GiB
(lk.estimate(..., layout=lk.Layout(dp=64, zero_stage=3)).details["bytes sent per step"]; the
paper rounds (N - 1)/N to 1: 3Ψ). Stages 1 and 2 send two thirds of it: {two:.2f} GiB, what
DDP's all-reduce sends.""",
)
def _zero3_bytes_sent():
    from labkit.predict import estimate
    from labkit.core.recipe import Layout
    sent = {s: estimate("llama-2-7b", 1, 2048, precision="bf16-master",
                        layout=Layout(dp=64, zero_stage=s)).details["bytes sent per step"]
            for s in (2, 3)}
    return {"answer": sent[3] / GiB, "two": sent[2] / GiB,
            "n": count_params("llama-2-7b").total}


@register(
    "04-fewest-gpus-80gib",
    question="""LLaMA-2-13B trains with mixed-precision AdamW (bf16-master), full recomputation,
1 x 4096 tokens per GPU, under ZeRO-3 (CUDA defaults). What is the fewest number of GPUs, a
power of two, at which one step's peak per GPU fits in 80 GiB?""",
    unit="GPUs", rtol=0,
    hint="Try lk.estimate('llama-2-13b', 1, 4096, precision='bf16-master', recompute='full', "
         "layout=lk.Layout(dp=N, zero_stage=3)).total for N = 1, 2, 4, ... (or the zero panel).",
    solution="""{answer} GPUs: the peak per GPU is {peak:.1f} GiB there ({before:.1f} GiB on
{fewer}), during {phase}. The paper's count of the model states is 16 x {n:,} bytes / N =
{states:.1f} GiB; what is alive at the peak differs (lk.estimate(...).explain()), largest first:
{alive}.""",
)
def _fewest_gpus_80gib():
    from labkit.predict import estimate
    from labkit.core.recipe import Layout

    def peak(dp):
        return estimate("llama-2-13b", 1, 4096, precision="bf16-master", recompute="full",
                        layout=Layout(dp=dp, zero_stage=3))
    dp = next(2**k for k in range(11) if peak(2**k).total <= 80 * GiB)
    n, e = count_params("llama-2-13b").total, peak(dp)
    alive = sorted(e.tensors, key=lambda t: -t.nbytes)[:5]
    return {"answer": dp, "peak": e.total / GiB, "phase": e.peak_phase, "fewer": dp // 2,
            "before": peak(max(1, dp // 2)).total / GiB, "n": n, "states": 16 * n / dp / GiB,
            "alive": "; ".join(f"{t.name} {t.nbytes / GiB:.1f} GiB" for t in alive)}
