"""Lab 02's exercises: mixed precision."""
from __future__ import annotations

from labkit.course.exercises.core import GiB, register
from labkit.predict.layers import count_params


@register(
    "02-fp16-largest",
    question="What is the largest finite number fp16 can hold?",
    unit="(a plain number)", rtol=0,
    hint="fp16 has 5 exponent bits (largest exponent 15) and 10 mantissa bits: "
         "(2 - 2^-10) x 2^15. torch.finfo(torch.float16).max agrees.",
    solution="""(2 - 2^-10) x 2^15 = {answer:,.0f} = torch.finfo(torch.float16).max.
A gradient or activation above it becomes inf: one reason bf16 (largest {bf16:.3g}) is easier.""",
)
def _fp16_largest():
    import torch
    return {"answer": torch.finfo(torch.float16).max, "bf16": torch.finfo(torch.bfloat16).max}


@register(
    "02-autocast-weight-copies",
    question="""Under torch.autocast (bf16) with fp32 weights, every matmul weight is cast to
bf16 once per forward pass, and the copy is kept for the backward pass. For LLaMA-2-7B, how
much memory do those copies take?""",
    unit="GiB",
    hint="Every weight except the RMSNorm gains (and the embedding table, which is looked up, "
         "not multiplied) is a matmul weight; each copy is 2 bytes per element.",
    solution="""matmul weights: {matmul:,} of the {total:,} parameters (all but the embedding
table and the norm gains). x 2 bytes = {bytes:,} bytes = {answer:.2f} GiB, alive from the
forward pass until each layer's backward: the autocast weight cache, which pure-bf16 and
master-weight training do not have (lk.estimate(..., precision="bf16-mixed").saved_weight_cache).""",
)
def _autocast_copies():
    pc = count_params("llama-2-7b")
    matmul = pc.total - pc.by_component["norms"] - pc.by_component["embedding"]
    return {"answer": 2 * matmul / GiB, "matmul": matmul, "total": pc.total, "bytes": 2 * matmul}


