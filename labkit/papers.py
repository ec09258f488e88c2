"""The papers' own formulas, for any size, used to reproduce their tables.

ZeRO (Rajbhandari et al., 2020) for model states; Korthikanti et al., 2022 for activations;
Megatron-LM (Narayanan et al., 2021) for the pipeline bubble and the GPT parameter count.
"""
from __future__ import annotations

from fractions import Fraction

from .units import check_choice

# bytes per parameter of (params, grads, optimizer states) for each precision and optimizer;
# the mixed-precision optimizer states hold the fp32 master copy (ZeRO section 3: K = 12 for Adam)
STATE_BYTES = {
    "bf16-mixed": {"adamw": (2, 2, 12), "sgd": (2, 2, 4), "sgd-momentum": (2, 2, 8), "adamw-8bit": (2, 2, 6)},
    "fp16-mixed": {"adamw": (2, 2, 12), "sgd": (2, 2, 4), "sgd-momentum": (2, 2, 8), "adamw-8bit": (2, 2, 6)},
    "fp32": {"adamw": (4, 4, 8), "sgd": (4, 4, 0), "sgd-momentum": (4, 4, 4), "adamw-8bit": (4, 4, 2)},
    "bf16": {"adamw": (2, 2, 4), "sgd": (2, 2, 0), "sgd-momentum": (2, 2, 2), "adamw-8bit": (2, 2, 2)},
}
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _check_int(name, value, low=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        kind = "positive" if low == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}")


def model_state_bytes(n_params, precision="bf16-mixed", optimizer="adamw", zero_stage=0, dp=1) -> int:
    """Per-device bytes of params + grads + optimizer states (ZeRO, section 3 and Table 1);
    bytes per parameter from ``STATE_BYTES``; stage 1/2/3 shards optimizer/+grads/+params over dp."""
    if isinstance(n_params, float) and n_params.is_integer():
        n_params = int(n_params)                    # 7.5e9, as the paper writes it
    _check_int("n_params", n_params, low=0)
    _check_int("dp", dp)
    check_choice("precision", precision, tuple(STATE_BYTES))
    check_choice("optimizer", optimizer, tuple(STATE_BYTES[precision]))
    if type(zero_stage) is not int or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {zero_stage!r}")
    sizes = (n_params * b for b in STATE_BYTES[precision][optimizer])  # params, grads, optimizer
    sharded = (zero_stage >= 3, zero_stage >= 2, zero_stage >= 1)
    return sum(-(-n // dp) if cut else n for n, cut in zip(sizes, sharded))  # ceil: never below a share


def megatron_activation_bytes(seq, batch, hidden, heads, layers=1, tp=1, sp=False, recompute="none") -> int:
    """fp16 activation bytes of ``layers`` layers (Korthikanti et al., 2022, Table 2): per layer
    sbh(10 + 24/t + 5as/(ht)), 34/t with sp, 5as/(ht) dropped by selective, 2sbh (/t with sp) full."""
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads),
                        ("layers", layers), ("tp", tp)):
        _check_int(name, value)
    check_choice("recompute", recompute, RECOMPUTE)
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
    interleaved. Papers often quote the ratio (p-1)/m, bubble over ideal time: ``pipeline_bubble_ratio``."""
    _check_pipeline(p, m, schedule, v)
    return (p - 1) / (v * m + p - 1)


def pipeline_bubble_ratio(p, m, schedule="1f1b", v=1) -> float:
    """Bubble time over ideal time (Narayanan et al., 2021): (p-1)/m, or (p-1)/(v*m) interleaved."""
    _check_pipeline(p, m, schedule, v)
    return (p - 1) / (v * m)


def _check_pipeline(p, m, schedule, v):
    _check_int("p", p)
    _check_int("m", m)
    _check_int("v", v)
    check_choice("schedule", schedule, SCHEDULES)
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"v={v} virtual stages needs schedule='interleaved'; use v=1 with {schedule!r}")


def megatron_params(layers, hidden, vocab, seq) -> int:
    """GPT parameter count (Megatron-LM, Narayanan et al., 2021, section 5.1):
    P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh)) = 12lh^2 + 13lh + (V+s)h."""
    for name, value in (("layers", layers), ("hidden", hidden), ("vocab", vocab), ("seq", seq)):
        _check_int(name, value)
    return 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq) * hidden
