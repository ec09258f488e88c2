"""Auto-checked exercises, in the spirit of srush's LLM Training Puzzles: every answer is
computed by labkit, and ``check(id, answer)`` says at once whether yours is right.

    from labkit.exercises import check, solution
    check("01-adamw-bytes", 16)          # ✅ ... (a wrong answer shows a hint instead)
    solution("01-adamw-bytes")           # the worked solution, with labkit's numbers

A later lab adds its own with ``@register("05-...", question=..., unit=..., hint=...,
solution=...)`` on a function that returns ``{"answer": value, ...}``; the other names it
returns fill the ``{placeholders}`` of the solution text.
"""
from __future__ import annotations

import functools
import html
import math
import numbers
from dataclasses import dataclass
from typing import Callable

from .config import preset
from .layers import count_params
from .predict import kv_cache_bytes
from .papers import model_state_bytes
from .recipe import state_bytes

GiB = 2**30
BILLION = 10**9


@dataclass(frozen=True)
class Exercise:
    """One question; ``compute`` returns the answer (and the numbers its solution quotes)."""

    id: str
    question: str
    unit: str
    hint: str
    solution: str
    compute: Callable[[], dict]
    rtol: float = 0.01

    def answer(self) -> float:
        return self.compute()["answer"]


_REGISTRY: dict[str, Exercise] = {}


def register(id: str, *, question: str, unit: str, hint: str, solution: str, rtol: float = 0.01):
    """Decorator: add the exercise ``id`` whose decorated function computes the answer."""
    def add(compute: Callable[[], dict]) -> Callable[[], dict]:
        if id in _REGISTRY:
            raise ValueError(f"exercise {id!r} is already registered")
        _REGISTRY[id] = Exercise(id, question.strip(), unit, hint.strip(), solution.strip(),
                                 compute, rtol)
        return compute
    return add


def exercises(prefix: str = "") -> list[str]:
    """The exercise ids, in order; ``prefix="01"`` keeps one lab's."""
    return [i for i in _REGISTRY if i.startswith(prefix)]


def get(id: str) -> Exercise:
    """The exercise ``id``; an unknown id raises ValueError naming the known ones."""
    if id not in _REGISTRY:
        raise ValueError(f"unknown exercise {id!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[id]


def question(id: str) -> str:
    """The question, with the unit its answer is expected in."""
    return f"{get(id).question}\n(answer in {get(id).unit})"


def solution(id: str) -> str:
    """The worked solution, with the numbers labkit computes."""
    ex = get(id)
    return ex.solution.format(**ex.compute())


# ---- checking -------------------------------------------------------------------------------
@dataclass
class Result:
    """The verdict on one answer; the last expression of a cell shows it as one clear line."""

    correct: bool
    message: str
    hint: str = ""

    def __bool__(self):
        return self.correct

    def __repr__(self):
        return self.message + (f"\nHint: {self.hint}" if self.hint else "")

    def _repr_html_(self):
        hint = f"<br><i>Hint:</i> {html.escape(self.hint)}" if self.hint else ""
        message = html.escape(self.message).replace("\n", "<br>")
        return f"<p><b>{message}</b>{hint}</p>"


def _as_number(answer) -> float | None:
    """A finite float from an int, float, numpy/torch scalar or numeric string; else None."""
    if isinstance(answer, str):
        try:
            answer = float(answer.replace(",", "").replace("_", ""))
        except ValueError:
            return None
    elif not isinstance(answer, numbers.Real) and hasattr(answer, "item"):
        try:
            answer = answer.item()             # a one-element numpy array or torch tensor
        except (ValueError, RuntimeError):
            return None
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
        return None
    return float(answer) if math.isfinite(answer) else None


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:.6g}"


def check(id: str, answer) -> Result:
    """Is ``answer`` within the exercise's relative tolerance of labkit's value?"""
    ex = get(id)
    if answer is None:                         # the notebook's placeholder, not yet answered
        return Result(False, f"✏️ {id}: replace None with your answer.\n{question(id)}")
    given = _as_number(answer)
    if given is None:
        return Result(False, f"❌ {id}: expected one number (in {ex.unit}), got {answer!r} "
                             f"of type {type(answer).__name__}. Give just the number, e.g. 12.5.")
    expected = ex.answer()
    if abs(given - expected) <= ex.rtol * abs(expected) + 1e-12:
        return Result(True, f"✅ {id}: {_fmt(given)} {ex.unit} is right.")
    off = "too high" if given > expected else "too low"
    if expected and abs(given / expected - GiB / BILLION) < 0.01 * GiB / BILLION:
        off += "; it looks like GB (10^9 bytes): GiB is 2^30 bytes"
    return Result(False, f"❌ {id}: {_fmt(given)} {ex.unit} is {off}.", ex.hint)


