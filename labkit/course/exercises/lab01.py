"""Lab 01's exercises: parameter memory."""
from __future__ import annotations

from labkit.core.config import preset
from labkit.core.recipe import state_bytes
from labkit.course.exercises.core import GiB, register
from labkit.predict import kv_cache_bytes
from labkit.predict.layers import count_params
from labkit.predict.papers import model_state_bytes


@register(
    "01-adamw-bytes",
    question="""Build the states yourself. For one layer of 1,000 weights, make in PyTorch
every copy that ZeRO's mixed-precision Adam keeps: a bf16 weight, a bf16 gradient, an fp32
master weight and two fp32 moments (torch.zeros(1000, dtype=...)). Add up their .nbytes and
divide by 1,000: how many bytes of model states is that per parameter?""",
    unit="bytes per parameter", rtol=0,
    hint="torch.zeros(1000, dtype=torch.bfloat16).nbytes is 2,000 bytes; an fp32 tensor of 1,000 "
         "numbers takes twice that. Five tensors in all.",
    solution="""weight {w} + gradient {g} + master weight, first and second moment {o}
= {answer} bytes per parameter (ZeRO's 2 + 2 + K with K = 12).
In code: sum(torch.zeros(1000, dtype=d).nbytes
            for d in (torch.bfloat16,) * 2 + (torch.float32,) * 3) / 1000
== lk.model_state_bytes(1, "bf16-master", "adamw") == {answer}""",
)
def _adamw_bytes():
    b = state_bytes("bf16-master", "adamw")
    return {"answer": model_state_bytes(1, "bf16-master", "adamw"), "w": b.weights,
            "g": b.grads, "o": b.optimizer}


@register(
    "01-mistral-7b-megatron-states",
    question="""Megatron-LM trains in bf16 with fp32 gradients: for every parameter a bf16 weight,
an fp32 gradient (its main_grad, kept all step) and, in the optimizer, an fp32 master weight and
AdamW's two fp32 moments. How much memory do Mistral-7B's model states take that way on one GPU,
without ZeRO?""",
    unit="GiB",
    hint="Count the parameters with lk.count_params(\"mistral-7b\"); add the bytes of each copy "
         "(bf16: 2, fp32: 4). 1 GiB = 2^30 bytes.",
    solution="""lk.count_params("mistral-7b").total = {n:,} parameters.
bf16 weight {w} + fp32 gradient {g} + fp32 master weight and two moments {o} = {per} bytes per
parameter: ZeRO's 16 with the gradient in fp32, {extra} more.
{n:,} x {per} = {bytes:,} bytes = {answer:.2f} GiB.""",
)
def _mistral_megatron_states():
    n = count_params("mistral-7b").total
    w, g = state_bytes("bf16-master").weights, state_bytes("fp32").grads   # fp32 main_grad
    o = state_bytes("bf16-master").optimizer                               # master + m + v
    per = w + g + o
    return {"answer": n * per / GiB, "n": n, "w": w, "g": g, "o": o, "per": per,
            "extra": per - model_state_bytes(1, "bf16-master", "adamw"), "bytes": n * per}


