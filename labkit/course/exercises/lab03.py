"""Lab 03's exercises: activations."""
from __future__ import annotations

import functools

from labkit.core.config import preset
from labkit.course.exercises.core import GiB, register


@register(
    "03-full-recompute-kept",
    question="""LLaMA-2-7B trains in bf16-mixed (fp32 weights, bf16 autocast) with full
recomputation: each layer keeps only its input for the backward pass. How much is that per layer
for one sequence of 4096 tokens? Predict it, then check it with lk.estimate: the saved activations
of the same model with one layer more, less the model's own.""",
    unit="MiB",
    hint="The input of a block is the residual stream: tokens x hidden numbers. Which dtype is it "
         "under autocast? The matmuls run in bf16, but the residual x = x + block(x) adds a bf16 "
         "output to an fp32 tensor. To check: lk.estimate(cfg.replace(layers=33), batch=1, seq=4096, "
         "precision='bf16-mixed', recompute='full').saved_activations minus the same for cfg, with "
         "cfg = lk.preset('llama-2-7b').",
    solution="""4096 tokens x {h} hidden x 4 bytes = {bytes:,} bytes = {answer:.0f} MiB per layer.
Under bf16-mixed the residual stream stays fp32: the embedding's weights are fp32, and adding a
block's bf16 output to an fp32 tensor gives fp32. Hence twice the {bf16:.0f} MiB of pure bf16.
lk.estimate keeps {measured:.0f} MiB more with one layer more (equal: {equal}). x {layers} layers =
{total:.2f} GiB of the {full:.2f} GiB saved under full recomputation; the rest ({rest:.2f} GiB) is
kept outside the checkpointed blocks: the final norm, the LM head's input and the loss's fp32
log-softmax. Without recomputation: {none:.2f} GiB.""",
)
def _full_recompute_kept():
    from labkit.predict import estimate
    c = preset("llama-2-7b")
    per_layer = 4096 * c.hidden * 4                       # the fp32 residual stream

    def saved(cfg, recompute="full"):
        return estimate(cfg, batch=1, seq=4096, precision="bf16-mixed",
                        recompute=recompute).saved_activations

    full, one_more = saved(c), saved(c.replace(layers=c.layers + 1))
    return {"answer": per_layer / 2**20, "h": c.hidden, "bytes": per_layer, "layers": c.layers,
            "bf16": per_layer / 2 / 2**20, "measured": (one_more - full) / 2**20,
            "equal": one_more - full == per_layer, "total": c.layers * per_layer / GiB,
            "full": full / GiB, "rest": (full - c.layers * per_layer) / GiB,
            "none": saved(c, "none") / GiB}


BUCKET_CORPUS = dict(n=1000, max_len=4096, median=512, seed=3)   # the corpus of 03-padding-waste
BUCKET_LIMIT = 0.05                 # the most padding allowed, a share of the positions


def _bucket_waste(lengths: list[int], b: int) -> float:
    """Share of positions that are padding when sorted lengths go b a batch, each padded to its
    longest (what batching.bucket_batches does, from the lengths alone)."""
    ordered = sorted(lengths)
    positions = sum(len(g) * g[-1] for g in (ordered[i:i + b] for i in range(0, len(ordered), b)))
    return 1 - sum(ordered) / positions