# ---- lab 01: parameter memory --------------------------------------------------------------
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
times smaller is its KV cache per token than LLaMA-2-7B's (both bf16)?""",
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
    from .predict import estimate
    from .recipe import Layout
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
    from .measure import measure_step
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
    from .predict import estimate
    from .sweep import peak_leaves_optimizer

    def at(seq):
        return estimate("llama-2-7b", seq=seq, precision="bf16-mixed", device="cuda")
    seq = peak_leaves_optimizer("llama-2-7b", multiple=512, precision="bf16-mixed")
    assert at(seq).peak_phase == "backward"
    before, after = at(seq - 512).moments, at(seq).moments
    return {"answer": seq, "before": seq - 512,
            "opt_before": before["optimizer step"] / GiB, "bwd_before": before["backward: start"] / GiB,
            "opt": after["optimizer step"] / GiB, "bwd": after["backward: start"] / GiB}


# ---- lab 02: mixed precision -----------------------------------------------------------------
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
    question="""LLaMA-2-7B on one GPU (lk.estimate with device="cuda"), batch 1: from how many
tokens on does autocast (precision="bf16-mixed") bring the peak 25% below fp32's? Search over
seq with the estimate.""",
    unit="tokens", rtol=0.02,
    hint="Compare lk.estimate(..., precision='bf16-mixed').total with precision='fp32' while "
         "doubling seq, then halve the interval (the saving grows with the tokens once the "
         "backward pass sets the peak). A step of 512 tokens is close enough.",
    solution="""The smallest seq with 100 x peak <= 75 x fp32's peak (labkit.sweep.first, a
bisection over lk.estimate) is {answer:,} tokens: peak {peak} against
{fp32} in fp32, the peak at "{moment}". Below a few thousand tokens autocast saves nothing at
all: the optimizer step, where its states are fp32's, sets the peak.""",
)
def _mixed_saves_a_quarter():
    from .sweep import first, saving
    from .units import fmt_bytes

    def autocast(seq):
        return saving("llama-2-7b", 1, seq, {"precision": "bf16-mixed"}, {"precision": "fp32"})
    seq = first(lambda n: autocast(n).saves(25), 0, 2 ** 17)
    s = autocast(seq)
    return {"answer": seq, "peak": fmt_bytes(s.peak), "fp32": fmt_bytes(s.baseline_peak),
            "moment": s.moment}


@register(
    "02-half-inference-saving",
    question="""Predict, then measure: the course model `small` after model.half(), one forward
pass under torch.no_grad() that returns the logits, batch 2 x 256 tokens. What percentage of
the fp32 peak does it save? Measure with labkit.precision.inference_peak (half=True / False).""",
    unit="percent",
    hint="Which tensors of the forward pass are not in the weights' dtype after model.half()? "
         "Without the loss, hardly any: the logits are fp16 too.",
    solution="""fp32 peak {fp32} (weights {w32}), fp16 peak {fp16} (weights {w16}): {answer:.2f}%
saved. Everything the pass keeps at its peak, weights and logits, halves; a loss over fp32 logits
would not (section 7, claim 5).""",
)
def _half_inference_saving():
    from .precision import inference_peak
    from .units import fmt_bytes
    fp32, half = (inference_peak("small", 2, 256, half=h) for h in (False, True))
    return {"answer": 100 * (1 - half.peak / fp32.peak), "fp32": fmt_bytes(fp32.peak),
            "fp16": fmt_bytes(half.peak), "w32": fmt_bytes(fp32.weights),
            "w16": fmt_bytes(half.weights)}


# ---- lab 03: activations ---------------------------------------------------------------------
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
    from .predict import estimate
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
(lk.batching.pad_batches(docs, 4, pad_to=600).waste).""",
)
def _padding_waste():
    from .batching import make_documents, pad_batches
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
    from .predict import estimate
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
    from .predict import estimate
    from .sweep import peak_leaves_optimizer
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
    from .checkpointing import recompute_cost
    from .predict import estimate
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
    from .layers import block_weights
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
the varlen run keep at the end of the forward pass?""",
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
    from .batching import document_lengths, make_documents, pack_batches, packed_step_memory
    from .model import build_model
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