@register(
    "01-moe-idle-expert-states",
    question="""DeepSeek-MoE-16B routes each token to 6 of its 64 routed experts in every MoE
layer. In one MoE layer, how much memory do the model states (bf16-master AdamW, 16 bytes per
parameter) of the routed experts that a given token does not use take?""",
    unit="GiB",
    hint="lk.preset(\"deepseek-moe-16b\") gives hidden, moe_ffn, routed_experts and top_k. Each "
         "expert is a SwiGLU MLP: 3 matrices of hidden x moe_ffn.",
    solution="""one expert: 3 x hidden x moe_ffn = 3 x {h:,} x {f:,} = {expert:,} parameters.
not used by the token: {E} - {k} = {unused} experts = {idle:,} parameters per MoE layer.
x {per} bytes = {bytes:,} bytes = {answer:.2f} GiB in one layer; over its {layers} MoE layers
{whole:.1f} GiB of states that this token's compute never touches, but memory must hold.""",
)
def _moe_idle_expert_states():
    from labkit.predict.layers import mlp_weights
    c = preset("deepseek-moe-16b")
    idle = sum(w.numel - w.numel // w.copies * w.used for w in mlp_weights(c, moe=True)
               if w.copies > 1)                                 # the stacked routed experts
    per = model_state_bytes(1, "bf16-master", "adamw")
    layer = model_state_bytes(idle, "bf16-master", "adamw")
    return {"answer": layer / GiB, "h": c.hidden, "f": c.moe_ffn,
            "expert": 3 * c.hidden * c.moe_ffn, "E": c.routed_experts, "k": c.top_k,
            "unused": c.routed_experts - c.top_k,
            "idle": idle, "per": per, "bytes": layer, "layers": c.moe_layers,
            "whole": c.moe_layers * layer / GiB}


