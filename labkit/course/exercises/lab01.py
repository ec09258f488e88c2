"""Lab 01's exercises: parameter memory."""
from __future__ import annotations

from labkit.core.config import preset
from labkit.core.recipe import state_bytes
from labkit.course.exercises.core import BILLION, GiB, register
from labkit.predict import kv_cache_bytes
from labkit.predict.layers import count_params
from labkit.predict.papers import model_state_bytes


@register(
    "01-adamw-bytes",
    question="""Mixed-precision training with Adam keeps, for every parameter, a bf16 weight,
a bf16 gradient, an fp32 master weight and two fp32 moments (the ZeRO paper's accounting).
How many bytes of model states is that per parameter?""",
    unit="bytes per parameter", rtol=0,
    hint="Add the bytes of each copy: bf16 is 2 bytes, fp32 is 4 bytes.",
    solution="""weight {w} + gradient {g} + master weight, first and second moment {o}
= {answer} bytes per parameter (ZeRO's 2 + 2 + K with K = 12).
In code: lk.model_state_bytes(1, "bf16-master", "adamw") == {answer}""",
)
def _adamw_bytes():
    b = state_bytes("bf16-master", "adamw")
    return {"answer": model_state_bytes(1, "bf16-master", "adamw"), "w": b.weights,
            "g": b.grads, "o": b.optimizer}