# ---- lab 04: data parallelism, ZeRO and FSDP ---------------------------------------------------
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
    question="""LLaMA-2-7B trains in fp32 with AdamW under DDP over 8 GPUs, 1 x 16 tokens per GPU
(CUDA defaults). How many GiB per GPU does `gradient_as_bucket_view=True` save at the peak?""",
    unit="GiB",
    hint="DDP's buckets hold a flat copy of every gradient for the whole run; with bucket views "
         "the .grad tensors are views of them instead of a second copy. Compare "
         "lk.estimate(..., layout=lk.Layout(dp=8, gradient_as_bucket_view=...)).",
    solution="""{answer:.2f} GiB: one fp32 copy of the gradients, 4 x {n:,} bytes. Peak per GPU
{off:.2f} GiB with DDP's default, {on:.2f} GiB with bucket views (during {phase}).""",
)
def _bucket_view_saves():
    from .predict import estimate
    from .recipe import Layout
    step = dict(batch=1, seq=16, precision="fp32")
    off, on = (estimate("llama-2-7b", **step, layout=Layout(dp=8, gradient_as_bucket_view=v))
               for v in (False, True))
    return {"answer": (off.total - on.total) / GiB, "n": count_params("llama-2-7b").total,
            "off": off.total / GiB, "on": on.total / GiB, "phase": on.peak_phase}


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
    from .predict import estimate
    from .recipe import Layout
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
    from .predict import estimate
    from .recipe import Layout

    def peak(dp):
        return estimate("llama-2-13b", 1, 4096, precision="bf16-master", recompute="full",
                        layout=Layout(dp=dp, zero_stage=3))
    dp = next(2**k for k in range(11) if peak(2**k).total <= 80 * GiB)
    n, e = count_params("llama-2-13b").total, peak(dp)
    alive = sorted(e.tensors, key=lambda t: -t.nbytes)[:5]
    return {"answer": dp, "peak": e.total / GiB, "phase": e.peak_phase, "fewer": dp // 2,
            "before": peak(max(1, dp // 2)).total / GiB, "n": n, "states": 16 * n / dp / GiB,
            "alive": "; ".join(f"{t.name} {t.nbytes / GiB:.1f} GiB" for t in alive)}


# ---- lab 05: tensor, pipeline and expert parallelism -------------------------------------------
@register(
    "05-tp8-param-share",
    question="""LLaMA-2-7B runs under tensor parallelism over 8 GPUs, as Megatron-LM splits it:
attention and MLP matrices by column or row, the embedding and the LM head by vocabulary, the
RMSNorm gains replicated on every GPU. What percentage of the model's parameters does one GPU
hold? Give four decimals.""",
    unit="percent", rtol=1e-5,
    hint="Every weight but the norm gains is cut in 8; each GPU keeps all the norm gains (hidden "
         "numbers per norm, two per layer plus the final one). Sum Weight.local(tp=8) over "
         "labkit.layers' embedding_weights, head_weights and block_weights.",
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
    from .layers import block_weights, embedding_weights, head_weights
    from .predict import estimate
    from .recipe import Layout
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
         "labkit.parallel.pipeline.in_flight(stage, p, m, schedule).",
    solution="""1F1B: stage s runs p - s forward passes before its first backward, then frees one
micro-batch for each it starts: stage 0 holds min(m, p) = {answer:g}, whatever m beyond p.
GPipe runs all forward passes first: {gpipe:g} in flight, {ratio:g}x as many
(in_flight(0, 8, 32, "gpipe")). For LLaMA-2-7B at 1 x 4096 tokens per micro-batch, stage 0's
{layers} layers save {per_mb:.2f} GiB per micro-batch (bf16-master, lk.layers.layer_saved):
{one_f_one_b:.1f} GiB under 1F1B, {all_forward:.1f} GiB under GPipe. The last stage holds
only 1 under 1F1B (in_flight(7, 8, 32) = {last:g}).""",
)
def _1f1b_in_flight():
    from .layers import layer_saved
    from .parallel.pipeline import in_flight, stage_layers
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
    from .papers import pipeline_bubble
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
    from .papers import pipeline_bubble
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
         "3 x hidden x moe_ffn. Check with labkit.parallel.expert.rank_params(cfg, 256).",
    solution="""{E} routed experts / 256 = {per_rank} per GPU in each of {layers} MoE layers, each
3 x {h} x {f} = {expert:,} parameters: {routed:,} = {answer:.2f} billion
(labkit.parallel.expert.rank_params). With mixed-precision AdamW (bf16-master, 16 bytes per
parameter) their model states take {routed_gib:.1f} GiB per GPU; the replicated rest
(attention, the {dense} dense MLPs, shared experts, routers, norms, embedding, head:
{replicated:.2f} billion) adds {replicated_gib:.1f} GiB. From ep = 64 on the replicated rest is most
of a GPU's model states, and no ep divides it: DeepSeek-V3 (on 80 GB H800s) pairs 64-way expert
parallelism with 16 pipeline stages, which split every layer's weights, and ZeRO-1.""",
)
def _v3_experts_per_gpu():
    from .parallel.expert import experts_per_rank, rank_params
    c = preset("deepseek-v3")
    routed, replicated = rank_params(c, 256)
    per_param = state_bytes("bf16-master", "adamw").total
    return {"answer": routed / BILLION, "E": c.routed_experts,
            "per_rank": experts_per_rank(c, 256), "layers": c.moe_layers, "h": c.hidden,
            "f": c.moe_ffn, "expert": 3 * c.hidden * c.moe_ffn, "routed": routed,
            "dense": c.dense_layers,
            "routed_gib": routed * per_param / GiB, "replicated": replicated / BILLION,
            "replicated_gib": replicated * per_param / GiB}


# ---- lab 06: quantisation, 8-bit optimizers, LoRA and QLoRA ------------------------------------
def _model_weights(c) -> list:
    """Every parameter tensor of the model ``c`` describes (``labkit.layers``), in model order."""
    from .layers import block_weights, embedding_weights, head_weights
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
         "per 64 weights, an fp32 scale per 64 x 256 weights. labkit.quant.nf4_bits_per_param.",
    solution="""4 + 8/64 + 32/(64 x 256) = {answer:.10g} bits per parameter (QLoRA's 4.127), against
4 + 32/64 = {plain:g} without double quantisation: the scales' overhead falls from {plain_over:.3f}
to {dq_over:.3f} bits (labkit.quant.nf4_bits_per_param(64, double_quant=...)).
LLaMA-2-7B's block linear weights ({n:,} numbers in {tensors} matrices, what
"all-linear" QLoRA quantises): {bf16:.2f} GiB in bf16, {plain_gib:.2f} GiB in NF4,
{answer_gib:.2f} GiB with double quantisation, {saved:.0f} MiB less.
lk.estimate(..., recipe=lk.Recipe("bf16-master", trainable="lora", weight_format="nf4")) holds
{est_bytes:,} bytes of them: the same, plus one fp32 mean of the scales per matrix.""",
)
def _nf4_bits():
    from .layers import lora_targets
    from .predict import estimate
    from .quant import nf4_bits_per_param
    from .recipe import Recipe
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
         "labkit.layers.lora_weights(cfg, False, 16) over the 32 layers and divide by "
         "lk.count_params('llama-2-7b').total.",
    solution="""Per layer, r x (in + out) over the {targets} targets: {per_layer:,} parameters at
rank 16 (a common PEFT setting); x {layers} layers = {trained:,} of {total:,} base parameters =
{answer:.2f}%. Rank 8 on wq and wv only (the LoRA paper's RoBERTa/DeBERTa setting; GPT-3 used
rank 4): {qv:,} = {qv_share:.3f}%; rank 64 on all-linear, QLoRA's own setting: {r64:,} =
{r64_share:.2f}%. Common advice says "LoRA trains 0.1-1% of the parameters" (claim 15): true of
rank-16 all-linear adapters and of attention-only ones, not of QLoRA's rank 64. The share is
r (in + out) / (in x out) per matrix, so it scales with the rank and the targets:
{qv_share:.3f}% to {r64_share:.2f}% in these three settings.""",
)
def _lora_share():
    from .layers import lora_targets, lora_weights
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
         "numbers. Sum labkit.optim8bit.state_bytes(w.numel) over labkit.layers' "
         "embedding_weights, head_weights and block_weights.",
    solution="""{tensors} parameter tensors; {small} of them are under {min8} numbers (a norm gain
holds {h}). Codes 2 x 1 byte + absmax 2 x 4/{block} bytes = {per:.6g} bytes per parameter:
{bytes:,} bytes = {answer:.2f} GiB, against fp32 AdamW's 8 bytes per parameter, {fp32:.2f} GiB
({ratio:.2f}x smaller). lk.estimate(..., precision="fp32", optimizer="adamw-8bit").optimizer adds
the two 256-value maps: {est:,} bytes. The moments are not the whole optimizer state under
mixed precision: with bf16-master the fp32 master weights stay, and the optimizer holds
{master:.2f} GiB ({fp32_master:.2f} GiB with fp32 AdamW).""",
)
def _adamw8bit_state():
    from . import optim8bit
    from .predict import estimate
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
master copies of the adapters (bf16-master), batch 1 x 2048 tokens, no recomputation. What is
the estimated peak memory of one training step? Give two decimals.""",
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
{bf16_params:.2f} to {params:.2f} GiB.""",
)
def _qlora_7b_peak():
    from .predict import estimate
    from .recipe import Recipe

    def step(trainable, weight_format=None):
        return estimate("llama-2-7b", 1, 2048,
                        recipe=Recipe("bf16-master", trainable=trainable,
                                      weight_format=weight_format))
    qlora, lora, full = step("lora", "nf4"), step("lora"), step("all")
    return {"answer": qlora.total / GiB, "phase": qlora.peak_phase, "params": qlora.params / GiB,
            "optimizer": qlora.optimizer / GiB, "acts": qlora.saved_activations / GiB,
            "lora": lora.total / GiB, "bf16_params": lora.params / GiB,
            "full": full.total / GiB, "full_phase": full.peak_phase,
            "full_opt": full.optimizer / GiB,
            "ratio": full.total / qlora.total}