@register(
    "01-small-params-by-hand",
    question="""Count the parameters of the course model `small` by hand, from lk.preset("small"):
an embedding and an untied LM head (vocab_size x hidden each); in every layer the q and output
projections (hidden x heads*head_dim each), the k and v projections (hidden x kv_heads*head_dim
each: grouped-query attention), a SwiGLU MLP (3 matrices of hidden x ffn) and two RMSNorm
weights (hidden each); and a final RMSNorm (hidden). No biases. How many parameters?""",
    unit="parameters", rtol=0,
    hint="One layer first, then x layers, then add the embedding, the LM head and the final norm. "
         "Compare with lk.count_params(\"small\").total only at the end.",
    solution="""embedding + LM head: 2 x {V:,} x {h} = {embed:,}
one layer: q and o 2 x {h} x {qw} + k and v 2 x {h} x {kvw} = {attn:,}; MLP 3 x {h} x {f} = {mlp:,};
norms 2 x {h} = {norms:,}; together {layer:,}
x {L} layers = {blocks:,}; + final norm {h} = {answer:,} (lk.count_params("small").total).""",
)
def _small_params_by_hand():
    c = preset("small")
    qw, kvw = c.heads * c.head_dim, c.kv_heads * c.head_dim
    attn, mlp, norms = 2 * c.hidden * qw + 2 * c.hidden * kvw, 3 * c.hidden * c.ffn, 2 * c.hidden
    embed = 2 * c.vocab_size * c.hidden
    layer = attn + mlp + norms
    total = count_params(c).total
    assert total == embed + c.layers * layer + c.hidden, "the hand count must match labkit's"
    return {"answer": total, "V": c.vocab_size, "h": c.hidden, "qw": qw, "kvw": kvw,
            "attn": attn, "f": c.ffn, "mlp": mlp, "norms": norms, "layer": layer,
            "L": c.layers, "blocks": c.layers * layer, "embed": embed}


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
    "01-gqa-kv-cache-batch8",
    question="""Mistral-7B uses grouped-query attention: its 32 query heads share 8 key/value
heads. At inference with a batch of 8 sequences of 4096 tokens each, how large is its KV cache
in bf16?""",
    unit="GiB",
    hint="Per token and layer: 2 (K and V) x kv_heads x head_dim numbers of 2 bytes; then "
         "x layers x tokens x sequences. Check with lk.kv_cache_bytes(\"mistral-7b\", batch=8, "
         "seq=4096).",
    solution="""per token: 2 x {layers} layers x {kv} K/V heads x {d} dims x 2 bytes
= {per:,} bytes, 1/{ratio} of what {heads} K/V heads would cache.
x 8 sequences x 4096 tokens = {bytes:,} bytes = {answer:.2f} GiB
(lk.kv_cache_bytes("mistral-7b", batch=8, seq=4096)).""",
)
def _gqa_kv_batch8():
    c = preset("mistral-7b")
    total = kv_cache_bytes(c, batch=8, seq=4096, dtype="bf16")
    return {"answer": total / GiB, "bytes": total, "per": total // (8 * 4096),
            "layers": c.layers, "kv": c.kv_heads, "d": c.head_dim, "heads": c.heads,
            "ratio": c.heads // c.kv_heads}


@register(
    "01-zero3-fewest-gpus",
    question="""LLaMA-2-7B trains in bf16-mixed precision (autocast) with AdamW. With ZeRO-3
over N data-parallel GPUs, what is the fewest N at which its model states (weights, gradients,
optimizer state) fit in 24 GiB per GPU? Try it on the panel (it opens on bf16-mixed: set ZeRO
stage 3 and move GPUs).""",
    unit="GPUs", rtol=0,
    hint="bf16-mixed AdamW keeps 4 + 4 + 8 bytes per parameter; ZeRO-3 splits all three over "
         "N GPUs. Find the smallest N with lk.model_state_bytes(n, 'bf16-mixed', 'adamw', "
         "zero_stage=3, dp=N) <= 24 * 2**30.",
    solution="""{n:,} parameters x 16 bytes = {whole:.2f} GiB on one GPU; ZeRO-3 over N GPUs
holds 1/N of it: {before:.2f} GiB on {fewer} GPUs, {states:.2f} GiB on {answer}.
The states are not the whole step: at batch 1 x 2048 tokens with plain torch.optim.AdamW's CUDA
default (foreach) the estimate per GPU is {peak:.2f} GiB during {phase} on {answer} GPUs -
autocast's bf16 weight copies ({cache:.2f} GiB, made from the gathered weights and not
sharded, as plain autocast over fp32 weights under FSDP1 or ZeRO-3 keeps them; FSDP's bf16
parameter policy gathers bf16 weights and makes none), the activations, and what ZeRO-3
holds whole for a while (the gathered embedding, LM head and block, and their gradient
buckets) come on top
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
    question="""LLaMA-2-7B, bf16-mixed, batch 1, plain torch.optim.AdamW on CUDA (its default
there: foreach): at short sequences the optimizer step sets the peak. From which sequence
length, in steps of 512 tokens, does the start of the backward pass take over? Sweep
lk.estimate(..., seq=s, device="cuda").peak_phase.""",
    unit="tokens", rtol=0,
    hint="Loop s over 512, 1024, 1536, ... and stop at the first estimate whose peak_phase is "
         "'backward'; .moments shows both candidates.",
    solution="""at {before} tokens: optimizer step {opt_before:.2f} GiB, start of backward
{bwd_before:.2f} GiB; at {answer} tokens: optimizer step {opt:.2f} GiB, start of backward
{bwd:.2f} GiB. The optimizer step is the same at every length (states + foreach
temporaries); the backward moment grows with batch x sequence, so at batch 2 the crossover
comes at about half the length. With a fused AdamW (optimizer_impl="fused") the optimizer step is
{fused_opt:.2f} GiB and the peak is in the {fused_phase} pass already at 512 tokens.""",
)
def _peak_moves_to_backward():
    from labkit.predict import estimate
    from labkit.predict.sweep import peak_leaves_optimizer

    def at(seq):
        return estimate("llama-2-7b", seq=seq, precision="bf16-mixed", device="cuda")
    seq = peak_leaves_optimizer("llama-2-7b", multiple=512, precision="bf16-mixed")
    assert at(seq).peak_phase == "backward"
    before, after = at(seq - 512).moments, at(seq).moments
    fused = estimate("llama-2-7b", seq=512, precision="bf16-mixed", optimizer_impl="fused",
                     device="cuda")
    return {"answer": seq, "before": seq - 512,
            "opt_before": before["optimizer step"] / GiB,
            "bwd_before": before["backward: start"] / GiB,
            "opt": after["optimizer step"] / GiB, "bwd": after["backward: start"] / GiB,
            "fused_opt": fused.moments["optimizer step"] / GiB, "fused_phase": fused.peak_phase}
