"""Lab 01's exercises: parameter memory."""
from __future__ import annotations

from labkit.core.config import preset
from labkit.core.recipe import state_bytes
from labkit.course.exercises.core import GiB, register
from labkit.predict.layers import count_params
from labkit.predict.papers import model_state_bytes


@register(
    "01-foreach-over-for-loop",
    question="""Predict, then measure. The course model `small` trains in fp32 with AdamW at batch
1 x 256 tokens. PyTorch's for-loop AdamW makes two fp32 temporaries the size of the largest
weight at a time; `foreach` makes one fp32 temporary the size of every weight at once (sqrt(v)).
At 64 tokens the optimizer step sets both peaks (section 2). How many bytes higher is the
foreach step's peak than the for-loop's at 256 tokens? Predict: for each implementation,
lk.estimate("small", seq=256, precision="fp32", optimizer_impl=impl, device="cpu").moments
lists the candidate moments; the peak is the largest. Then measure both:
lk.measure_step("small", seq=256, precision="fp32", optimizer_impl=impl, fake=False,
device="cpu").total""",
    unit="bytes", rtol=1e-4,
    hint="Only the optimizer step differs between the two (foreach: 4 bytes x every parameter; "
         "for-loop: 2 x 4 bytes x the largest weight). The forward and backward moments grow "
         "with the tokens: check whether the start of the backward pass overtakes one step, both "
         "or neither, then subtract the two peaks.",
    solution="""Predicted (lk.estimate's moments at {seq} tokens): foreach peaks at "{foreach_moment}"
({foreach_pred:,} bytes), the for-loop at "{forloop_moment}" ({forloop_pred:,} bytes):
{predicted:,} bytes apart. The start of the backward pass ({bwd:,} bytes) lies above the
for-loop's optimizer step ({forloop_step:,}) and below foreach's ({foreach_step:,}), so only
part of the optimizer steps' gap ({step_gap:,} bytes, {step_gap_per:.2f} per parameter: 4 less
two copies of the largest weight) shows in the peaks.
Measured: {foreach_peak:,} bytes during {foreach_phase} - {forloop_peak:,} during {forloop_phase}
= {answer:,} bytes ({per:.2f} per parameter), {residual} bytes under the prediction: the loss's
4-byte scalar, which the estimate leaves out (section 5). From {zero_from} tokens on the backward
pass sets both peaks and the difference is 0: a for-loop run undercounts a foreach step only
where the optimizer step is the peak.""",
)
def _foreach_over_for_loop():
    from labkit.predict import estimate
    from labkit.training.measure import measure_step
    seq, n = 256, count_params("small").total

    def est(impl, s=seq):
        return estimate("small", seq=s, precision="fp32", optimizer_impl=impl, device="cpu")
    e = {impl: est(impl) for impl in ("foreach", "for-loop")}
    top = {impl: max(x.moments, key=x.moments.get) for impl, x in e.items()}
    peaks = {impl: measure_step("small", seq=seq, precision="fp32", optimizer_impl=impl,
                                fake=True, device="cpu") for impl in ("foreach", "for-loop")}
    assert (peaks["foreach"].peak_phase, peaks["for-loop"].peak_phase) == ("optimizer", "backward")
    answer = peaks["foreach"].total - peaks["for-loop"].total
    predicted = e["foreach"].total - e["for-loop"].total
    step = {impl: x.moments["optimizer step"] for impl, x in e.items()}
    assert step["for-loop"] < e["foreach"].moments["backward: start"] < step["foreach"]
    zero_from = next(s for s in range(seq, 4097, 64)                 # backward sets both peaks
                     if est("foreach", s).total == est("for-loop", s).total)
    return {"answer": answer, "seq": seq, "foreach_moment": top["foreach"],
            "foreach_pred": e["foreach"].total, "forloop_moment": top["for-loop"],
            "forloop_pred": e["for-loop"].total, "predicted": predicted,
            "bwd": e["foreach"].moments["backward: start"], "forloop_step": step["for-loop"],
            "foreach_step": step["foreach"], "step_gap": step["foreach"] - step["for-loop"],
            "step_gap_per": (step["foreach"] - step["for-loop"]) / n,
            "foreach_peak": peaks["foreach"].total, "foreach_phase": peaks["foreach"].peak_phase,
            "forloop_peak": peaks["for-loop"].total, "forloop_phase": peaks["for-loop"].peak_phase,
            "per": answer / n, "residual": predicted - answer, "zero_from": zero_from}


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