# ---- lab 07: attention, the KV cache, MLA and a paged cache ------------------------------------
@register(
    "07-naive-attention-gib",
    question="""Naive attention writes softmax(q k^T / sqrt(d)) out for every head, a (B, H, T, T)
matrix, and autograd keeps it for the backward pass. Under bf16-mixed (autocast) it keeps the
softmax's fp32 output and the bf16 copy the next matmul makes of it: 4 + 2 = 6 bytes per
(query, key) pair and head. How many GiB of probabilities does one layer of LLaMA-2-7B keep at
batch 1 x 4096 tokens?""",
    unit="GiB",
    hint="B x H x T x T pairs of 6 bytes, with H = lk.preset('llama-2-7b').heads; "
         "labkit.layers.layer_saved(cfg, 'bf16-mixed', attention='naive') lists the term "
         "(.bytes(batch, seq)). 1 GiB = 2^30 bytes.",
    solution="""{heads} heads x 4096 x 4096 pairs x {per_pair:g} bytes = {bytes:,} bytes
= {answer:.2f} GiB per layer (labkit.layers.layer_saved(..., attention="naive")); x {layers}
layers = {all:.0f} GiB, beside the {states:.1f} GiB of its model states (AdamW). SDPA's fused
kernel (and labkit's tiled core) keeps instead q, k, v, the output and one fp32 log-sum-exp per
row and head: {sdpa_core:.0f} MiB per layer, against naive's {naive_core:,.0f} MiB (its
probabilities, q, the repeated k and v, wo's input).
lk.estimate("llama-2-7b", 1, 4096, precision="bf16-mixed", attention=...): saved activations
{saved_naive:.1f} GiB naive, {saved_sdpa:.1f} GiB with SDPA; the step's peak {peak_naive:.1f} GiB
naive (in the {phase_naive} phase), {peak_sdpa:.1f} GiB with SDPA (in the {phase_sdpa} phase).""",
)
def _naive_attention_gib():
    from .layers import layer_saved
    from .predict import estimate
    c, batch, seq = preset("llama-2-7b"), 1, 4096

    def core(attention):     # the attention core's terms: q/k/v/output, probabilities or lse
        return [t for t in layer_saved(c, "bf16-mixed", attention=attention)
                if t.name.startswith(("q, ", "attention "))]

    probs = next(t for t in core("naive") if t.per_pair)
    naive, sdpa = (estimate(c, batch, seq, precision="bf16-mixed", attention=a)
                   for a in ("naive", "sdpa"))
    per_layer = probs.bytes(batch, seq)
    return {"answer": per_layer / GiB, "heads": c.heads, "per_pair": probs.per_pair / c.heads,
            "bytes": per_layer, "layers": c.layers, "all": c.layers * per_layer / GiB,
            "states": model_state_bytes(count_params(c).total, "bf16-mixed", "adamw") / GiB,
            "sdpa_core": sum(t.bytes(batch, seq) for t in core("sdpa")) / 2**20,
            "naive_core": sum(t.bytes(batch, seq) for t in core("naive")) / 2**20,
            "saved_naive": naive.saved_activations / GiB,
            "saved_sdpa": sdpa.saved_activations / GiB,
            "peak_naive": naive.total / GiB, "phase_naive": naive.peak_phase,
            "peak_sdpa": sdpa.total / GiB, "phase_sdpa": sdpa.peak_phase}


