"""Lab 05's exercises: tensor, pipeline and expert parallelism."""
from __future__ import annotations

from labkit.core.config import preset
from labkit.core.recipe import state_bytes
from labkit.course.exercises.core import BILLION, GiB, register


@register(
    "05-tp8-param-share",
    question="""LLaMA-2-7B runs under tensor parallelism over 8 GPUs, as Megatron-LM splits it:
attention and MLP matrices by column or row, the embedding and the LM head by vocabulary, the
RMSNorm gains replicated on every GPU. What percentage of the model's parameters does one GPU
hold? Give four decimals.""",
    unit="percent", rtol=1e-5,
    hint="Every weight but the norm gains is cut in 8; each GPU keeps all the norm gains (hidden "
         "numbers per norm, two per layer plus the final one). Sum Weight.local(tp=8) over "
         "labkit.predict.layers' embedding_weights, head_weights and block_weights.",
    solution="""Split in 8: {split:,} parameters -> {split_local:,} per GPU. Replicated: {norms}
norm gains x {h} = {replicated:,} on every GPU. One GPU holds {local:,} of {total:,} =
{answer:.4f}%, against 1/8 = 12.5000% (claim 13): the replicated norms add {extra:.4f}
percentage points, so for the parameters the claim holds. The activations are another matter
(lk.estimate(..., layout=lk.Layout(tp=8)).saved_activations, bf16-mixed, 1 x 4096 tokens):
{act1:.1f} GiB on one GPU, {act8:.1f} GiB per GPU at tp = 8 ({act_share:.0f}%: what the norms
keep and the inputs of the column-split matmuls are whole on every GPU), {act_sp:.1f} GiB with
sequence parallelism, which splits those along the sequence.""",
)
def _tp8_param_share():
    from labkit.predict.layers import block_weights, embedding_weights, head_weights
    from labkit.predict import estimate
    from labkit.core.recipe import Layout
    c = preset("llama-2-7b")
    weights = (embedding_weights(c) + head_weights(c)
               + [w for i in range(c.layers) for w in block_weights(c, i >= c.dense_layers)])
    total, local = sum(w.numel for w in weights), sum(w.local(tp=8) for w in weights)
    norms = [w for w in weights if w.split == "replicated"]
    replicated = sum(w.numel for w in norms)
    act = {(tp, sp): estimate(c, 1, 4096, precision="bf16-mixed",
                              layout=Layout(tp=tp, sp=sp)).saved_activations / GiB
           for tp, sp in ((1, False), (8, False), (8, True))}
    return {"answer": 100 * local / total, "total": total, "local": local,
            "split": total - replicated, "split_local": local - replicated,
            "norms": len(norms), "h": c.hidden, "replicated": replicated,
            "extra": 100 * local / total - 12.5, "act1": act[1, False], "act8": act[8, False],
            "act_share": 100 * act[8, False] / act[1, False], "act_sp": act[8, True]}


@register(
    "05-1f1b-in-flight",
    question="""A pipeline of p = 8 stages runs m = 32 micro-batches per step under the 1F1B
schedule. At most how many micro-batches' activations does the first stage hold at once?""",
    unit="micro-batches", rtol=0,
    hint="1F1B's first stage runs forward passes until the first micro-batch's backward comes "
         "back down the pipeline, then alternates one forward, one backward. "
         "labkit.parallel.pipeline.pipeline_parallel.in_flight(stage, p, m, schedule).",
    solution="""1F1B: stage s runs p - s forward passes before its first backward, then frees one
micro-batch for each it starts: stage 0 holds min(m, p) = {answer:g}, whatever m beyond p.
GPipe runs all forward passes first: {gpipe:g} in flight, {ratio:g}x as many
(in_flight(0, 8, 32, "gpipe")). For LLaMA-2-7B at 1 x 4096 tokens per micro-batch, stage 0's
{layers} layers save {per_mb:.2f} GiB per micro-batch (bf16-master,
labkit.predict.layers.layer_saved):
{one_f_one_b:.1f} GiB under 1F1B, {all_forward:.1f} GiB under GPipe. The last stage holds
only 1 under 1F1B (in_flight(7, 8, 32) = {last:g}).""",
)
def _1f1b_in_flight():
    from labkit.predict.layers import layer_saved
    from labkit.parallel.pipeline.pipeline_parallel import in_flight, stage_layers
    p, m = 8, 32
    ours, gpipe = in_flight(0, p, m, "1f1b"), in_flight(0, p, m, "gpipe")
    c = preset("llama-2-7b")
    layers = len(stage_layers(c.layers, p)[0])
    per_mb = layers * layer_saved(c, "bf16-master").bytes(1, 4096) / GiB
    return {"answer": float(ours), "gpipe": float(gpipe), "ratio": float(gpipe / ours),
            "layers": layers, "per_mb": per_mb, "one_f_one_b": float(ours) * per_mb,
            "all_forward": float(gpipe) * per_mb, "last": float(in_flight(p - 1, p, m))}


