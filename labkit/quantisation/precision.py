"""Number formats and dynamic loss scaling: the mechanisms of lab 02.

- Formats: fp32, tf32, fp16, bf16 and the two FP8 formats (Micikevicius et al., 2022, "FP8
  Formats for Deep Learning"), each number derived from the bit layout and checked
  against ``torch.finfo``.
- Loss scaling (Micikevicius et al., 2018, "Mixed Precision Training"): multiply the loss
  so small fp16 gradients do not flush to zero, skip steps whose gradients overflow. The
  mechanism of ``torch.amp.GradScaler``, written out, and step-for-step identical to it.
- FP8 quantisation with fine-grained scales: ``labkit.quantisation.fp8``.
- TF32: fp32 numbers with their mantissa rounded to 10 bits, as tensor cores read them.
- What ``model.half()`` saves at inference (measured). What each recipe saves in training,
  over batch x sequence, is ``labkit.predict.sweep``'s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from labkit.quantisation.fp8 import (FP8_DTYPES, GRANULARITIES, FP8Cache, FP8Error,  # noqa: F401
                                     FP8Tensor, fp8_cached_activations, fp8_error,
                                     outlier_activations, quantize_fp8)

# ----------------------------------------------------------------------------- formats

# name, torch dtype (None: no storage type), exponent bits, mantissa bits, bytes, note
LAYOUTS = [
    ("fp32", torch.float32, 8, 23, 4, "IEEE 754 single precision"),
    ("tf32", None, 8, 10, 4, "a matmul mode, not a storage type: stored as fp32 in 4 bytes; "
                             "tensor cores keep 10 mantissa bits of each input"),
    ("fp16", torch.float16, 5, 10, 2, "IEEE 754 half precision: small range, needs loss scaling"),
    ("bf16", torch.bfloat16, 8, 7, 2, "fp32's exponent (its range) with 7 mantissa bits"),
    ("fp8-e4m3", torch.float8_e4m3fn, 4, 3, 1, "'fn': finite, no inf; the top exponent holds "
                                               "numbers up to 448; DeepSeek-V3's only FP8 format"),
    ("fp8-e5m2", torch.float8_e5m2, 5, 2, 1, "IEEE-like: fp16's range, 2 mantissa bits; the "
                                             "gradients' format in hybrid FP8 recipes"),
]
_INT_OF_WIDTH = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class FormatInfo:
    """One binary floating-point format: its bit layout and the numbers that follow from it."""

    name: str
    dtype: torch.dtype | None      # None: torch has no storage type for it (tf32)
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int
    bytes: int                     # bytes per element in memory
    max: float                     # largest finite value
    min_normal: float              # smallest positive normal value
    min_subnormal: float           # smallest positive value (subnormal)
    eps: float                     # 2**-mantissa_bits: the gap between 1 and the next number
    source: str                    # "torch" (finfo and bit patterns) or "bit layout" (formula)
    note: str = ""

    @property
    def bits(self) -> int:
        return self.sign_bits + self.exponent_bits + self.mantissa_bits


def layout_numbers(exponent_bits: int, mantissa_bits: int, infinities: bool = True) -> dict:
    """max, min_normal, min_subnormal, eps of a layout by formula (bias = 2^(e-1) - 1)."""
    e, m = exponent_bits, mantissa_bits
    bias = 2 ** (e - 1) - 1
    if infinities:      # IEEE: the all-ones exponent is reserved for inf/nan, so emax = bias
        largest = (2 - 2.0 ** -m) * 2.0 ** bias
    else:               # e4m3fn: the all-ones exponent holds numbers; only mantissa all-ones is nan
        largest = (2 - 2.0 ** (1 - m)) * 2.0 ** (bias + 1)
    return dict(max=largest, min_normal=2.0 ** (1 - bias), min_subnormal=2.0 ** (1 - bias - m),
                eps=2.0 ** -m)


def torch_numbers(dtype: torch.dtype) -> dict:
    """The same four numbers from torch: ``torch.finfo``, and bit pattern 0...01 (smallest)."""
    fi = torch.finfo(dtype)
    smallest = torch.ones(1, dtype=_INT_OF_WIDTH[dtype.itemsize]).view(dtype).item()
    return dict(max=fi.max, min_normal=fi.smallest_normal, min_subnormal=smallest, eps=fi.eps)


def format_table(source: str = "torch") -> list[FormatInfo]:
    """One row per format: from torch where it has the dtype, or all by formula ("bit layout")."""
    if source not in ("torch", "bit layout"):
        raise ValueError(f"unknown source {source!r}; use 'torch' or 'bit layout'")
    rows = []
    for name, dtype, e, m, nbytes, note in LAYOUTS:
        from_torch = source == "torch" and dtype is not None
        numbers = (torch_numbers(dtype) if from_torch
                   else layout_numbers(e, m, infinities=name != "fp8-e4m3"))
        rows.append(FormatInfo(name, dtype, 1, e, m, nbytes, **numbers,
                               source="torch" if from_torch else "bit layout", note=note))
    return rows


def format_info(fmt: str | torch.dtype) -> FormatInfo:
    """The row of ``format_table()`` for a name ("fp16", "fp8-e4m3") or a torch dtype."""
    for row in format_table():
        if fmt == row.name or (row.dtype is not None and fmt == row.dtype):
            return row
    names = ", ".join(name for name, *_ in LAYOUTS)
    raise ValueError(f"unknown format {fmt!r}; use one of {names} or their torch dtypes")


def exponent_histogram(tensor: torch.Tensor) -> dict[int, int]:
    """{floor(log2|x|): count} over the finite nonzero values, by increasing exponent."""
    x = tensor.detach().flatten().double()
    x = x[(x != 0) & x.isfinite()]
    exponents = torch.frexp(x).exponent - 1          # x = m * 2^e with 0.5 <= |m| < 1: exact
    values, counts = exponents.unique(return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


@dataclass
class RangeFractions:
    """Where the nonzero values of a tensor land when rounded to a format (fractions sum to 1)."""

    overflow: float       # beyond the largest value: inf (or saturated / nan for fp8-e4m3)
    underflow: float      # round to zero
    subnormal: float      # round into the subnormal range: fewer significant bits
    normal: float         # full precision
    count: int            # nonzero values counted


def fraction_representable(tensor: torch.Tensor, fmt: str | torch.dtype) -> RangeFractions:
    """Classify each nonzero value by round-to-nearest-even into ``fmt`` (tf32 included)."""
    f = format_info(fmt)
    x = tensor.detach().flatten().double().abs()
    x = x[x != 0]                                       # zeros are exact in every format
    ulp_at_max = f.eps * 2.0 ** math.floor(math.log2(f.max))
    # halfway points: ties go to the even neighbour (0, min_normal and inf all have even mantissas)
    overflow = ~x.isfinite() | (x >= f.max + ulp_at_max / 2)
    underflow = x <= f.min_subnormal / 2
    subnormal = ~underflow & (x < f.min_normal - f.min_subnormal / 2)
    normal = ~(overflow | underflow | subnormal)
    n = max(x.numel(), 1)
    return RangeFractions(*(m.sum().item() / n for m in (overflow, underflow, subnormal, normal)),
                          count=x.numel())


# ----------------------------------------------------------------------------- loss scaling

def _fp32(value: float) -> float:
    """``value`` rounded to fp32, where GradScaler keeps its scale (inf if too large)."""
    return torch.tensor(value, dtype=torch.float32).item()


def _params(optimizer_or_params) -> list:
    """The parameters of an optimizer (all its groups), or the given parameters as a list."""
    if isinstance(optimizer_or_params, torch.optim.Optimizer):
        return [p for group in optimizer_or_params.param_groups for p in group["params"]]
    return list(optimizer_or_params)


class ScalerStep(NamedTuple):
    scale: float          # the scale this step's gradients were computed with
    skipped: bool         # True when an inf/nan gradient made the step skip


class DynamicLossScaler:
    """Scale the loss up, unscale the gradients, skip steps that overflowed, adapt the scale.

    On an inf/nan gradient: skip the step, multiply the scale by ``backoff_factor``. After
    ``growth_interval`` good steps in a row: multiply it by ``growth_factor``. Same defaults
    and same fp32 arithmetic as ``torch.amp.GradScaler``. Per step:
    ``scale(loss).backward()``, optionally ``unscale_(opt)`` (to clip), ``step(opt)``, ``update()``.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        checks = [  # (holds, what to say)
            (init_scale > 0 and math.isfinite(init_scale),
             f"init_scale must be a positive finite number, got {init_scale}; use e.g. 2**16"),
            (growth_factor > 1, f"growth_factor must be > 1, got {growth_factor}; use e.g. 2.0"),
            (0 < backoff_factor < 1,
             f"backoff_factor must be in (0, 1), got {backoff_factor}; use e.g. 0.5"),
            (isinstance(growth_interval, int) and growth_interval >= 1,
             f"growth_interval must be an integer >= 1, got {growth_interval!r}; use e.g. 2000")]
        for holds, message in checks:
            if not holds:
                raise ValueError(message)
        self._scale = _fp32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._growth_tracker = 0            # good steps in a row since the last change
        self._found_inf: bool | None = None  # None until this step's gradients are unscaled
        self._stepped = False
        self.history: list[ScalerStep] = []

    @property
    def scale_value(self) -> float:
        return self._scale

    def get_scale(self) -> float:
        """The current scale, as ``GradScaler.get_scale()``."""
        return self._scale

    @property
    def state(self) -> dict:
        """The keys and values of ``GradScaler.state_dict()``."""
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._growth_tracker}

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * scale; the scale is an fp32 tensor so an fp16 loss is promoted, not overflowed."""
        return loss * torch.tensor(self._scale, dtype=torch.float32, device=loss.device)

    def unscale_(self, optimizer_or_params) -> None:
        """Unscale every gradient in place (times 1/scale), noting whether any was inf/nan."""
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called this step; call it at most once "
                               "between update()s")
        grads = [p.grad for p in _params(optimizer_or_params) if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):
            raise ValueError("fp16 gradients: keep fp32 weights (autocast computes in fp16) and "
                             "scale only the loss, as GradScaler requires")
        # checked before unscaling; 1/scale in fp64, rounded to fp32, then multiplied, as GradScaler
        self._found_inf = any(not g.isfinite().all() for g in grads)
        inv_scale = torch.tensor(1.0 / self._scale, dtype=torch.float32)
        with torch.no_grad():
            for g in grads:
                g.mul_(inv_scale)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if not done yet, then ``optimizer.step()`` unless a gradient was inf/nan."""
        if self._stepped:
            raise RuntimeError("step() was already called this step; "
                               "call update() after each step()")
        if self._found_inf is None:
            self.unscale_(optimizer)
        self._stepped = True
        if not self._found_inf:
            optimizer.step()
        return not self._found_inf

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` good steps; record history."""
        if self._found_inf is None:
            raise RuntimeError("update() before any gradient check; call step(optimizer) first")
        self.history.append(ScalerStep(self._scale, self._found_inf))
        if self._found_inf:
            self._scale = _fp32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = _fp32(self._scale * self.growth_factor)
                if math.isfinite(grown):    # never grow past fp32's range
                    self._scale = grown
                self._growth_tracker = 0
        self._found_inf, self._stepped = None, False


def scale_history(init_scale: float, overflow_above: float, steps: int = 12,
                  growth_interval: int = 3) -> list[float]:
    """The scale a ``DynamicLossScaler`` uses at each step when any scale above
    ``overflow_above`` overflows the gradients: it backs off, then settles."""
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = DynamicLossScaler(init_scale, growth_interval=growth_interval)
    for _ in range(steps):
        w.grad = torch.full((1,), math.inf if scaler.scale_value > overflow_above else 1.0)
        scaler.step(opt)
        scaler.update()
    return [h.scale for h in scaler.history]


def scale_sequence(overflows, scaler: str = "labkit", init_scale: float = 2.0 ** 10,
                   growth_interval: int = 3) -> list[float]:
    """The scale in use at each step when the steps flagged True in ``overflows`` have an inf
    gradient, by labkit's ``DynamicLossScaler`` ("labkit") or ``torch.amp.GradScaler`` ("torch")."""
    makers = {"labkit": DynamicLossScaler, "torch": lambda *a, **k: torch.amp.GradScaler("cpu", *a, **k)}
    if scaler not in makers:
        raise ValueError(f"unknown scaler {scaler!r}; use 'labkit' or 'torch'")
    w = torch.nn.Parameter(torch.ones(1))
    opt, s, scales = torch.optim.SGD([w], lr=0.0), makers[scaler](init_scale,
                                                                   growth_interval=growth_interval), []
    for overflow in overflows:
        scales.append(float(s.get_scale()))
        s.scale(torch.ones(()))                      # GradScaler creates its scale tensor here
        w.grad = torch.full((1,), math.inf if overflow else 1.0)
        s.step(opt)
        s.update()
    return scales


def compare_with_gradscaler(steps: int = 12, overflow_at=(2, 3, 7), growth_interval: int = 3,
                            seed: int = 0):
    """Run ``DynamicLossScaler`` and ``torch.amp.GradScaler`` on the same model, data and
    overflows (a loss x 1e38 at the steps ``overflow_at``); both histories, and whether the
    weights ended bit-identical."""
    torch.manual_seed(seed)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    first = torch.nn.Linear(8, 4)
    runs = []
    for make in (lambda: DynamicLossScaler(2.0 ** 10, growth_interval=growth_interval),
                 lambda: torch.amp.GradScaler("cpu", 2.0 ** 10, growth_interval=growth_interval)):
        model = torch.nn.Linear(8, 4)
        model.load_state_dict(first.state_dict())
        opt, scaler, history = torch.optim.SGD(model.parameters(), lr=0.1), make(), []
        for step in range(steps):
            loss = ((model(x) - y) ** 2).mean() * (1e38 if step in overflow_at else 1.0)
            scale = float(scaler.get_scale() if hasattr(scaler, "get_scale") else scaler.scale_value)
            scaler.scale(loss).backward()
            before = model.weight.detach().clone()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            history.append(ScalerStep(scale, torch.equal(before, model.weight.detach())))
        runs.append((history, model.weight.detach()))
    (ours, w_ours), (theirs, w_theirs) = runs
    return ours, theirs, torch.equal(w_ours, w_theirs)


def activation_gradients(cfg, loss_factor: float = 1.0, seed: int = 0, seq: int = 64,
                         at: str = "logits") -> torch.Tensor:
    """An fp32 gradient of one batch of ``cfg``'s model, the loss multiplied by ``loss_factor``:
    what fp16 would have to represent there. ``at="logits"``: the loss's gradient with respect
    to the logits, the first tensor autocast casts to fp16 in the backward pass (the LM head
    runs in fp16); ``at="last block"``: the gradient flowing out of the last block."""
    from labkit.transformer.model import build_model
    from labkit.training.step import bigram_corpus
    if at not in ("logits", "last block"):
        raise ValueError(f"unknown at={at!r}; use 'logits' or 'last block'")
    torch.manual_seed(seed)
    model = build_model(cfg)
    tokens = bigram_corpus(cfg.vocab_size, 8 * (seq + 1), seed).view(8, seq + 1)
    captured = []

    def keep(module, grad_input, grad_output):
        captured.append(grad_output[0].detach())

    (model.lm_head if at == "logits" else model.blocks[-1]).register_full_backward_hook(keep)
    (model(tokens[:, :-1], tokens[:, 1:]) * loss_factor).backward()
    return captured[0].flatten()


# ----------------------------------------------------------------------------- TF32

def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 ``x`` rounded to nearest-even at ``bits`` mantissa bits, still stored as fp32.

    10 bits: TF32, how Ampere+ tensor cores read an fp32 matmul's inputs (fp32 range, fp16's
    precision); 7 bits gives exactly bf16's values.
    """
    if not (isinstance(bits, int) and 0 <= bits <= 23):
        raise ValueError(f"bits must be an integer in 0..23 (fp32 has 23), got {bits!r}")
    drop = 23 - bits
    i = x.detach().float().contiguous().view(torch.int32)          # the bit patterns
    if drop == 0:
        return i.clone().view(torch.float32)
    half, odd = (1 << (drop - 1)) - 1, (i >> drop) & 1              # ties go to the even neighbour
    return ((i + half + odd) & ~((1 << drop) - 1)).view(torch.float32)


# ----------------------------------------------------------------------------- model.half()

@dataclass(frozen=True)
class InferencePeak:
    """Measured bytes of one no-grad forward pass: the weights and the peak (weights included)."""

    weights: int
    peak: int


def inference_peak(cfg, batch: int, seq: int, half: bool = False, loss: bool = False,
                   seed: int = 0) -> InferencePeak:
    """The tracker's peak of ``labkit.transformer.model``'s forward under ``torch.no_grad()``,
    fp32 or after ``model.half()``; ``loss=True`` also computes the loss (in fp32, over an fp32
    copy of the logits)."""
    from labkit.core.config import preset
    from labkit.transformer.model import build_model
    from labkit.training.track import MemoryTracker
    from labkit.core.units import check_positive
    check_positive("batch", batch)
    check_positive("seq", seq)
    c = preset(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    model = build_model(c)
    model = model.half() if half else model
    tokens = torch.randint(0, c.vocab_size, (batch, seq + 1))               # (B, T + 1)
    with torch.no_grad(), MemoryTracker(model, timeline=False) as mt:
        model(tokens[:, :-1], tokens[:, 1:] if loss else None)
    return InferencePeak(mt.peak_by_category["params"], mt.peak)