@register(
    "07-kv-cache-70b",
    question="""LLaMA-2-70B caches a key and a value per layer, token and key/value head;
grouped-query attention (GQA) gives it 8 key/value heads for its 64 query heads. How many GiB
does its bf16 KV cache take for a batch of 8 sequences of 4096 tokens?""",
    unit="GiB",
    hint="Per token: 2 (K and V) x layers x kv_heads x head_dim numbers of 2 bytes; then x batch "
         "x tokens. Check with lk.kv_cache_bytes('llama-2-70b', batch=8, seq=4096).",
    solution="""per token: 2 x {layers} layers x {kv} kv heads x {d} dims x 2 bytes = {per:,} bytes;
x 8 x 4096 tokens = {bytes:,} bytes = {answer:.1f} GiB (lk.kv_cache_bytes). With multi-head
attention, one key/value head per query head (dataclasses.replace(cfg, kv_heads={heads})), the
same batch would cache {mha:.1f} GiB, {groups}x as much: GQA saves {saved:.1f} GiB
({saved_share:.1%}) of cache, beside the model's {weights:.1f} GiB of bf16 weights.""",
)
def _kv_cache_70b():
    from dataclasses import replace
    c, batch, seq = preset("llama-2-70b"), 8, 4096
    gqa = kv_cache_bytes(c, batch, seq, "bf16")
    mha = kv_cache_bytes(replace(c, kv_heads=c.heads), batch, seq, "bf16")
    return {"answer": gqa / GiB, "bytes": gqa, "per": gqa // (batch * seq),
            "layers": c.layers, "kv": c.kv_heads, "d": c.head_dim, "heads": c.heads,
            "mha": mha / GiB, "groups": c.heads // c.kv_heads, "saved": (mha - gqa) / GiB,
            "saved_share": 1 - gqa / mha, "weights": 2 * count_params(c).total / GiB}