@register(
    "03-padding-waste",
    question="""Your corpus: batching.document_lengths(1000, max_len=4096, median=512, seed=3)
(from labkit.training import batching). You batch it in length buckets: sorted by length, b
documents a batch, each batch padded to its longest document. A larger b takes fewer steps but
pads more. You allow at most 5% of the positions to be padding: what is the largest b you can
use?""",
    unit="documents per batch", rtol=0,
    hint="Section 6 batches documents in length buckets (batching.bucket_batches, on "
         "batching.make_documents(lengths)); the Batching it returns counts real tokens and "
         "padding. Try b = 8, 16 and 32, then narrow down: the padding does not grow strictly "
         "with b.",
    solution="""b = {answer}: {waste:.2f}% of the positions are padding, in {steps} steps
(batching.bucket_batches(docs, {answer}).waste); b = {next} pads {over:.2f}%, and every larger b,
up to the whole corpus in one batch, pads 5% or more. A larger batch spans a wider range of
sorted lengths, so its shorter documents pad more; the growth is not strict, as where the
batches start moves with b. The same {answer} documents a batch in the order given
(batching.pad_batches(docs, {answer})) pad {unsorted:.1f}%: most padding comes from mixing
short and long documents, not from the batch size.""",
)
def _padding_waste():
    from labkit.training.batching import (bucket_batches, document_lengths, make_documents,
                                          pad_batches)
    c = BUCKET_CORPUS
    lengths = document_lengths(c["n"], max_len=c["max_len"], median=c["median"], seed=c["seed"])
    under = [b for b in range(1, len(lengths) + 1) if _bucket_waste(lengths, b) < BUCKET_LIMIT]
    b = max(under)
    docs = make_documents(lengths)
    best, nxt = bucket_batches(docs, b), bucket_batches(docs, b + 1)
    assert abs(best.waste - _bucket_waste(lengths, b)) < 1e-12   # labkit's batcher agrees
    return {"answer": b, "waste": 100 * best.waste, "steps": best.steps, "next": b + 1,
            "over": 100 * nxt.waste, "unsorted": 100 * pad_batches(docs, b).waste}


H100 = "h100-80gb"
ACCUMULATE = dict(seq=4096, precision="bf16-master", device="cuda")


@register(
    "03-accumulation-fits-h100",
    question="""LLaMA-2-7B trains with bf16 weights and fp32 master weights (precision
"bf16-master"), AdamW, ZeRO-3 over 8 GPUs, no recomputation, CUDA defaults. Each GPU must
see 16 sequences of 4096 tokens per optimizer step, as m micro-batches of 16 / m sequences
(m = 1, 2, 4, 8 or 16 gradient-accumulation steps). What is the smallest m whose estimated peak
fits an 80 GB H100 (labkit.core.gpus.usable_memory(gpu("h100-80gb")): 90% of its memory)?""",
    unit="accumulation steps", rtol=0,
    hint="lk.estimate('llama-2-7b', batch=16 // m, seq=4096, precision='bf16-master', "
         "layout=lk.Layout(dp=8, zero_stage=3, micro_batches=m)).total for each m; compare "
         ".optimizer across m too.",
    solution="""m = {answer}: micro-batches of {micro} sequences peak at {fits} GiB, under the
H100's {usable} GiB usable; m = {prev} peaks at {over} GiB. The optimizer state is {opt} GiB
per GPU whatever m (.optimizer equal for all five: {same}): it belongs to the parameters, and
one optimizer step follows all the micro-batches. What accumulation changes is the
activations, which follow the micro-batch; in exchange the gradients formed by the earlier
micro-batches stay alive through the later ones (one step of {micro} sequences without
accumulation: {alone} GiB).""",
)
def _accumulation_fits_h100():
    from labkit.core.gpus import gpu, usable_memory
    from labkit.core.recipe import Layout
    from labkit.predict import estimate
    ests = {m: estimate("llama-2-7b", batch=16 // m, **ACCUMULATE,
                        layout=Layout(dp=8, zero_stage=3, micro_batches=m))
            for m in (1, 2, 4, 8, 16)}
    usable = usable_memory(gpu(H100))
    m = min(m for m, e in ests.items() if e.total <= usable)
    prev = max(k for k in ests if k < m)
    alone = estimate("llama-2-7b", batch=16 // m, **ACCUMULATE,
                     layout=Layout(dp=8, zero_stage=3)).total
    return {"answer": m, "micro": 16 // m, "prev": prev, "fits": f"{ests[m].total / GiB:.1f}",
            "over": f"{ests[prev].total / GiB:.1f}", "usable": f"{usable / GiB:.1f}",
            "opt": f"{ests[m].optimizer / GiB:.2f}",
            "same": len({e.optimizer for e in ests.values()}) == 1,
            "alone": f"{alone / GiB:.1f}"}


