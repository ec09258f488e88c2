"""Bytes: sizes of number formats, human-readable printing, and the breakdown every lab shows.
Torch-free (``torch_dtype`` imports torch when called): the estimate stands on it."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

# number formats by one name each (labkit.quantisation.precision's format table uses the same names)
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8-e4m3": 1, "fp8-e5m2": 1,
               "int8": 1, "int4": 0.5}
TORCH_DTYPE_NAMES = ("fp32", "bf16", "fp16")      # the formats a torch tensor is stored in


def torch_dtype(dtype):
    """A torch dtype from a format name ("bf16") or a torch dtype; ValueError naming the names."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    check_choice("dtype", dtype, TORCH_DTYPE_NAMES)
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def check_choice(name: str, value, choices) -> None:
    """ValueError naming the valid values when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; use one of {', '.join(map(str, choices))}")


def check_positive(name: str, value) -> int:
    """``value`` as an int; ValueError when it is not a positive integer (numpy's integers
    are; bools are not sizes)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def dtype_bytes(dtype) -> float:
    """Bytes per element of a format name ("bf16") or a torch dtype."""
    if not isinstance(dtype, str) and hasattr(dtype, "itemsize"):      # a torch.dtype
        return dtype.itemsize
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def fmt_bytes(n: float, digits: int = 2) -> str:
    """Binary units, said as such: 1536 -> '1.50 KiB'; 16 GiB is 17.18 GB."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.{digits}f} {unit}"
        n /= 1024


CATEGORIES = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "weight_cache": "autocast weight cache",
    "other": "temporaries/other",
}
# One colour per category in every labkit plot and on the website (Okabe & Ito's
# colour-blind-safe palette).
CATEGORY_COLORS = {
    "params": "#0072B2",        # blue
    "grads": "#E69F00",         # orange
    "optimizer": "#009E73",     # bluish green
    "activations": "#D55E00",   # vermillion
    "weight_cache": "#CC79A7",  # reddish purple
    "other": "#999999",         # grey
}
# a pipeline schedule's ops in its Gantt chart: F forward, B backward, W weight gradient
OP_COLORS = {"F": CATEGORY_COLORS["params"], "B": CATEGORY_COLORS["grads"],
             "W": CATEGORY_COLORS["optimizer"]}
HOST = "host"         # offloaded bytes (ZeRO-Offload): host memory, counted apart from the device's
"""What a byte is: one key per category, used by the tracker, ``Breakdown``, the estimate, the
plots and the command line alike, and the label every table and plot prints for it.

- params: the model's weights; grads: ``.grad`` of a parameter; optimizer: tensors in the
  optimizer's state (moments, fp32 master weights, step counters);
- activations: tensors made in the forward pass and still alive - what autograd saved for
  the backward pass, the token batch, the loss, the logits;
- weight_cache: autocast's low-precision copies of the weights, which autograd keeps for the
  backward pass like activations, but which grow with the model, not with batch x sequence;
- other: gradients of activations in flight during backward, the optimizer's temporaries,
  activations recomputed by checkpointing, buffers (RoPE tables).
"""


@dataclass
class Breakdown:
    """Bytes per device at the peak of one training step, by category (sum == total).

    ``saved_activations`` is the activation memory at the end of the forward pass (its
    largest value), which is not always what is alive at the peak: when the peak falls in
    the optimizer step, the activations are already gone. Autocast's weight copies are not
    in it: they are ``saved_weight_cache`` at that moment, and ``weight_cache`` at the peak.
    """

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    weight_cache: int = 0
    other: int = 0
    peak_phase: str = ""
    saved_activations: int = 0
    saved_weight_cache: int = 0
    details: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(getattr(self, key) for key in CATEGORIES)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in CATEGORIES}, "total": self.total,
                "peak_phase": self.peak_phase, "saved_activations": self.saved_activations,
                "saved_weight_cache": self.saved_weight_cache}


def fmt_count(n: float) -> str:
    """Parameter counts the way papers say them: 6.74B, 5.05M, 125K."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def _difference_share(diff: int, measured: int, total: int) -> str:
    """The difference as a share of the category, or of the peak where the category is under
    1% of it (a few bytes off a 4-byte category are not "+100000%")."""
    if not diff:
        return " (+0.00%)" if measured else ""
    if measured and 100 * abs(measured) >= total:
        return f" ({100 * diff / measured:+.2f}%)"
    return f" ({100 * diff / total:+.2f}% of the peak)" if total else ""


def reconciliation(predicted: Breakdown, measured: Breakdown) -> str:
    """A predicted-vs-measured table by category, with each difference in bytes and percent."""
    rows = [*CATEGORIES.items(), ("total", "total (peak)"),
            ("saved_activations", "saved at end of forward"),
            ("saved_weight_cache", "... and weight copies")]
    lines = [f"{'':<25}{'predicted':>13}{'measured':>13}{'difference':>13}"]
    for field, label in rows:
        p, m = getattr(predicted, field), getattr(measured, field)
        pct = _difference_share(p - m, m, measured.total)
        lines.append(f"{label:<25}{fmt_bytes(p):>13}{fmt_bytes(m):>13}{fmt_bytes(p - m):>13}{pct}")
    lines.append(f"peak during: predicted {predicted.peak_phase}, measured {measured.peak_phase}")
    return "\n".join(lines)