def _zero_grad_placement_peaks(seq: int, impl: str = "fused") -> tuple:
    """Peaks of one real fp32 step of `small` on CPU: zero_grad right after step() (train_step),
    then zero_grad between forward and backward (Lightning's automatic optimization), with
    their phases."""
    import torch
    from labkit.training.measure import init_optimizer_state
    from labkit.training.step import make_optimizer, train_step
    from labkit.training.track import MemoryTracker
    from labkit.transformer.model import build_model
    torch.manual_seed(0)
    model = build_model(preset("small"))
    opt = make_optimizer(model.parameters(), "adamw", impl)
    init_optimizer_state(model, opt)
    ids = torch.randint(0, model.cfg.vocab_size, (1, seq + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    with MemoryTracker(model, opt) as usual:
        train_step(model, opt, x, y, tracker=usual)
    model(x, y).backward()                 # a step of that loop leaves its gradients
    opt.step()
    with MemoryTracker(model, opt) as late:
        with late.phase("forward"):
            loss = model(x, y)
        with late.phase("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with late.phase("optimizer"):
            opt.step()
    return usual.peak, usual.peak_phase, late.peak, late.peak_phase


@register(
    "01-zero-grad-placement",
    question="""Measure it. The course model `small` trains in fp32 with fused AdamW
(optimizer_impl "fused") at batch 1 x 256 tokens. Run one step with train_step (zero_grad
right after step()) and one with late_zero_grad_step from section 5 (zero_grad between forward
and backward), each under lk.MemoryTracker(model, opt), as section 5 does. How many bytes higher
is the late zero_grad's peak?""",
    unit="bytes", rtol=0.001,
    hint="Copy section 5's cell with seq=256 and impl=\"fused\"; the answer is late.peak - "
         "usual.peak. To predict it: lk.estimate(...).moments[\"forward: loss\"] plus 4 bytes of "
         "fp32 gradient per parameter, against the estimate's peak.",
    solution="""zero_grad right after step(): peak {usual:,} bytes, during {usual_phase}.
zero_grad just before backward(): peak {late:,} bytes, during {late_phase}: last step's
gradients ({grads:,} bytes, 4 per parameter) sit under the whole forward pass.
Difference: {answer:,} bytes. Predicted from lk.estimate: the end of the forward pass
({forward:,} bytes) + the gradients = {predicted:,} bytes, against its peak of {estimated:,}
bytes with the gradients freed: {predicted_gap:,} bytes apart. (Each measured peak holds 4 bytes
more than its estimate: the loss's total_weight.)""",
)
def _zero_grad_placement():
    from labkit.predict import estimate
    usual, usual_phase, late, late_phase = _zero_grad_placement_peaks(256, "fused")
    n = count_params("small").total
    grads = state_bytes("fp32").grads * n
    e = estimate("small", seq=256, precision="fp32", optimizer_impl="fused", device="cpu")
    predicted = max(e.total, e.moments["forward: loss"] + grads)
    return {"answer": late - usual, "usual": usual, "usual_phase": usual_phase, "late": late,
            "late_phase": late_phase, "grads": grads, "forward": e.moments["forward: loss"],
            "predicted": predicted, "estimated": e.total, "predicted_gap": predicted - e.total}


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
    "01-first-step-peak",
    question="""Predict, then measure. The course model `small` trains in fp32 with the for-loop
AdamW at batch 1 x 256 tokens. Its first step has no AdamW state until step() makes it; every
later step carries the moments (8 bytes per parameter) through its forward and backward passes.
How many bytes higher is a later step's peak than the first step's? Predict from
lk.estimate("small", seq=256, precision="fp32", optimizer_impl="for-loop", device="cpu").moments,
then measure: lk.measure_step("small", seq=256, precision="fp32", optimizer_impl="for-loop",
fake=False, device="cpu", warmup=False) is the first step, the same without warmup=False a later one.""",
    unit="bytes", rtol=0.001,
    hint="A first step's forward and backward moments are the estimate's minus the moments' 8 "
         "bytes per parameter; its optimizer step is the same. Each peak is the largest moment.",
    solution="""Predicted: a later step peaks at "{later_moment}" ({later_pred:,} bytes); the first
step's forward and backward moments lack the {moments:,} bytes of m and v, so its largest is
"{first_moment}" ({first_pred:,} bytes): {predicted:,} bytes apart.
Measured: first step {first:,} bytes during {first_phase}, a later step {later:,} bytes during
{later_phase}: {answer:,} bytes. A run that survives its first step at this length can still run
out of memory in its second.""",
)
def _first_step_peak():
    from labkit.predict import estimate
    from labkit.training.measure import measure_step
    kw = dict(seq=256, precision="fp32", optimizer_impl="for-loop", device="cpu")
    e = estimate("small", **kw)
    moments = 8 * count_params("small").total                        # AdamW's fp32 m and v
    first_moments = {k: v if k == "optimizer step" else v - moments for k, v in e.moments.items()}
    first_moment = max(first_moments, key=first_moments.get)
    later_moment = max(e.moments, key=e.moments.get)
    first, later = (measure_step("small", fake=True, warmup=w, **kw) for w in (False, True))
    return {"answer": later.total - first.total, "moments": moments,
            "first_moment": first_moment, "first_pred": first_moments[first_moment],
            "later_moment": later_moment, "later_pred": e.moments[later_moment],
            "predicted": e.moments[later_moment] - first_moments[first_moment],
            "first": first.total, "first_phase": first.peak_phase,
            "later": later.total, "later_phase": later.peak_phase}


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
momentum at batch 1 x 64 tokens. SGD keeps one fp32 momentum buffer per parameter and makes no
temporaries in its step. What is the measured peak of one step, in bytes? Predict the states
(weights, gradients, momentum) from lk.count_params("small"), then what else is alive at each
moment: lk.estimate("small", seq=64, precision="fp32", optimizer="sgd-momentum",
device="cpu").moments. Then measure:
m = lk.measure_step("small", seq=64, precision="fp32", optimizer="sgd-momentum", fake=False)
and read m.total (m.peak_phase says when).""",
    unit="bytes", rtol=0.001,
    hint="4 + 4 + 4 bytes per parameter is only the states. The optimizer step and the end of "
         "the backward pass both hold all of them plus a little more: take the largest of the "
         "estimate's moments, then measure.",
    solution="""States: {n:,} parameters x (4 weight + 4 gradient + 4 momentum) = {states:,} bytes.
lk.estimate's two largest moments: "{top}" {top_pred:,} bytes and "{second}" {second_pred:,}
bytes, {gap:,} apart: with no temporaries in SGD's step the two almost tie.
Measured: peak {answer:,} bytes ({per:.2f} per parameter) during {phase}, {above_est} bytes above
the estimate (a 4-byte scalar it leaves out, as in section 5).
Weights + momentum at the peak: {params:,} + {optimizer:,} = {measured:,} bytes = 8 x {n:,}:
{equal}. Beside them, in the estimate: {terms}.
The states are the floor; the peak holds {extra:,} bytes more (labkit's RoPE tables and the
gradients in flight).""",
)
def _sgd_momentum_small():
    from labkit.predict import estimate
    from labkit.training.measure import measure_step
    n = count_params("small").total
    b = state_bytes("fp32", "sgd-momentum")
    m = measure_step("small", seq=64, precision="fp32", optimizer="sgd-momentum", fake=True)
    e = estimate("small", seq=64, precision="fp32", optimizer="sgd-momentum", device="cpu")
    top, second = sorted(e.moments, key=e.moments.get, reverse=True)[:2]
    states = n * (b.weights + b.grads + b.optimizer)
    return {"answer": m.total, "n": n, "states": states, "top": top, "second": second,
            "top_pred": e.moments[top], "second_pred": e.moments[second],
            "gap": e.moments[top] - e.moments[second], "per": m.total / n, "phase": m.peak_phase,
            "above_est": m.total - e.total,
            "terms": "; ".join(f"{t.name} {t.nbytes:,}" for t in e.tensors
                               if t.nbytes and t.category not in ("params", "optimizer")),
            "params": m.params, "optimizer": m.optimizer, "measured": m.params + m.optimizer,
            "equal": "equal" if m.params + m.optimizer == n * (b.weights + b.optimizer) else "NOT equal",
            "extra": m.total - states}


@register(
    "01-peak-moves-to-backward",
    question="""LLaMA-2-7B, bf16-mixed, batch 1, plain torch.optim.AdamW on CUDA (its default
there: foreach), gradients freed right after step() (as lk.estimate assumes, and labkit's
train_step and Hugging Face's Trainer do), labkit's default attention core (SDPA, which keeps
no (T, T) scores): at short sequences the optimizer step sets the peak.
From which sequence length, in steps of 512 tokens, does the start of the backward pass take
over? Sweep lk.estimate(..., seq=s, device="cuda").peak_phase.""",
    unit="tokens", rtol=0,
    hint="Loop s over 512, 1024, 1536, ... and stop at the first estimate whose peak_phase is "
         "'backward'; .moments shows both candidates.",
    solution="""at {before} tokens: optimizer step {opt_before:.2f} GiB, start of backward
{bwd_before:.2f} GiB; at {answer} tokens: optimizer step {opt:.2f} GiB, start of backward
{bwd:.2f} GiB. The optimizer step is the same at every length (states + foreach
temporaries); the backward moment grows with batch x sequence, so at batch 2 the crossover
comes at about half the length. With a fused AdamW (optimizer_impl="fused") the optimizer step is
{fused_opt:.2f} GiB and the peak is in the {fused_phase} pass already at 512 tokens.
All of this with the gradients freed right after step(). A loop that calls zero_grad() between
forward and backward keeps them ({grads:.2f} GiB) under the next forward pass, whose end then
overtakes the foreach optimizer step already at {late:,} tokens.""",
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
    grads = state_bytes("bf16-mixed").grads * count_params("llama-2-7b").total   # fp32 .grad
    late = next(s for s in range(512, seq + 1, 512)      # zero_grad before backward: end of
                if at(s).moments["forward: loss"] + grads > at(s).moments["optimizer step"])
    return {"answer": seq, "before": seq - 512,
            "opt_before": before["optimizer step"] / GiB,
            "bwd_before": before["backward: start"] / GiB,
            "opt": after["optimizer step"] / GiB, "bwd": after["backward: start"] / GiB,
            "fused_opt": fused.moments["optimizer step"] / GiB, "fused_phase": fused.peak_phase,
            "grads": grads / GiB, "late": late}