def _fewest_micro_batches(p: int, schedule: str, v: int = 1, under: float = 0.05) -> int:
    """The fewest m whose idle fraction lk.pipeline_bubble(p, m, schedule, v) is below ``under``
    (interleaved 1F1B runs micro-batches in groups of p: m a multiple of p, as Megatron-LM asks)."""
    from labkit.predict.papers import pipeline_bubble
    step = p if schedule == "interleaved" else 1
    return next(m for m in range(step, 100_000, step) if pipeline_bubble(p, m, schedule, v) < under)


@register(
    "05-bubble-m",
    question="""Under 1F1B each of p stages idles a fraction (p - 1)/(m + p - 1) of the step
(the pipeline bubble). With p = 8 stages, what is the fewest number m of micro-batches per step
that brings the idle fraction under 5%?""",
    unit="micro-batches", rtol=0,
    hint="Solve (p - 1)/(m + p - 1) < 0.05 for m, or loop m = 1, 2, ... over "
         "lk.pipeline_bubble(8, m, '1f1b'); exactly 5% is not under.",
    solution="""7/(m + 7) < 0.05 needs m + 7 > 140: m = {answer} (idle {at:.2%}; m = {before}
idles exactly {before_at:.0%}): a step of at least {answer} micro-batches per pipeline, {answer}
sequences at one per micro-batch. Interleaved 1F1B with v = 2 chunks per stage shrinks the
bubble to (p - 1)/(v m + p - 1) and runs micro-batches in groups of p: m = {interleaved}, the
first multiple of 8 under 5% ({interleaved_at:.2%}). ZB-H1, which defers the
weight gradients into the bubble (Qi et al., 2023), idles (p - 1)/(3m + p - 1): m =
{zb} ({zb_at:.2%}), at the cost of holding p micro-batches on every stage
(lk.pipeline_bubble(8, m, schedule, v)).""",
)
def _bubble_m():
    from labkit.predict.papers import pipeline_bubble
    m = _fewest_micro_batches(8, "1f1b")
    inter, zb = _fewest_micro_batches(8, "interleaved", v=2), _fewest_micro_batches(8, "zb-h1")
    return {"answer": m, "at": pipeline_bubble(8, m), "before": m - 1,
            "before_at": pipeline_bubble(8, m - 1), "interleaved": inter,
            "interleaved_at": pipeline_bubble(8, inter, "interleaved", v=2), "zb": zb,
            "zb_at": pipeline_bubble(8, zb, "zb-h1")}


@register(
    "05-v3-experts-per-gpu",
    question="""DeepSeek-V3 (preset "deepseek-v3") spread over 256-way expert parallelism: one
routed expert of every MoE layer per GPU. How many routed-expert parameters does one GPU hold?""",
    unit="billion parameters",
    hint="Routed experts per GPU: routed_experts / 256 per MoE layer; each is a SwiGLU MLP of "
         "3 x hidden x moe_ffn. Check with "
         "labkit.parallel.expert.expert_parallel.rank_params(cfg, 256).",
    solution="""{E} routed experts / 256 = {per_rank} per GPU in each of {layers} MoE layers, each
3 x {h} x {f} = {expert:,} parameters: {routed:,} = {answer:.2f} billion
(labkit.parallel.expert.expert_parallel.rank_params). With mixed-precision AdamW
(bf16-master, 16 bytes per parameter) their model states take {routed_gib:.1f} GiB per GPU; the replicated rest
(attention, the {dense} dense MLPs, shared experts, routers, norms, embedding, head:
{replicated:.2f} billion) adds {replicated_gib:.1f} GiB. From ep = 64 on the replicated rest is most
of a GPU's model states, and no ep divides it: DeepSeek-V3 (on 80 GB H800s) pairs 64-way expert
parallelism with 16 pipeline stages, which split the layers, and so the replicated rest, 16 ways
(DualPipe keeps two stages per GPU), and ZeRO-1.""",
)
def _v3_experts_per_gpu():
    from labkit.parallel.expert.expert_parallel import experts_per_rank, rank_params
    c = preset("deepseek-v3")
    routed, replicated = rank_params(c, 256)
    per_param = state_bytes("bf16-master", "adamw").total
    return {"answer": routed / BILLION, "E": c.routed_experts,
            "per_rank": experts_per_rank(c, 256), "layers": c.moe_layers, "h": c.hidden,
            "f": c.moe_ffn, "expert": 3 * c.hidden * c.moe_ffn, "routed": routed,
            "dense": c.dense_layers,
            "routed_gib": routed * per_param / GiB, "replicated": replicated / BILLION,
            "replicated_gib": replicated * per_param / GiB}