@register(
    "07-mla-bytes-per-token",
    question="""DeepSeek-V2's multi-head latent attention (MLA) caches, per token and layer, one
compressed latent of kv_lora_rank numbers and one RoPE key of qk_rope_dim numbers shared by
all heads. How many bytes does one token's cache take, over all of its layers, in bf16?""",
    unit="bytes per token", rtol=0,
    hint="(kv_lora_rank + qk_rope_dim) x layers x 2 bytes, from lk.preset('deepseek-v2'); "
         "check with lk.kv_cache_bytes('deepseek-v2', seq=1).",
    solution="""({r} + {rope}) x {layers} layers x 2 bytes = {answer:,} bytes per token
(lk.kv_cache_bytes("deepseek-v2", seq=1)). Multi-head attention with the same {heads} heads of
d_h = {d} caches 2 x {heads} x {d} = {mha_per_layer:,} numbers per layer: {mha:,} bytes per token,
{ratio:.1f}x as much; MLA saves {saved:.1%} (labkit.generate.mla_reduction("deepseek-v2")). In
the paper's units MLA caches {in_head_dims} d_h per layer, as much as GQA with {groups:g}
groups. One sequence of {seq} tokens: {mla_seq:.2f} GiB with MLA, {mha_seq:.1f} GiB with MHA.""",
)
def _mla_bytes_per_token():
    from .generate import mla_reduction
    c, r = preset("deepseek-v2"), mla_reduction("deepseek-v2")
    per_token = kv_cache_bytes(c, seq=1, dtype="bf16")
    mha = per_token * r.mha_per_layer // r.mla_per_layer     # same layers, same format
    return {"answer": per_token, "r": r.latent, "rope": r.rope_key, "layers": r.layers,
            "heads": r.heads, "d": r.head_dim, "mha_per_layer": r.mha_per_layer, "mha": mha,
            "ratio": r.ratio, "saved": r.saved, "in_head_dims": str(r.in_head_dims),
            "groups": float(r.gqa_groups), "seq": c.max_seq,
            "mla_seq": c.max_seq * per_token / GiB, "mha_seq": c.max_seq * mha / GiB}


