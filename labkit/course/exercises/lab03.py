"""Lab 03's exercises: activations."""
from __future__ import annotations

import functools

from labkit.core.config import preset
from labkit.course.exercises.core import GiB, register
from labkit.predict.layers import count_params


@register(
    "03-full-recompute-kept",
    question="""With full recomputation, each layer of LLaMA-2-7B keeps only its input for the
backward pass. How much is that per layer for one sequence of 4096 tokens in bf16?""",
    unit="MiB",
    hint="The input of a block is the hidden state: tokens x hidden numbers, 2 bytes each.",
    solution="""4096 tokens x {h} hidden x 2 bytes = {bytes:,} bytes = {answer:.0f} MiB per layer;
x {layers} layers = {total:.0f} MiB, against {none:.1f} GiB of saved activations without
recomputation (lk.estimate(..., recompute="full")).""",
)
def _full_recompute_kept():
    from labkit.predict import estimate
    c = preset("llama-2-7b")
    per_layer = 4096 * c.hidden * 2
    none = estimate(c, seq=4096, precision="bf16").saved_activations
    return {"answer": per_layer / 2**20, "h": c.hidden, "bytes": per_layer, "layers": c.layers,
            "total": c.layers * per_layer / 2**20, "none": none / GiB}


@register(
    "03-padding-waste",
    question="""Four documents of 100, 300, 50 and 550 tokens are padded to 600 tokens each.
What percentage of the positions are padding?""",
    unit="percent",
    hint="Positions: 4 x 600. Real tokens: the sum of the lengths. Padding is the rest.",
    solution="""positions 4 x 600 = 2400; real tokens {real}; padding {pad} = {answer:.1f}%
(labkit.training.batching.pad_batches(docs, 4, pad_to=600).waste).""",
)
def _padding_waste():
    from labkit.training.batching import make_documents, pad_batches
    docs = make_documents([100, 300, 50, 550])
    b = pad_batches(docs, 4, pad_to=600)
    return {"answer": 100 * b.waste, "real": b.tokens, "pad": b.padding}


