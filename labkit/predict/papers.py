"""The papers' own formulas, for any size, used to reproduce their tables.

ZeRO (Rajbhandari et al., 2020) for model states; Korthikanti et al., 2022 for activations;
Megatron-LM (Narayanan et al., 2021) for the pipeline bubble and the GPT parameter count.
"""
from __future__ import annotations

from fractions import Fraction

from labkit.core.recipe import OPTIMIZERS, PRECISIONS, SCHEDULES, V_SCHEDULES, state_bytes
from labkit.core.units import check_choice
from labkit.parallel.data import zero

# Korthikanti et al.'s policies. Their "selective" recomputes the attention core (softmax,
# dropout, the attention matrix); labkit's "selective" (``labkit.transformer.checkpointing``)
# is op-level.
RECOMPUTE = ("none", "attention-core", "full")


def _check_int(name, value, low=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        kind = "positive" if low == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}")


def model_state_bytes(n_params, precision="bf16-master", optimizer="adamw", zero_stage=0, dp=1) -> int:
    """Per-device bytes of params + grads + optimizer states (ZeRO, section 3 and Table 1), with
    the course's precision names (``labkit.core.recipe``): the paper's "mixed precision" is
    ``bf16-master`` / ``fp16-master``, 2 + 2 + 12 bytes with Adam; ``bf16-mixed`` (autocast)
    is 4 + 4 + 8. Stage 1/2/3 shards optimizer/+grads/+params over dp."""
    if isinstance(n_params, float) and n_params.is_integer():
        n_params = int(n_params)                    # 7.5e9, as the paper writes it
    _check_int("n_params", n_params, low=0)
    _check_int("dp", dp)
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)} "
                         f"(the ZeRO paper's mixed precision is 'bf16-master')")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if type(zero_stage) is not int or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {zero_stage!r}")
    b = state_bytes(precision, optimizer)
    return sum(zero.per_rank(n_params * per_param, state, zero_stage, dp)
               for state, per_param in (("params", b.weights), ("grads", b.grads),
                                        ("optimizer", b.optimizer)))


def megatron_activation_bytes(seq, batch, hidden, heads, layers=1, tp=1, sp=False, recompute="none") -> int:
    """fp16 activation bytes of ``layers`` layers (Korthikanti et al., 2022, Table 2): per layer
    sbh(10 + 24/t + 5as/(ht)), 34/t with sp; recomputing the attention core (their "selective",
    ``recompute="attention-core"``) drops 5as/(ht); "full" keeps 2sbh (/t with sp)."""
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads),
                        ("layers", layers), ("tp", tp)):
        _check_int(name, value)
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r} for Korthikanti et al.'s formula; use "
                         f"one of {', '.join(RECOMPUTE)} (their 'selective' is 'attention-core')")
    if heads % tp:
        raise ValueError(f"tp={tp} does not divide heads={heads}; choose tp among the divisors of {heads}")
    s, b, h, a, t = seq, batch, hidden, heads, Fraction(tp)
    if recompute == "full":
        per_token = 2 / t if sp else Fraction(2)
    else:
        per_token = 34 / t if sp else 10 + 24 / t
        if recompute == "none":
            per_token += Fraction(5 * a * s, h) / t
    return round(s * b * h * per_token * layers)


def pipeline_bubble(p, m, schedule="1f1b", v=1) -> float:
    """Fraction of the schedule a device idles: (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v*m+p-1)
    interleaved, (p-1)/(3m+p-1) for ZB-H1 (Qi et al., 2023; forward, input-gradient and
    weight-gradient passes of equal time, m >= p); in a V of two chunks a stage, ZB-V
    (p-1)/(6m+p-1) (torch's order, m >= 2p) and DualPipeV by DeepSeek's formula (its pairs
    hiding no communication: ZB-H1's). Papers often quote the ratio (p-1)/m, bubble over
    ideal time: ``pipeline_bubble_ratio``."""
    _check_pipeline(p, m, schedule, v)
    return (p - 1) / (_ideal(m, schedule, v) + p - 1)


def pipeline_bubble_ratio(p, m, schedule="1f1b", v=1) -> float:
    """Bubble time over ideal time (Narayanan et al., 2021): (p-1)/m, (p-1)/(v*m) interleaved,
    (p-1)/(3m) ZB-H1."""
    _check_pipeline(p, m, schedule, v)
    return (p - 1) / _ideal(m, schedule, v)


def _ideal(m, schedule, v):
    """A stage's busy time in units of its bubble per step of the pipeline's depth: m
    micro-batches, v m chunks interleaved; ZB-H1 fills two thirds of each such gap (F = B = W),
    ZB-V five sixths (its chunks are half a stage)."""
    return {"zb-h1": 3 * m, "dualpipe-v": 3 * m, "zb-v": 6 * m}.get(schedule, v * m)


def _check_pipeline(p, m, schedule, v):
    _check_int("p", p)
    _check_int("m", m)
    _check_int("v", v)
    check_choice("schedule", schedule, SCHEDULES)
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"v={v} virtual stages needs schedule='interleaved'; use v=1 with {schedule!r}")
    if schedule in V_SCHEDULES and m < 2 * p:
        raise ValueError(f"{schedule}'s closed form holds from m = 2p = {2 * p} micro-batches; "
                         f"for m={m} simulate torch's order (labkit.parallel.pipeline.torch_orders)")


def megatron_params(layers, hidden, vocab, seq) -> int:
    """GPT parameter count (Megatron-LM, Narayanan et al., 2021, section 5.1):
    P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh)) = 12lh^2 + 13lh + (V+s)h."""
    for name, value in (("layers", layers), ("hidden", hidden), ("vocab", vocab), ("seq", seq)):
        _check_int(name, value)
    return 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq) * hidden
