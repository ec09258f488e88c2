"""Lab 06's exercises: quantisation, 8-bit optimizers, LoRA and QLoRA."""
from __future__ import annotations

from labkit.core.config import preset
from labkit.course.exercises.core import GiB, register
from labkit.predict.layers import count_params


def _model_weights(c) -> list:
    """Every parameter tensor of the model ``c`` describes (``predict.layers``), in model order."""
    from labkit.predict.layers import block_weights, embedding_weights, head_weights
    return (embedding_weights(c) + head_weights(c)
            + [w for i in range(c.layers) for w in block_weights(c, i >= c.dense_layers)])


@register(
    "06-nf4-bits",
    question="""QLoRA stores each frozen weight as a 4-bit NF4 code, with one fp32 absmax scale per
block of 64 weights. Double quantisation then stores those scales in 8 bits, in blocks of 256
scales that each keep one fp32 scale of their own. How many bits per parameter is that, all
overheads included? Give three decimals.""",
    unit="bits per parameter", rtol=1e-4,
    hint="4 bits of code, plus each scale's bits divided by the weights it serves: an 8-bit scale "
         "per 64 weights, an fp32 scale per 64 x 256 weights. "
         "labkit.quantisation.quant.nf4_bits_per_param.",
    solution="""4 + 8/64 + 32/(64 x 256) = {answer:.10g} bits per parameter (QLoRA's 4.127), against
4 + 32/64 = {plain:g} without double quantisation: the scales' overhead falls from {plain_over:.3f}
to {dq_over:.3f} bits (labkit.quantisation.quant.nf4_bits_per_param(64, double_quant=...)).
LLaMA-2-7B's block linear weights ({n:,} numbers in {tensors} matrices, what
"all-linear" QLoRA quantises): {bf16:.2f} GiB in bf16, {plain_gib:.2f} GiB in NF4,
{answer_gib:.2f} GiB with double quantisation, {saved:.0f} MiB less.
lk.estimate(..., recipe=lk.Recipe("bf16-master", trainable="lora", weight_format="nf4")) holds
{est_bytes:,} bytes of them: the same, plus one fp32 mean of the scales per matrix.""",
)
def _nf4_bits():
    from labkit.predict.layers import lora_targets
    from labkit.predict import estimate
    from labkit.quantisation.quant import nf4_bits_per_param
    from labkit.core.recipe import Recipe
    c = preset("llama-2-7b")
    bits, plain = nf4_bits_per_param(64, True, 256), nf4_bits_per_param(64, False)
    targets = [w for i in range(c.layers) for w in lora_targets(c, i >= c.dense_layers)]
    n = sum(w.numel for w in targets)
    e = estimate(c, 1, 2048, recipe=Recipe("bf16-master", trainable="lora", weight_format="nf4"))
    return {"answer": bits, "plain": plain, "plain_over": plain - 4, "dq_over": bits - 4,
            "n": n, "tensors": len(targets), "bf16": 2 * n / GiB, "plain_gib": plain * n / 8 / GiB,
            "answer_gib": bits * n / 8 / GiB, "saved": (plain - bits) * n / 8 / 2**20,
            "est_bytes": sum(t.nbytes for t in e.tensors if t.dtype == "nf4")}


@register(
    "06-lora-share",
    question="""LoRA at rank 16 on "all-linear" targets (every linear layer of every block: wq, wk,
wv, wo, w_gate, w_up, w_down) trains two small matrices per target, A (r x in) and B (out x r),
and freezes the rest. What percentage of LLaMA-2-7B's parameters does it train? Give two
decimals.""",
    unit="percent",
    hint="Each target adds r x (in + out) parameters. Sum "
         "labkit.predict.layers.lora_weights(cfg, False, 16) over the 32 layers and divide by "
         "lk.count_params('llama-2-7b').total.",
    solution="""Per layer, r x (in + out) over the {targets} targets: {per_layer:,} parameters at
rank 16 (a common PEFT setting); x {layers} layers = {trained:,} of {total:,} base parameters =
{answer:.2f}%. Rank 8 on wq and wv only (the LoRA paper's RoBERTa/DeBERTa setting; GPT-3 used
rank 4): {qv:,} = {qv_share:.3f}%; rank 64 on all-linear, QLoRA's own setting: {r64:,} =
{r64_share:.2f}%. Common advice says "LoRA trains 0.1-1% of the parameters" (claim 15): true of
rank-16 all-linear adapters only; attention-only rank 8 trains less than that, QLoRA's rank 64
more. The share is
r (in + out) / (in x out) per matrix, so it scales with the rank and the targets:
{qv_share:.3f}% to {r64_share:.2f}% in these three settings.""",
)
def _lora_share():
    from labkit.predict.layers import lora_targets, lora_weights
    c = preset("llama-2-7b")
    total = count_params(c).total
    moe = [i >= c.dense_layers for i in range(c.layers)]

    def all_linear(r):
        return sum(w.numel for m in moe for w in lora_weights(c, m, r))

    qv = sum(8 * (w.fan_in + w.fan_out) for m in moe for w in lora_targets(c, m)
             if w.name in ("attn.wq", "attn.wv"))
    trained = all_linear(16)
    return {"answer": 100 * trained / total, "targets": len(lora_targets(c, False)),
            "per_layer": sum(w.numel for w in lora_weights(c, False, 16)), "layers": c.layers,
            "trained": trained, "total": total, "qv": qv, "qv_share": 100 * qv / total,
            "r64": all_linear(64), "r64_share": 100 * all_linear(64) / total}