@register(
    "03-peak-leaves-optimizer-with-selective",
    question="""LLaMA-2-7B trains one sequence per step in bf16-mixed with AdamW on one GPU, CUDA
defaults (a 141 GB H200: this step needs more than an 80 GB H100 holds). Without
recomputation the optimizer step stops being the peak at a few thousand tokens (exercise
01-peak-moves-to-backward). With selective recomputation
(recompute="selective"), from which sequence length on is the peak no longer the optimizer
step? Explore lk.estimate(...).peak_phase and .moments.""",
    unit="tokens", rtol=0.02,
    hint="Bisect between 4096 and 32768 tokens on est.peak_phase != 'optimizer'; "
         "est.details['peak moment'] names the moment that takes over.",
    solution="""From {answer:,} tokens the moment "{moment}" ({at} GiB) passes the optimizer step
({optimizer} GiB), {ratio:.1f}x the {none:,} tokens without recomputation. Selective
recomputation drops the layers' norms and elementwise outputs, so the backward pass no longer
takes over first: the forward pass at the loss does, where the (tokens x 32000) fp32 logits
and their log-softmax sit beside everything the layers keep. The step peaks at {at} GiB:
an H200 ({h200} GiB usable, labkit.core.gpus.usable_memory), not an 80 GB H100 ({h100} GiB).
The answer is where two lines cross, so it is only as exact as the estimate's modelling details
(foreach's temporaries, the copies of the logits): the loss moment grows by {slope:.1f} MiB per
token, the optimizer step not at all, so an error of 1 GiB in either moves the answer by about
{shift:,} tokens.""",
)
def _peak_leaves_optimizer_with_selective():
    from labkit.predict import estimate
    from labkit.predict.sweep import peak_leaves_optimizer
    seq, none = (peak_leaves_optimizer("llama-2-7b", precision="bf16-mixed", recompute=r)
                 for r in ("selective", "none"))
    est = estimate("llama-2-7b", batch=1, seq=seq, precision="bf16-mixed", device="cuda",
                   recompute="selective")
    moment = est.details["peak moment"]
    later = estimate("llama-2-7b", batch=1, seq=seq + 1024, precision="bf16-mixed",
                     device="cuda", recompute="selective").moments[moment]
    slope = (later - est.moments[moment]) / 1024                      # bytes per token
    from labkit.core.gpus import gpu, usable_memory
    return {"answer": seq, "none": none, "ratio": seq / none, "moment": moment,
            "slope": slope / 2**20, "shift": int(round(GiB / slope, -1)),
            "h200": f"{usable_memory(gpu('h200-141gb')) / GiB:.1f}",
            "h100": f"{usable_memory(gpu('h100-80gb')) / GiB:.1f}",
            "at": f"{est.moments[moment] / GiB:.3f}",
            "optimizer": f"{est.moments['optimizer step'] / GiB:.3f}"}


FIT = dict(batch=1, seq=4096, precision="bf16-master", zero_stage=3, dp=16, device="cuda")
CARD = "rtx-4090-24gb"              # the 24 GB card of 03-cheapest-recompute-fits-24gib


@functools.cache
def _every_k_fit() -> dict:
    from labkit.core.gpus import gpu, usable_memory
    from labkit.transformer.checkpointing import recompute_cost
    from labkit.predict import estimate
    total = {k: estimate("llama-2-7b", recompute=f"every-{k}", **FIT).total for k in range(1, 33)}
    usable, memory = usable_memory(gpu(CARD)), gpu(CARD).memory
    k = max(k for k, t in total.items() if t <= usable)
    cost = {p: 100 * recompute_cost("llama-2-7b", p, seq=4096).extra
            for p in (f"every-{k}", "full")}
    prefetched = total[k] + 2 * _layer_params("llama-2-7b")
    whole = max(k for k, t in total.items() if t <= memory)
    return {"answer": k, "next": k + 1, "fits": f"{total[k] / GiB:.2f}",
            "over": f"{total[k + 1] / GiB:.2f}", "usable": f"{usable / GiB:.2f}",
            "memory": f"{memory / GiB:.2f}",
            "none": f"{estimate('llama-2-7b', **FIT).total / GiB:.1f}",
            "extra": f"{cost[f'every-{k}']:.1f}", "full_extra": f"{cost['full']:.1f}",
            "full": f"{total[1] / GiB:.1f}",
            "gathered": f"{2 * _layer_params('llama-2-7b') / GiB:.2f}",
            "prefetched": f"{prefetched / GiB:.2f}",
            "margin": ("still under the usable share" if prefetched <= usable
                       else "past the usable share"),
            "whole": (f"Measured against the card's whole {memory / GiB:.2f} GiB instead, "
                      f"every-{whole} would seem to fit with {(memory - total[whole]) / GiB:.2f} GiB "
                      f"to spare, which the CUDA context and NCCL's buffers can take."
                      if whole != k else "")}