@register(
    "07-paged-waste",
    question="""A paged KV cache (PagedAttention, the vLLM paper) hands LLaMA-2-13B's fp16 cache
out in blocks of 16 tokens, so a request wastes at most the empty slots of its last block. How
many MiB can one request waste at most? (A server that reserves a contiguous slab of 2048
tokens per request wastes far more: the solution compares a request that stops at 300
tokens.) Give two decimals.""",
    unit="MiB", rtol=1e-3,
    hint="The worst last block holds one token and 15 empty slots; one token takes "
         "lk.kv_cache_bytes('llama-2-13b', seq=1, dtype='fp16') bytes over all layers. "
         "1 MiB = 2^20 bytes. labkit.paged.make_cache('paged', ...) measures it: "
         ".fragmentation_bytes.",
    solution="""one token of LLaMA-2-13B: 2 x {layers} layers x {kv} heads x {d} dims x 2 bytes =
{per:,} bytes; at most {block} - 1 = {slack} empty slots: {waste:,} bytes = {answer:.2f} MiB
(a PagedKVCache one token into its last block: fragmentation_bytes = {measured:,}). The
300-token request holds {blocks} blocks, {paged_used:g} MiB of them empty. A contiguous
slab of {max_seq} tokens reserves {slab:,.0f} MiB for it and fills {used:.0f} MiB: {contiguous:,.0f}
MiB ({contiguous_share:.0%}) empty, {ratio:.0f}x the paged worst case
(labkit.paged.make_cache(kind, ...) on the meta device).""",
)
def _paged_waste():
    from .paged import make_cache
    c, block, max_seq, used = preset("llama-2-13b"), 16, 2048, 300
    per = kv_cache_bytes(c, seq=1, dtype="fp16")                # one token, all layers

    def cache_after(kind, tokens):
        cache = make_cache(kind, kv_cache_bytes(c, seq=max_seq, dtype="fp16"), c,
                           block_size=block, max_seq=max_seq, dtype="fp16")
        cache.admit("request")
        cache.grow("request", tokens)
        return cache

    waste = (block - 1) * per
    paged, slab = cache_after("paged", used), cache_after("contiguous", used)
    MiB = 2**20
    return {"answer": waste / MiB, "layers": c.layers, "kv": c.kv_heads, "d": c.head_dim,
            "per": per, "block": block, "slack": block - 1, "waste": waste,
            "measured": cache_after("paged", block + 1).fragmentation_bytes,
            "blocks": paged.blocks_for(used), "paged_used": paged.fragmentation_bytes / MiB,
            "max_seq": max_seq, "slab": slab.reserved_bytes / MiB, "used": slab.used_bytes / MiB,
            "contiguous": slab.fragmentation_bytes / MiB,
            "contiguous_share": slab.fragmentation_bytes / slab.reserved_bytes,
            "ratio": slab.fragmentation_bytes / waste}


# ---- lab 08: the host and the caching allocator ---------------------------------------------
@register(
    "08-shm-image-loader",
    question="""A DataLoader with 8 workers and prefetch_factor=2 yields batches of 64 images,
3 x 224 x 224 in fp32. How many MiB of /dev/shm do its batches take at most, by the lab's
formula (an upper bound: batches in flight plus two the loop may hold, each in whole 4 KiB
pages)? Give one decimal; the solution says whether Docker's default /dev/shm holds them.""",
    unit="MiB", rtol=1e-3,
    hint="In flight: num_workers x prefetch_factor; the loop holds up to two more. "
         "labkit.shm.shm_needed(batch_bytes, num_workers, prefetch_factor).",
    solution="""one batch is 64 x 3 x 224 x 224 x 4 B = {batch:,} B ({pages:,} pages of 4 KiB);
{workers} workers x prefetch {prefetch} = {in_flight} in flight, plus 2 held by the loop: {alive}
batches, {needed:,} B = {answer:.1f} MiB (labkit.shm.shm_needed): it does not fit Docker's
default 64 MiB ({times:.1f}x). A safe flag for one rank: ``{flag}`` (labkit.shm.docker_shm_flag:
twice the need, as a power of two); with N ranks in the container pass ranks=N, and nccl=True
when they talk over NCCL.""",
)
def _shm_image_loader():
    from .shm import batches_alive, batch_shm_bytes, docker_shm_flag, shm_needed
    batch, workers, prefetch = 64 * 3 * 224 * 224 * 4, 8, 2
    needed = shm_needed(batch, workers, prefetch)
    MiB = 2**20
    return {"answer": needed / MiB, "batch": batch, "pages": batch_shm_bytes(batch) // 4096,
            "workers": workers, "prefetch": prefetch, "in_flight": workers * prefetch,
            "alive": batches_alive(workers, prefetch), "needed": needed,
            "times": needed / (64 * MiB), "flag": docker_shm_flag(needed)}