@register(
    "02-fp8-block-bytes",
    question="""DeepSeek-V3 stores a 7168 x 7168 weight in FP8 (1 byte per number) with one fp32
scale per 128 x 128 block. How many bytes is that, scales included?""",
    unit="bytes", rtol=0,
    hint="7168 / 128 = 56 blocks per side; each block has one 4-byte scale.",
    solution="""data: 7168 x 7168 x 1 = {data:,} bytes; scales: (7168/128)^2 = {blocks:,} blocks x 4
bytes = {scales:,} bytes; total {answer:,} bytes — the scales add {overhead:.3f}%.
In bf16 the same weight takes {bf16:,} bytes.""",
)
def _fp8_block_bytes():
    n, block = 7168, 128
    data, blocks = n * n, (n // block) ** 2
    return {"answer": data + 4 * blocks, "data": data, "blocks": blocks, "scales": 4 * blocks,
            "overhead": 100 * 4 * blocks / data, "bf16": 2 * data}


@register(
    "02-mixed-saves-a-quarter",
    question="""LLaMA-2-7B on one GPU (lk.estimate with device="cuda"), sequences of 4096 tokens (its
max_seq): from how many tokens per step (batch x 4096) on does autocast (precision="bf16-mixed")
bring the peak 25% below fp32's? Search over the batch with the estimate.""",
    unit="tokens per step", rtol=0.02,
    hint="Compare lk.estimate(..., batch=b, seq=4096, precision='bf16-mixed').total with "
         "precision='fp32' for b = 1, 2, 4, ... (the saving grows with the tokens once the "
         "backward pass sets the peak), then search between the last two.",
    solution="""The smallest batch with 100 x peak <= 75 x fp32's peak (labkit.predict.sweep.first, a
bisection over lk.estimate) is {batch}: {answer:,} tokens per step, peak {peak} against {fp32} in
fp32, the peak at "{moment}" (batch {below}: {below_saved:.1f}% saved). No single GPU holds that
peak, and {activations} of it are activations: autocast saves a quarter only at token counts per
GPU that need context or sequence parallelism to fit; ZeRO shards the states, not these
activations. At batch 1 it saves {one_saved:.1f}%: the optimizer step, where its states are
fp32's, sets the peak.""",
)
def _mixed_saves_a_quarter():
    from labkit.predict import estimate
    from labkit.predict.sweep import first, saving
    from labkit.core.units import fmt_bytes

    def autocast(batch):
        return saving("llama-2-7b", batch, 4096, {"precision": "bf16-mixed"}, {"precision": "fp32"})
    batch = first(lambda b: autocast(b).saves(25), 0, 64)
    s, below = autocast(batch), autocast(batch - 1)
    return {"answer": batch * 4096, "batch": batch, "peak": fmt_bytes(s.peak),
            "fp32": fmt_bytes(s.baseline_peak), "moment": s.moment, "below": batch - 1,
            "below_saved": 100 * below.saved, "one_saved": 100 * autocast(1).saved,
            "activations": fmt_bytes(estimate("llama-2-7b", batch, 4096, precision="bf16-mixed")
                                     .saved_activations)}


@register(
    "02-half-inference-saving",
    question="""Predict, then measure: the course model `small` after model.half(), one forward
pass under torch.no_grad() that returns the logits, batch 2 x 256 tokens. What percentage of
the fp32 peak does it save? Measure with labkit.quantisation.precision.inference_peak
(half=True / False).""",
    unit="percent",
    hint="Which tensors of the forward pass are not in the weights' dtype after model.half()? "
         "Without the loss, hardly any: the logits are fp16 too.",
    solution="""fp32 peak {fp32} (weights {w32}), fp16 peak {fp16} (weights {w16}): {answer:.2f}%
saved. Everything the pass keeps at its peak, weights and logits, halves; a loss over fp32 logits
would not (section 7, claim 5).""",
)
def _half_inference_saving():
    from labkit.quantisation.precision import inference_peak
    from labkit.core.units import fmt_bytes
    fp32, half = (inference_peak("small", 2, 256, half=h) for h in (False, True))
    return {"answer": 100 * (1 - half.peak / fp32.peak), "fp32": fmt_bytes(fp32.peak),
            "fp16": fmt_bytes(half.peak), "w32": fmt_bytes(fp32.weights),
            "w16": fmt_bytes(half.weights)}


@register(
    "02-fsdp-autocast-cache-gib",
    question="""One rank of FSDP2 over 8 GPUs trains LLaMA-2-7B (fp32 shards, no
MixedPrecisionPolicy) under torch.autocast(bf16) with full recompute. FSDP2 frees each block's
gathered fp32 weights after its forward. How many GiB of autocast's bf16 copies (the LM head's
included) does the rank hold at the end of the forward pass?""",
    unit="GiB", rtol=0.002,
    hint="The cache keeps the bf16 cast of every fp32 leaf it casts until autocast exits, and "
         "FSDP2 gathers each weight whole before its layer runs. lk.count_params('llama-2-7b')"
         ".by_component names the embedding table and the norms, which no matmul casts.",
    solution="""Every matmul weight's whole bf16 copy: {matmul:,} weights x 2 B = {answer:.2f} GiB,
not an eighth of it. FSDP2 frees the gathered fp32 weights, but the cache holds the casts made
from them until the forward pass leaves autocast. fake_fsdp2_peak on one rank of 8 measures
{measured:.2f} GiB of weight_cache at its peak, in the forward pass ({rank_peak:.2f} GiB in all);
cache_enabled=False or MixedPrecisionPolicy(param_dtype=torch.bfloat16) removes it.""",
)
def _fsdp_autocast_cache():
    from labkit.parallel.data.fsdp import fake_fsdp2_peak
    pc = count_params("llama-2-7b")
    matmul = pc.total - pc.by_component["norms"] - pc.by_component["embedding"]
    rank = fake_fsdp2_peak("llama-2-7b", 8, 1, 4096, precision="bf16-mixed", recompute="full")
    return {"answer": 2 * matmul / GiB, "matmul": matmul,
            "measured": rank["by_category"]["weight_cache"] / GiB, "rank_peak": rank["peak"] / GiB}