def _layer_params(name: str) -> int:
    """Parameters of one dense block of a preset (what ZeRO-3 gathers for it)."""
    from labkit.predict.layers import block_weights
    return sum(w.numel for w in block_weights(preset(name), False))


@register(
    "03-cheapest-recompute-fits-24gib",
    question=f"""LLaMA-2-7B trains with bf16 weights and fp32 master weights (precision
"bf16-master"), ZeRO-3 over 16 RTX 4090s (24 GB each: labkit.core.gpus.gpu("{CARD}")), one
sequence of 4096 tokens per GPU, CUDA defaults. Without recomputation it does not fit. The policy
every-k recomputes one block in k: the larger k, the fewer extra FLOPs. What is the largest k
that fits? Use the course's rule: the estimated peak at most
labkit.core.gpus.usable_memory(gpu("{CARD}")), 90% of the card's memory (the estimate leaves
out the CUDA context, NCCL's buffers and fragmentation).""",
    unit="blocks", rtol=0,
    hint="lk.estimate('llama-2-7b', batch=1, seq=4096, precision='bf16-master', zero_stage=3, "
         "dp=16, recompute='every-3', device='cuda').total, for k = 1, 2, 3, ..., against "
         f"usable_memory(gpu('{CARD}')) (from labkit.core.gpus import gpu, usable_memory).",
    solution="""k = {answer}: every-{answer} peaks at {fits} GiB, under the card's {usable} GiB
usable (90% of {memory} GiB); every-{next} peaks at {over} GiB, no recomputation at {none} GiB.
{whole} Every-{answer} costs +{extra}% FLOPs (checkpointing.recompute_cost) where full
recomputation (k = 1, {full} GiB) costs +{full_extra}%: the model states and the blocks that
keep everything share the card, and each recomputed block frees one layer's activations.
The estimate holds the weights ZeRO-3 gathers (the embedding, final norm and LM head, and one
block at a time: {gathered} GiB per block in bf16; lab 04 measures them); an implementation that
prefetches the next block holds one more: {prefetched} GiB at every-{answer}'s peak, {margin}.""",
)
def _cheapest_fit():
    return _every_k_fit()


VARLEN_T = 8192                     # the packed row of 03-varlen-saving