@register(
    "05-mixtral-etp-activations",
    question="""Mixtral-8x7B (preset "mixtral-8x7b") has 8 routed experts per layer, so expert
parallelism splits them at most 8 ways. On 16 GPUs, ep 8 x etp 2 also splits each expert's ffn
in two (lk.Layout(dp=16, ep=8, etp=2)). In bf16-mixed, 1 x 4096 tokens per GPU, no recompute,
balanced routing: how many GiB more activations does it keep for the backward pass than ep 8
alone (lk.Layout(dp=16, ep=8), each expert shard on 2 GPUs)?""",
    unit="GiB", rtol=2e-4,
    hint="The SwiGLU's intermediates do not change (etp x the rows at 1/etp of the width). What "
         "grows is what each GPU keeps per row it receives: the sorted input (hidden numbers; "
         "under autocast two bf16 copies, 4 B a number) and two int64 permutation indices. With "
         "etp 2 a GPU keeps its etp partner's rows too: top_k x 4096 more rows per MoE layer.",
    solution="""Per extra row: {h} x 4 B (the gathered input's bf16 copies for w_gate and w_up)
+ 16 B (argsort and its inverse) = {row:,} B; {k} x 4,096 rows per MoE layer x {layers} layers:
{answer:.2f} GiB (lk.estimate: {est:.2f} GiB). labkit's w_gate and w_up each keep a bf16 copy
of the gathered input; Megatron-LM's fused fc1 keeps one: {fused:.2f} GiB. What it buys: each
GPU holds half an expert per layer instead of a whole one, so its peak falls from {ep8:.1f} GiB
to {etp2:.1f} GiB. Against ZeRO, in the ZeRO paper's recipe (bf16-master, 2 + 2 + 12 bytes a
parameter): ZeRO-1 over the 16 GPUs reaches {zero1_master:.1f} GiB (ep 8 x etp 2 without ZeRO:
{etp2_master:.1f} GiB), but {rep_saved:.1f} GiB of ZeRO-1's saving is the replicated weights'
masters and moments sharded over all 16, which a distributed optimizer does under etp too (the
peaks fall in different phases, so the savings do not subtract exactly). On the experts alone,
ZeRO-1 over their 2 copies halves only the fp32 masters and moments ({experts_zero:.1f} GiB
saved); etp 2 halves all 16 bytes a parameter ({experts_etp:.1f} GiB; {megatron_etp:.1f} GiB
with Megatron-LM's fp32 main gradients, 18 bytes) for {answer:.1f} GiB of activations and the
etp traffic. ZeRO-3 over the copies halves all three too, gathering the weights every layer. At
a fixed GPU count etp and ZeRO over the copies do not add: etp turns the copies into slices.
None of these fits an 80 GB GPU at this length (labkit models etp without ZeRO).""",
)
def _mixtral_etp_activations():
    from labkit.core.recipe import Layout
    from labkit.parallel.expert.compose import rank_params
    from labkit.predict import estimate
    c = preset("mixtral-8x7b")
    row = 4 * c.hidden + 16
    answer = c.top_k * 4096 * c.moe_layers * row / GiB
    ep8, etp2 = (estimate(c, 1, 4096, precision="bf16-mixed", layout=layout)
                 for layout in (Layout(dp=16, ep=8), Layout(dp=16, ep=8, etp=2)))
    zero1_master, etp2_master = (
        estimate(c, 1, 4096, precision="bf16-master", layout=layout).total / GiB
        for layout in (Layout(dp=16, ep=8, zero_stage=1), Layout(dp=16, ep=8, etp=2)))
    routed, replicated = rank_params(c, 8)                   # per GPU at ep 8
    return {"answer": answer, "h": c.hidden, "row": row, "k": c.top_k, "layers": c.moe_layers,
            "zero1_master": zero1_master, "etp2_master": etp2_master,
            "rep_saved": replicated * 12 * 15 / 16 / GiB,    # masters + moments over 16
            "experts_zero": routed * 12 / 2 / GiB, "experts_etp": routed * 16 / 2 / GiB,
            "megatron_etp": routed * 18 / 2 / GiB,
            "est": (etp2.saved_activations - ep8.saved_activations) / GiB,
            "fused": c.top_k * 4096 * c.moe_layers * (2 * c.hidden + 16) / GiB,
            "ep8": ep8.total / GiB, "etp2": etp2.total / GiB}