@register(
    "01-llama-7b-fp32-adamw",
    question="""LLaMA-2-7B trained in plain fp32 with AdamW: how much memory do its model
states (weights, gradients, two moments) take, before any activation?""",
    unit="GiB",
    hint="Count the parameters with lk.count_params; fp32 AdamW keeps 4 + 4 + 8 bytes each. "
         "1 GiB = 2^30 bytes.",
    solution="""lk.count_params("llama-2-7b").total = {n:,} parameters.
fp32 AdamW: weight 4 + gradient 4 + two moments 8 = {per} bytes per parameter.
{n:,} x {per} = {bytes:,} bytes = {answer:.1f} GiB - more than one 80 GB GPU holds.""",
)
def _llama_fp32_adamw():
    n = count_params("llama-2-7b").total
    total = model_state_bytes(n, "fp32", "adamw")
    return {"answer": total / GiB, "n": n, "per": total // n, "bytes": total}


@register(
    "01-deepseek-v2-lite-params",
    question="How many parameters does DeepSeek-V2-Lite have in total (all experts counted)?",
    unit="billion parameters",
    hint="Add up lk.count_params(\"deepseek-v2-lite\").by_component, or take .total; "
         "a billion is 10^9.",
    solution="""lk.count_params("deepseek-v2-lite").by_component:
{parts}
total = {total:,} = {answer:.2f} billion (DeepSeek-AI publish 15.7B).""",
)
def _v2_lite_params():
    pc = count_params("deepseek-v2-lite")
    parts = "\n".join(f"  {k:15s} {v:>15,}" for k, v in pc.by_component.items())
    return {"answer": pc.total / BILLION, "total": pc.total, "parts": parts}


@register(
    "01-deepseek-v2-lite-idle-experts",
    question="""DeepSeek-V2-Lite routes each token to 6 of its 64 routed experts in every MoE
layer. How many routed-expert parameters sit idle for any one token?""",
    unit="billion parameters",
    hint="Each expert is a SwiGLU MLP (3 matrices of hidden x moe_ffn); "
         "per MoE layer, routed_experts - top_k of them are not used. "
         "Or: total - active from lk.count_params.",
    solution="""one expert: 3 x hidden x moe_ffn = 3 x {h} x {f} = {expert:,} parameters.
idle per token: {layers} MoE layers x ({E} - {k}) experts x {expert:,} = {idle:,}
= {answer:.2f} billion, the difference total - active of lk.count_params.""",
)
def _v2_lite_idle():
    c, pc = preset("deepseek-v2-lite"), count_params("deepseek-v2-lite")
    idle = pc.total - pc.active
    return {"answer": idle / BILLION, "idle": idle, "h": c.hidden, "f": c.moe_ffn,
            "expert": 3 * c.hidden * c.moe_ffn, "layers": c.moe_layers,
            "E": c.routed_experts, "k": c.top_k}


@register(
    "01-llama-7b-kv-cache",
    question="""At inference, LLaMA-2-7B caches a key and a value per layer, head and token.
How large is that KV cache for one sequence of 4096 tokens in bf16?""",
    unit="GiB",
    hint="Per token and layer: 2 (K and V) x kv_heads x head_dim numbers of 2 bytes; "
         "then x layers x tokens. Check with lk.kv_cache_bytes.",
    solution="""per token: 2 x {layers} layers x {kv} heads x {d} dims x 2 bytes = {per:,} bytes.
x 4096 tokens = {bytes:,} bytes = {answer:.2f} GiB (lk.kv_cache_bytes("llama-2-7b", seq=4096)).""",
)
def _llama_kv():
    c = preset("llama-2-7b")
    total = kv_cache_bytes(c, batch=1, seq=4096, dtype="bf16")
    return {"answer": total / GiB, "bytes": total, "per": total // 4096, "layers": c.layers,
            "kv": c.kv_heads, "d": c.head_dim}


@register(
    "01-mla-kv-ratio",
    question="""DeepSeek-V2-Lite's multi-head latent attention caches one compressed latent
(plus a shared RoPE key) per token and layer instead of full keys and values. How many
times smaller is its KV cache per token, over all layers, than LLaMA-2-7B's (both bf16)?""",
    unit="times",
    hint="MLA caches kv_lora_rank + qk_rope_dim numbers per token and layer; compare "
         "lk.kv_cache_bytes of both models at the same length.",
    solution="""LLaMA-2-7B: {llama:,} bytes per token; DeepSeek-V2-Lite: {layers} layers x
({r} + {rope}) x 2 bytes = {mla:,} bytes per token. Ratio: {answer:.1f}x.""",
)
def _mla_ratio():
    c = preset("deepseek-v2-lite")
    llama, mla = (kv_cache_bytes(name, seq=1) for name in ("llama-2-7b", "deepseek-v2-lite"))
    return {"answer": llama / mla, "llama": llama, "mla": mla, "layers": c.layers,
            "r": c.kv_lora_rank, "rope": c.qk_rope_dim}



@register(
    "01-zero3-fewest-gpus",
    question="""LLaMA-2-7B trains in bf16-mixed precision (autocast) with AdamW. With ZeRO-3
over N data-parallel GPUs, what is the fewest N at which its model states (weights, gradients,
optimizer state) fit in 24 GiB per GPU? Try it on the panel (ZeRO stage 3, move GPUs).""",
    unit="GPUs", rtol=0,
    hint="bf16-mixed AdamW keeps 4 + 4 + 8 bytes per parameter; ZeRO-3 splits all three over "
         "N GPUs. Find the smallest N with lk.model_state_bytes(n, 'bf16-mixed', 'adamw', "
         "zero_stage=3, dp=N) <= 24 * 2**30.",
    solution="""{n:,} parameters x 16 bytes = {whole:.2f} GiB on one GPU; ZeRO-3 over N GPUs
holds 1/N of it: {before:.2f} GiB on {fewer} GPUs, {states:.2f} GiB on {answer}.
The states are not the whole step: at batch 1 x 2048 tokens with CUDA defaults the estimate
per GPU is {peak:.2f} GiB during {phase} on {answer} GPUs - autocast's bf16 weight copies
({cache:.2f} GiB, made from the gathered weights and not sharded, as plain autocast over
fp32 weights under FSDP1 or ZeRO-3 keeps them; FSDP's bf16 parameter policy gathers bf16 weights
and makes none), the activations, and what ZeRO-3 holds whole for a while (the gathered
embedding, LM head and block, and their gradient buckets) come on top
(lk.estimate(..., layout=lk.Layout(dp={answer}, zero_stage=3)).explain()).""",
)
def _zero3_fewest_gpus():
    from labkit.predict import estimate
    from labkit.core.recipe import Layout
    n, budget = count_params("llama-2-7b").total, 24 * GiB
    dp = next(d for d in range(1, 1025)
              if model_state_bytes(n, "bf16-mixed", "adamw", zero_stage=3, dp=d) <= budget)
    e = estimate("llama-2-7b", seq=2048, precision="bf16-mixed",
                 layout=Layout(dp=dp, zero_stage=3))
    return {"answer": dp, "n": n, "whole": model_state_bytes(n, "bf16-mixed", "adamw") / GiB,
            "fewer": dp - 1,
            "before": model_state_bytes(n, "bf16-mixed", "adamw", zero_stage=3, dp=dp - 1) / GiB,
            "states": model_state_bytes(n, "bf16-mixed", "adamw", zero_stage=3, dp=dp) / GiB,
            "peak": e.total / GiB, "phase": e.peak_phase, "cache": e.saved_weight_cache / GiB}


@register(
    "01-predict-then-measure-sgd-momentum",
    question="""Predict, then measure. The course model `small` trains in fp32 with SGD with
momentum. How many bytes do its weights and its optimizer state (the momentum buffers) take?
Predict from lk.count_params("small"), then run
m = lk.measure_step("small", seq=64, precision="fp32", optimizer="sgd-momentum", fake=False)
and compare m.params + m.optimizer with your prediction.""",
    unit="bytes", rtol=0,
    hint="fp32 weights are 4 bytes each; SGD with momentum keeps one fp32 buffer per parameter "
         "(and, unlike AdamW, no step counter).",
    solution="""{n:,} parameters x (4 bytes of weight + 4 bytes of momentum) = {answer:,} bytes.
lk.measure_step("small", seq=64, precision="fp32", optimizer="sgd-momentum") at its peak:
weights {params:,} + momentum {optimizer:,} = {measured:,} bytes - equal: {equal}.
(The peak, {peak:,} bytes during {phase}, also holds activations or gradients.)""",
)
def _sgd_momentum_small():
    from labkit.training.measure import measure_step
    n = count_params("small").total
    m = measure_step("small", seq=64, precision="fp32", optimizer="sgd-momentum", fake=True)
    predicted = n * (state_bytes("fp32", "sgd-momentum").weights
                     + state_bytes("fp32", "sgd-momentum").optimizer)
    return {"answer": predicted, "n": n, "params": m.params, "optimizer": m.optimizer,
            "measured": m.params + m.optimizer, "equal": m.params + m.optimizer == predicted,
            "peak": m.total, "phase": m.peak_phase}


@register(
    "01-peak-moves-to-backward",
    question="""LLaMA-2-7B, bf16-mixed, AdamW, batch 1, CUDA defaults (foreach): at short
sequences the optimizer step sets the peak. From which sequence length, in steps of 512
tokens, does the start of the backward pass take over? Sweep lk.estimate(..., seq=s,
device="cuda").peak_phase.""",
    unit="tokens", rtol=0,
    hint="Loop s over 512, 1024, 1536, ... and stop at the first estimate whose peak_phase is "
         "'backward'; .moments shows both candidates.",
    solution="""at {before} tokens: optimizer step {opt_before:.2f} GiB, start of backward
{bwd_before:.2f} GiB; at {answer} tokens: optimizer step {opt:.2f} GiB, start of backward
{bwd:.2f} GiB. The optimizer step is the same at every length (states + foreach
temporaries); the backward moment grows with batch x sequence, so at batch 2 the crossover
comes at about half the length.""",
)
def _peak_moves_to_backward():
    from labkit.predict import estimate
    from labkit.predict.sweep import peak_leaves_optimizer

    def at(seq):
        return estimate("llama-2-7b", seq=seq, precision="bf16-mixed", device="cuda")
    seq = peak_leaves_optimizer("llama-2-7b", multiple=512, precision="bf16-mixed")
    assert at(seq).peak_phase == "backward"
    before, after = at(seq - 512).moments, at(seq).moments
    return {"answer": seq, "before": seq - 512,
            "opt_before": before["optimizer step"] / GiB, "bwd_before": before["backward: start"] / GiB,
            "opt": after["optimizer step"] / GiB, "bwd": after["backward: start"] / GiB}