@register(
    "03-accumulation-optimizer",
    question="""The course model `small` trains in fp32 with AdamW and 8 gradient-accumulation
steps. How much memory does the optimizer state take?""",
    unit="MiB",
    hint="AdamW keeps two fp32 moments per parameter (plus one step counter per tensor); the "
         "number of accumulation steps does not enter. lk.count_params('small').",
    solution="""{n:,} parameters x 8 bytes + {tensors} step counters x 4 bytes = {bytes:,} bytes
= {answer:.2f} MiB, for 1 accumulation step or 8 (lk.estimate("small", precision="fp32").optimizer).""",
)
def _accumulation_optimizer():
    from labkit.predict import estimate
    n = count_params("small").total
    total = estimate("small", precision="fp32").optimizer
    return {"answer": total / 2**20, "n": n, "tensors": (total - 8 * n) // 4, "bytes": total}


@register(
    "03-peak-leaves-optimizer-with-selective",
    question="""LLaMA-2-7B trains one sequence per step in bf16-mixed with AdamW on one GPU, CUDA
defaults. Without recomputation the optimizer step stops being the peak at a few thousand
tokens (exercise 01-peak-moves-to-backward). With selective recomputation
(recompute="selective"), from which sequence length on is the peak no longer the optimizer
step? Explore lk.estimate(...).peak_phase and .moments.""",
    unit="tokens", rtol=0.02,
    hint="Bisect between 4096 and 32768 tokens on est.peak_phase != 'optimizer'; "
         "est.details['peak moment'] names the moment that takes over.",
    solution="""From {answer:,} tokens the moment "{moment}" ({at} GiB) passes the optimizer step
({optimizer} GiB), {ratio:.1f}x the {none:,} tokens without recomputation. Selective
recomputation drops the layers' norms and elementwise outputs, so the backward pass no longer
takes over first: the forward pass at the loss does, where the (tokens x 32000) fp32 logits
and their log-softmax sit beside everything the layers keep.""",
)
def _peak_leaves_optimizer_with_selective():
    from labkit.predict import estimate
    from labkit.predict.sweep import peak_leaves_optimizer
    seq, none = (peak_leaves_optimizer("llama-2-7b", precision="bf16-mixed", recompute=r)
                 for r in ("selective", "none"))
    est = estimate("llama-2-7b", batch=1, seq=seq, precision="bf16-mixed", device="cuda",
                   recompute="selective")
    moment = est.details["peak moment"]
    return {"answer": seq, "none": none, "ratio": seq / none, "moment": moment,
            "at": f"{est.moments[moment] / GiB:.3f}",
            "optimizer": f"{est.moments['optimizer step'] / GiB:.3f}"}


FIT = dict(batch=1, seq=4096, precision="bf16-master", zero_stage=3, dp=16, device="cuda")


@functools.cache
def _every_k_fit() -> dict:
    from labkit.transformer.checkpointing import recompute_cost
    from labkit.predict import estimate
    total = {k: estimate("llama-2-7b", recompute=f"every-{k}", **FIT).total for k in range(1, 33)}
    k = max(k for k, t in total.items() if t <= 24 * GiB)
    cost = {p: 100 * recompute_cost("llama-2-7b", p, seq=4096).extra
            for p in (f"every-{k}", "full")}
    return {"answer": k, "next": k + 1, "fits": f"{total[k] / GiB:.1f}",
            "over": f"{total[k + 1] / GiB:.1f}",
            "none": f"{estimate('llama-2-7b', **FIT).total / GiB:.1f}",
            "extra": f"{cost[f'every-{k}']:.1f}", "full_extra": f"{cost['full']:.1f}",
            "full": f"{total[1] / GiB:.1f}",
            "gathered": f"{2 * _layer_params('llama-2-7b') / GiB:.2f}",
            "prefetched": f"{(total[k] + 2 * _layer_params('llama-2-7b')) / GiB:.2f}"}


def _layer_params(name: str) -> int:
    """Parameters of one dense block of a preset (what ZeRO-3 gathers for it)."""
    from labkit.predict.layers import block_weights
    return sum(w.numel for w in block_weights(preset(name), False))


@register(
    "03-cheapest-recompute-fits-24gib",
    question="""LLaMA-2-7B trains with bf16 weights and fp32 master weights (precision
"bf16-master"), ZeRO-3 over 16 GPUs of 24 GiB, one sequence of 4096 tokens per GPU, CUDA
defaults. Without recomputation it does not fit. The policy every-k recomputes one block in k:
the larger k, the fewer extra FLOPs. What is the largest k with which it fits in 24 GiB?""",
    unit="blocks", rtol=0,
    hint="lk.estimate('llama-2-7b', batch=1, seq=4096, precision='bf16-master', zero_stage=3, "
         "dp=16, recompute='every-3', device='cuda').total, for k = 1, 2, 3, ...",
    solution="""k = {answer}: every-{answer} peaks at {fits} GiB, every-{next} at {over} GiB, no
recomputation at {none} GiB. It costs +{extra}% FLOPs (checkpointing.recompute_cost) where full
recomputation (k = 1, {full} GiB) costs +{full_extra}%: the model states and the blocks that
keep everything share the 24 GiB, and each recomputed block frees one layer's activations.
The estimate holds the weights ZeRO-3 gathers (the embedding, final norm and LM head, and one
block at a time: {gathered} GiB per block in bf16; lab 04 measures them); an implementation that
prefetches the next block holds one more: {prefetched} GiB at every-{answer}'s peak, no margin.""",
)
def _cheapest_fit():
    return _every_k_fit()


@register(
    "03-varlen-saving",
    question="""Predict, then measure. One packed row of 512 tokens (several documents) runs
through the course model `tiny` in fp32: once isolating the documents with the dense additive
mask, once with variable-length attention (varlen=True). How much less activation memory does
the varlen run keep at the end of the forward pass? (labkit's CPU varlen stand-in keeps no
log-sum-exp, which flash-attn's varlen kernel keeps: which part of the saving would a GPU see?)""",
    unit="KiB",
    hint="The dense mask is one fp32 (B, 1, T, T) tensor shared by every layer; labkit's CPU "
         "varlen attention also keeps no log-sum-exp (B, heads, T) fp32 per layer: its backward "
         "runs each document's attention again (flash-attn's varlen kernel keeps it).",
    solution="""Measured {answer:,.0f} KiB (batching.packed_step_memory): the fp32 mask, 4 x 512 x
512 = {mask:,} bytes, plus {layers} layers x the log-sum-exp of {heads} heads x 512 tokens x 4
bytes = {lse:,} bytes (sum equal to the measurement: {equal}). The step's peak falls by {peak:,}
bytes. On a GPU, flash-attn's varlen kernel keeps its log-sum-exp: there varlen saves the mask.""",
)
@functools.cache
def _varlen_saving():
    import torch
    from labkit.training.batching import (document_lengths, make_documents, pack_batches,
                                          packed_step_memory)
    from labkit.transformer.model import build_model
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = build_model(cfg)
    docs = make_documents(document_lengths(6, max_len=120, median=80, seed=0))
    batch = pack_batches(docs, 512).batches[0]
    mem = {a: packed_step_memory(model, batch, a) for a in ("mask", "varlen")}
    saved = mem["mask"].kept - mem["varlen"].kept
    mask, lse = 4 * 512 * 512, cfg.layers * cfg.heads * 512 * 4
    return {"answer": saved / 1024, "peak": mem["mask"].peak - mem["varlen"].peak,
            "mask": mask, "layers": cfg.layers, "heads": cfg.heads, "lse": lse,
            "equal": saved == mask + lse}