@register(
    "06-adamw8bit-state",
    question="""8-bit AdamW (Dettmers et al., 2022, as bitsandbytes runs it) keeps each moment as
one uint8 code per number plus one fp32 absmax per block of 256 numbers; parameter tensors of
fewer than 4096 numbers keep fp32 moments. How much memory does its state take for all of
LLaMA-2-7B's parameters? Give two decimals.""",
    unit="GiB", rtol=1e-3,
    hint="Per parameter tensor of n numbers: 2 x (n + 4 ceil(n / 256)) bytes, or 8n under 4096 "
         "numbers. Sum labkit.quantisation.optim8bit.state_bytes(w.numel) over "
         "labkit.predict.layers' embedding_weights, head_weights and block_weights.",
    solution="""{tensors} parameter tensors; {small} of them are under {min8} numbers (a norm gain
holds {h}). Codes 2 x 1 byte + absmax 2 x 4/{block} bytes = {per:.6g} bytes per parameter:
{bytes:,} bytes = {answer:.2f} GiB, against fp32 AdamW's 8 bytes per parameter, {fp32:.2f} GiB
({ratio:.2f}x smaller). lk.estimate(..., precision="fp32", optimizer="adamw-8bit").optimizer adds
the two 256-value maps: {est:,} bytes. The moments are not the whole optimizer state under
mixed precision: with bf16-master the fp32 master weights stay, and the optimizer holds
{master:.2f} GiB ({fp32_master:.2f} GiB with fp32 AdamW).""",
)
def _adamw8bit_state():
    from labkit.quantisation import optim8bit
    from labkit.predict import estimate
    c = preset("llama-2-7b")
    sizes = [w.numel for w in _model_weights(c)]
    n, state = sum(sizes), sum(optim8bit.state_bytes(s) for s in sizes)

    def optimizer_bytes(precision, optimizer):
        return estimate(c, 1, 2048, precision=precision, optimizer=optimizer).optimizer

    return {"answer": state / GiB, "tensors": len(sizes), "h": c.hidden,
            "small": sum(s < optim8bit.MIN_8BIT_SIZE for s in sizes),
            "min8": optim8bit.MIN_8BIT_SIZE, "block": optim8bit.BLOCK, "per": state / n,
            "bytes": state, "fp32": 8 * n / GiB, "ratio": 8 * n / state,
            "est": optimizer_bytes("fp32", "adamw-8bit"),
            "master": optimizer_bytes("bf16-master", "adamw-8bit") / GiB,
            "fp32_master": optimizer_bytes("bf16-master", "adamw") / GiB}