@register(
    "08-small-pool-tensors",
    question="""How many tensors of 100,000 bytes each does PyTorch's CUDA caching allocator fit
into one segment of its small pool before it must reserve a second one?""",
    unit="tensors", rtol=0,
    hint="Requests of at most 1 MiB share 2 MiB segments; each is first rounded up to a multiple "
         "of 512 bytes (labkit.allocator.round_size).",
    solution="""100,000 B rounds up to {rounded:,} B (a multiple of 512); a small-pool segment is
{segment:,} B, so {answer} fit ({left:,} B stay free). labkit.allocator.CachingAllocator
reserves its second segment at tensor {second}.""",
)
def _small_pool_tensors():
    from .allocator import CachingAllocator, kSmallBuffer, round_size
    alloc, n = CachingAllocator(record_trace=False), 0
    while alloc.stats().reserved_bytes <= kSmallBuffer:
        alloc.malloc(100_000, n)
        n += 1
    rounded = round_size(100_000)
    return {"answer": n - 1, "rounded": rounded, "segment": kSmallBuffer,
            "left": kSmallBuffer - (n - 1) * rounded, "second": n}


@register(
    "08-reserved-three-tensors",
    question="""A fresh caching allocator is asked for tensors of 3 MiB, 7 MiB and 11 MiB, in
that order, none of them freed. How many MiB does it reserve from the GPU?""",
    unit="MiB", rtol=0,
    hint="A request between 1 and 10 MiB that finds no free block takes a 20 MiB segment and "
         "splits it; a later request takes the smallest free block that fits; a larger one "
         "gets its own segment, rounded up to 2 MiB.",
    solution="""3 MiB: no free block, a new {first} MiB segment, split ({rest1} MiB free); 7 MiB:
the best fit is that remainder, split again ({rest2} MiB free); 11 MiB: nothing fits, a new
segment of 11 MiB rounded up to 2 MiB = {third} MiB. Reserved: {answer:g} MiB for {used} MiB of
tensors (labkit.allocator.CachingAllocator).""",
)
def _reserved_three_tensors():
    from .allocator import CachingAllocator
    MiB, alloc, reserved = 2**20, CachingAllocator(record_trace=False), []
    for i, size in enumerate((3, 7, 11)):
        alloc.malloc(size * MiB, i)
        reserved.append(alloc.stats().reserved_bytes // MiB)
    return {"answer": reserved[-1], "first": reserved[0], "rest1": reserved[0] - 3,
            "rest2": reserved[0] - 10, "third": reserved[2] - reserved[1], "used": 21}


@register(
    "08-pinned-staging-buffer",
    question="""You allocate a 600 MiB staging buffer with torch.empty(..., pin_memory=True) on a
CUDA machine. How many MiB of page-locked host memory does PyTorch's pinned-memory cache take
for it?""",
    unit="MiB", rtol=0,
    hint="By default the pinned (host) caching allocator rounds each request up to a power of "
         "two (labkit.pinned.pinned_host_bytes).",
    solution="""600 MiB rounds up to the next power of two, {answer:g} MiB
(CachingHostAllocator: c10::llvm::PowerOf2Ceil), {extra:g} MiB more than asked. Freed, the
block stays cached for the next request that fits until torch.accelerator.empty_host_cache()
(torch.cuda.host_memory_stats() counts the rounded bytes).""",
)
def _pinned_staging_buffer():
    from .pinned import pinned_host_bytes
    MiB = 2**20
    pinned = pinned_host_bytes(600 * MiB) // MiB
    return {"answer": pinned, "extra": pinned - 600}


# ---- lab 09: the planner ------------------------------------------------------------------------
@register(
    "09-fewest-a100s-7b",
    question="""Full fine-tuning of LLaMA-2-7B (bf16 weights and gradients, fp32 master weights
and AdamW state), sequences of 4096 tokens, one sequence per GPU per step, no offload: on how
few A100-80GB GPUs (1, 2, 4, 8, ...) does the planner find a layout that fits its usable
memory (the card less 10% headroom)?""",
    unit="GPUs", rtol=0,
    hint="First the paper bound: the states take 16 bytes per parameter, and ZeRO or tensor "
         "parallelism splits them; then ask labkit.plan.plan(..., offload=False) whether that "
         "many GPUs also hold the activations.",
    solution="""the model states alone are 16 B x {params:,} = {states:.1f} GiB, more than the
{usable:.1f} GiB one card may use, so at least two GPUs are needed. On {answer} GPUs the
fastest layout that fits is "{best}" at {total:.1f} GiB per GPU
(labkit.plan.plan(..., offload=False)).""",
)
def _fewest_a100s_7b():
    from .plan import plan
    GiB_, n = 2**30, 1
    while not (p := plan("llama-2-7b", "a100-80gb", n, seq=4096, offload=False, top=1)).fits:
        n *= 2
    params = count_params("llama-2-7b").total
    best = p.fits[0]
    return {"answer": n, "params": params, "states": 16 * params / GiB_,
            "usable": p.usable / GiB_, "best": best.label(), "total": best.estimate.total / GiB_}