@register(
    "03-varlen-saving",
    question=f"""Predict, then measure. One packed row of T = {VARLEN_T} tokens (several
documents) runs through the course model `tiny` (lk.preset("tiny", max_seq={VARLEN_T})) under
bf16 autocast: once isolating the documents with the dense additive mask, once with
variable-length attention (varlen=True). How much less activation memory does the varlen run
keep at the end of the forward pass? Section 6 measured `small` in fp32 at 2048 tokens: which
of its terms change with T, and which with autocast?""",
    unit="MiB",
    hint="The dense mask is one (1, 1, T, T) tensor in the dtype attention computes in (bf16 "
         "under autocast); labkit's CPU varlen attention also keeps no log-sum-exp, (1, heads, T) "
         "fp32 per layer. To measure, pack batching.make_documents(batching.document_lengths(30, "
         "max_len=1024, median=400, seed=0)) into rows of T (batching.pack_batches), take the "
         "first row, and run batching.packed_step_memory(model, row, a) for a = 'mask' and "
         "'varlen', each inside its own `with torch.autocast('cpu', torch.bfloat16):` (a second "
         "call in the same block finds autocast's weight casts already made, and the tracker "
         "counts them as activations). .kept is the bytes alive after the forward pass.",
    solution="""Measured {answer:.2f} MiB (batching.packed_step_memory): the bf16 mask, 2 x {T} x
{T} = {mask:,} bytes (the mask takes autocast's dtype: half the fp32 one), plus {layers} layers x
the fp32 log-sum-exp of {heads} heads x {T} tokens x 4 bytes = {lse:,} bytes (sum equal to the
measurement: {equal}). The mask grows with T^2, the log-sum-exp with T: the mask alone is
{ratio:.1f} times everything else the varlen run keeps ({varlen} MiB). On a GPU flash-attn's
varlen kernel keeps its log-sum-exp: there varlen saves the mask, {mask_mib:.0f} MiB.""",
)
@functools.cache
def _varlen_saving():
    import torch
    from labkit.training.batching import (document_lengths, make_documents, pack_batches,
                                          packed_step_memory)
    from labkit.transformer.model import build_model
    T = VARLEN_T
    cfg = preset("tiny", max_seq=T)
    torch.manual_seed(0)
    model = build_model(cfg)
    docs = make_documents(document_lengths(30, max_len=1024, median=400, seed=0))
    row = pack_batches(docs, T).batches[0]
    mem = {}
    for a in ("mask", "varlen"):            # one autocast block each: its weight cache is fresh
        with torch.autocast("cpu", torch.bfloat16):
            mem[a] = packed_step_memory(model, row, a)
    saved = mem["mask"].kept - mem["varlen"].kept
    mask, lse = 2 * T * T, cfg.layers * cfg.heads * T * 4
    return {"answer": saved / 2**20, "T": T, "mask": mask, "layers": cfg.layers,
            "heads": cfg.heads, "lse": lse, "equal": saved == mask + lse,
            "ratio": mask / mem["varlen"].kept, "varlen": f"{mem['varlen'].kept / 2**20:.1f}",
            "mask_mib": mask / 2**20}


@register(
    "03-in-backward-saving",
    question="""Predict, then check with lk.estimate. LLaMA-2-7B trains in pure bf16
(precision="bf16") on one GPU (device="cuda": foreach AdamW), batch 1 x 2048 tokens, this time
with no recomputation (recompute="none") and the full loss. How many GiB lower is the peak when
the optimizer steps inside the backward pass (optimizer_in_backward=True)? The ordinary step
holds every gradient and foreach's temporaries at once, 2 + 2 bytes per parameter: is the
saving that much? If not, where does the step in backward peak instead?""",
    unit="GiB",
    hint="Each estimate's .details['peak moment'] names the moment of its peak, and .total its "
         "bytes: lk.estimate('llama-2-7b', 1, 2048, precision='bf16', recompute='none', "
         "device='cuda', optimizer_in_backward=True) against the same without it. Without "
         "recomputation every layer keeps all its activations until its backward.",
    solution="""The ordinary step peaks at {ordinary} GiB at "{ordinary_moment}"; in backward at
{inb} GiB, at "{moment}": {answer:.1f} GiB saved, not the {four:.1f} GiB of every gradient and
foreach's temporaries. The step in backward frees those, so its peak moves to the start of the
backward pass: every layer's activations, the logits and their gradients. With full
recomputation and a chunked loss (the lab's table) that moment is small, and the saving is
{full:.1f} GiB.""",
)
def _in_backward_saving():
    from labkit.predict import count_params, estimate

    def peak(**kw):
        return estimate("llama-2-7b", 1, 2048, precision="bf16", device="cuda", **kw)
    ordinary, inb = peak(), peak(optimizer_in_backward=True)
    lean = [peak(recompute="full", loss_chunk=1024, optimizer_in_backward=f) for f in (False, True)]
    return {"answer": (ordinary.total - inb.total) / GiB, "ordinary": f"{ordinary.total / GiB:.1f}",
            "ordinary_moment": ordinary.details["peak moment"], "inb": f"{inb.total / GiB:.1f}",
            "moment": inb.details["peak moment"],
            "four": 4 * count_params("llama-2-7b").total / GiB,
            "full": (lean[0].total - lean[1].total) / GiB}