@register(
    "06-qlora-7b-peak",
    question="""QLoRA fine-tunes LLaMA-2-7B: its block linear weights frozen in NF4 (double
quantised), rank-16 LoRA adapters on all of them trained with AdamW, bf16 weights with fp32
master copies of the adapters (bf16-master), no LoRA dropout, batch 1 x 2048 tokens, no
recomputation. What is the estimated peak memory of one training step? Give two decimals.""",
    unit="GiB",
    hint="lk.estimate('llama-2-7b', 1, 2048, recipe=lk.Recipe('bf16-master', trainable='lora', "
         "weight_format='nf4')).total; .explain() lists what is alive at the peak.",
    solution="""lk.estimate("llama-2-7b", 1, 2048, recipe=lk.Recipe("bf16-master",
trainable="lora", weight_format="nf4")): {answer:.2f} GiB, during {phase}: weights
{params:.2f} GiB (NF4 blocks, bf16 embedding, norms and LM head, adapters), optimizer state
{optimizer:.2f} GiB, saved activations {acts:.2f} GiB - at this length the activations, not the
weights, are most of the peak. The same step on a bf16 base (LoRA without NF4): {lora:.2f} GiB;
full fine-tuning (every weight trained, same precision): {full:.2f} GiB during {full_phase},
{ratio:.1f}x the QLoRA peak, {full_opt:.2f} GiB of it AdamW moments and fp32 master weights for
every weight. LoRA keeps those for the adapters only; NF4 then takes the weights from
{bf16_params:.2f} to {params:.2f} GiB. The estimate has no LoRA dropout (PEFT's default,
an nn.Identity); qlora.py's LLaMA-2-7B script passes --lora_dropout 0.1. Then each adapted
linear saves its own dropped bf16 copy of its input and, on CUDA, a bool mask: 3 bytes per
input feature ({feats:,} per layer over the {targets} targets), less the 2-byte inputs only
the adapters kept (the two norms' outputs and w_down's input, which no frozen layer saves):
+{dropout:.2f} GiB at 1 x 2048 without recomputation (the lab's fake step measures 4.15), one
layer's worth with full recompute.""",
)
def _qlora_7b_peak():
    from labkit.predict import estimate
    from labkit.predict.layers import lora_targets
    from labkit.core.recipe import Recipe

    def step(trainable, weight_format=None):
        return estimate("llama-2-7b", 1, 2048,
                        recipe=Recipe("bf16-master", trainable=trainable,
                                      weight_format=weight_format))
    qlora, lora, full = step("lora", "nf4"), step("lora"), step("all")
    c = preset("llama-2-7b")
    targets = lora_targets(c, False)
    feats = sum(w.fan_in for w in targets)
    kept_by_adapters_only = 2 * c.hidden + c.ffn       # attention and MLP inputs, w_down's input
    dropout = (3 * feats - 2 * kept_by_adapters_only) * 2048 * c.layers
    return {"answer": qlora.total / GiB, "phase": qlora.peak_phase, "params": qlora.params / GiB,
            "optimizer": qlora.optimizer / GiB, "acts": qlora.saved_activations / GiB,
            "lora": lora.total / GiB, "bf16_params": lora.params / GiB,
            "full": full.total / GiB, "full_phase": full.peak_phase,
            "full_opt": full.optimizer / GiB,
            "ratio": full.total / qlora.total,
            "feats": feats, "targets": len(targets), "dropout": dropout / GiB}


@register(
    "06-paged-mistral-mib",
    question="""Section 7's rule: bitsandbytes' paged optimizers put a tensor's state in unified
memory only from 100,000 numbers. QLoRA on Mistral-7B at rank 16 (all-linear, the lab's
targets) with paged_adamw_8bit keeps two 1-byte moments per adapter number; only those codes
are paged (the absmax scales stay on the GPU). How many MiB of state can the driver move to the
host when the GPU runs short? Give two decimals.""",
    unit="MiB", rtol=1e-4,
    hint="List each adapter's A (r x in) and B (out x r) with "
         "labkit.predict.layers.lora_weights(cfg, False, 16) over the 32 layers, keep those of "
         "100,000 numbers or more, 2 bytes per number. labkit.predict.paged.paged_state checks it.",
    solution="""{paged_tensors} of {tensors} adapter tensors reach 100,000 numbers: in each layer A of
w_down (16 x {ffn:,}) and B of w_gate and w_up ({ffn:,} x 16), {wide:,} numbers each; the
attention's adapters and the other halves ({hidden:,} x 16 or less) stay under it. 2 bytes x
{numbers:,} numbers = {answer:.2f} MiB can move; {resident:.2f} MiB (the smaller adapters'
moments, every absmax scale, the two maps) stays on the GPU. The same step grows by
{spike:.2f} GiB from 1 x 2,048 to 2 x 4,096 tokens (full recompute): paging frees {share:.1%} of
that.""",
)
def _paged_mistral():
    from labkit.predict import estimate
    from labkit.core.recipe import Recipe
    from labkit.predict.paged import paged_state, trained_numels
    c = preset("mistral-7b")
    state = paged_state(trained_numels(c, "lora", 16), bits=8)
    step = [estimate(c, batch, seq, recipe=Recipe("bf16-master", optimizer="adamw-8bit",
                                                   trainable="lora", weight_format="nf4",
                                                   recompute="full")).total
            for batch, seq in ((1, 2048), (2, 4096))]
    return {"answer": state.paged / 2**20, "paged_tensors": state.paged_tensors,
            "tensors": state.tensors, "ffn": c.ffn, "wide": 16 * c.ffn, "hidden": c.hidden,
            "numbers": state.paged // 2, "resident": state.resident / 2**20,
            "spike": (step[1] - step[0]) / GiB, "share": state.paged / (step[1] - step[0])}
