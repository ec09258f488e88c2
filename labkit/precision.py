"""Number formats, dynamic loss scaling and FP8 scaling: the mechanisms of lab 02.

- Formats: fp32, tf32, fp16, bf16 and the two FP8 formats (Micikevicius et al., 2022, "FP8
  Formats for Deep Learning"), each number derived from the bit layout and checked
  against ``torch.finfo``.
- Loss scaling (Micikevicius et al., 2018, "Mixed Precision Training"): multiply the loss
  so small fp16 gradients do not flush to zero, skip steps whose gradients overflow. The
  mechanism of ``torch.amp.GradScaler``, written out, and step-for-step identical to it.
- FP8 quantisation with fine-grained scales (DeepSeek-V3 technical report, section 3.3):
  one scale per 1 x 128 tile of activations, per 128 x 128 block of weights; what caching
  a layer's linear inputs in FP8 (as V3 does) would save.
- TF32: fp32 numbers with their mantissa rounded to 10 bits, as tensor cores read them.
- What ``model.half()`` saves at inference (measured). What each recipe saves in training,
  over batch x sequence, is ``labkit.sweep``'s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

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
    from .model import build_model
    from .step import bigram_corpus
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


# ----------------------------------------------------------------------------- FP8 scaling

FP8_DTYPES = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}   # the table's names
GRANULARITIES = ("tensor", "tile", "block")


@dataclass
class FP8Tensor:
    """FP8 values and the fp32 scales that bring them back: x ~= data * scale (per group)."""

    data: torch.Tensor          # float8, same shape as the original
    scale: torch.Tensor         # fp32: () tensor, (..., K/tile) tile, (M/tile, N/tile) block
    granularity: str
    shape: tuple
    tile: int = 128

    def dequantize(self) -> torch.Tensor:
        """The fp32 tensor these FP8 values and scales stand for."""
        return self.data.float() * _per_element(self.scale, self.granularity, self.tile)

    @property
    def nbytes(self) -> int:
        """Bytes of the FP8 values plus the fp32 scales."""
        return (self.data.numel() * self.data.element_size()
                + self.scale.numel() * self.scale.element_size())


def _per_element(scale, granularity: str, tile: int) -> torch.Tensor:
    """Each group's scale repeated over the elements of its group."""
    if granularity == "tile":
        return scale.repeat_interleave(tile, dim=-1)                        # (..., K)
    if granularity == "block":
        return scale.repeat_interleave(tile, 0).repeat_interleave(tile, 1)  # (M, N)
    return scale                                                            # () broadcasts


def _group_amax(x, granularity: str, tile: int) -> torch.Tensor:
    """The largest |x| of each scaling group; says how to fix shapes that do not split evenly."""
    if granularity == "tensor":
        return x.abs().amax()                                               # ()
    if granularity == "tile":
        K = x.shape[-1]
        if K % tile:
            raise ValueError(f"last dimension {K} is not a multiple of tile={tile}; pad it to a "
                             f"multiple of {tile} or pass a tile that divides {K}")
        return x.abs().reshape(*x.shape[:-1], K // tile, tile).amax(-1)     # (..., K/tile)
    if x.dim() != 2 or x.shape[0] % tile or x.shape[1] % tile:
        raise ValueError(f"block scaling needs a 2-D tensor with both dimensions multiples of "
                         f"tile={tile}, got shape {tuple(x.shape)}; pad it, pass a tile that "
                         "divides both, or use granularity='tile'")
    M, N = x.shape
    return x.abs().reshape(M // tile, tile, N // tile, tile).amax(dim=(1, 3))  # (M/tile, N/tile)


def quantize_fp8(x: torch.Tensor, fmt: str = "fp8-e4m3", granularity: str = "tensor",
                 tile: int = 128) -> FP8Tensor:
    """Scale each group so its largest |x| lands on the format's max, then round to FP8.

    "tensor": one scale; "tile": one per 1 x tile slice of the last dimension (DeepSeek-V3's
    activations); "block": one per tile x tile block of a 2-D tensor (its weights).
    """
    if fmt not in FP8_DTYPES:
        raise ValueError(f"unknown fmt {fmt!r}; use one of {', '.join(FP8_DTYPES)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; "
                         f"use one of {', '.join(GRANULARITIES)}")
    dtype, x = FP8_DTYPES[fmt], x.detach().float()
    fp8_max = torch.finfo(dtype).max
    amax = _group_amax(x, granularity, tile)
    scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))  # all-zero group: 1
    scaled = x / _per_element(scale, granularity, tile)
    # amax / (amax / max) may round a hair above max: clamp rather than rely on the cast
    data = scaled.clamp(-fp8_max, fp8_max).to(dtype)
    return FP8Tensor(data, scale, granularity, tuple(x.shape), tile)


@dataclass
class FP8Error:
    """How far the FP8 round trip lands from the original."""

    rel_fro: float        # ||x - q||_F / ||x||_F: dominated by the largest values
    max_abs: float        # max |x - q|
    mean_rel: float       # mean of |x - q| / |x| over nonzero x: the typical element
    underflow: float      # fraction of nonzero values that came back as zero


def fp8_error(x: torch.Tensor, fmt: str = "fp8-e4m3", granularity: str = "tensor",
              tile: int = 128, where: torch.Tensor | None = None) -> FP8Error:
    """Error metrics of ``quantize_fp8(x, ...).dequantize()`` against x; with a boolean mask
    ``where`` (broadcast to x), over those elements only - the whole tensor is quantised."""
    x = x.detach().float()
    q = quantize_fp8(x, fmt, granularity, tile).dequantize()
    if where is not None:
        where = where.expand_as(x)
        x, q = x[where], q[where]
    err, nonzero = (x - q).abs(), x != 0
    return FP8Error(rel_fro=((x - q).norm() / x.norm()).item(), max_abs=err.max().item(),
                    mean_rel=(err[nonzero] / x.abs()[nonzero]).mean().item(),
                    underflow=((q == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1))


def outlier_activations(shape=(256, 1024), n_outliers: int = 4, scale: float = 1000.0,
                        seed: int = 0) -> torch.Tensor:
    """Normal(0, 1) activations with ``n_outliers`` channels (last dim) scaled scale/10 ... scale.

    Trained LLMs carry a few hidden channels far larger than the rest in nearly every token
    (Dettmers et al., 2022, LLM.int8()); the 100-1000x default is a choice, not a measurement.
    A freshly initialised ``labkit`` model has none (the "small" preset's block inputs vary by
    ~2x across channels), so the labs generate them.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)                                     # (..., channels)
    channels = torch.randperm(shape[-1], generator=g)[:n_outliers]
    x[..., channels] *= torch.logspace(math.log10(scale / 10), math.log10(scale), n_outliers)
    return x


@dataclass(frozen=True)
class FP8Cache:
    """What one dense layer keeps for backward (bf16 activations, ``batch x seq`` tokens), and
    two what-ifs that cache linear-layer inputs in FP8 (1 byte + an fp32 scale per 1 x 128 tile).

    ``inputs``/``inputs_fp8``: bytes of each linear's saved input ({"wq, wk, wv": ..., "wo": ...,
    "w_gate, w_up": ..., "w_down": ...}); ``swiglu``: SwiGLU's gate, silu, up and product
    (w_down's input among them); ``swiglu_inputs_fp8``: gate and up alone, in FP8.
    """

    layer: int
    inputs: dict
    inputs_fp8: dict
    swiglu: int
    swiglu_inputs_fp8: int

    @property
    def linear_inputs(self) -> int:
        return sum(self.inputs.values())

    @property
    def all_linear_inputs_fp8(self) -> int:
        """What-if 1: every linear's input cached in FP8, nothing else changed."""
        return self.layer - self.linear_inputs + sum(self.inputs_fp8.values())

    @property
    def v3_like(self) -> int:
        """What-if 2, DeepSeek-V3's choices: FP8 inputs of wq/wk/wv and w_gate/w_up, wo's input
        kept in 16 bits (V3: its own E5M6), SwiGLU's inputs in FP8 and its output recomputed."""
        fp8 = [k for k in self.inputs if k not in ("wo", "w_down")]
        return (self.layer - sum(self.inputs[k] - self.inputs_fp8[k] for k in fp8)
                - self.swiglu + self.swiglu_inputs_fp8)


def fp8_cached_activations(cfg, batch: int = 1, seq: int = 4096,
                           precision: str = "bf16-master", tile: int = 128) -> FP8Cache:
    """Bytes of a dense GQA layer's saved tensors (``labkit.layers.layer_saved``) and of its
    linear layers' inputs, in 16 bits and in FP8 with 1 x ``tile`` scales: a byte what-if."""
    from .config import preset
    from .layers import layer_saved
    c = preset(cfg) if isinstance(cfg, str) else cfg
    if c.attention != "gqa" or c.is_moe:
        raise ValueError(f"{c.name}: the what-if is written for a dense GQA layer; use a model "
                         "such as 'llama-2-7b' (or its dense preset)")
    if precision not in ("bf16", "bf16-master"):
        raise ValueError(f"precision={precision!r}: the what-if starts from bf16 activations "
                         "without autocast's copies; use 'bf16' or 'bf16-master'")
    N = batch * seq

    def fp8(width):
        return N * (width + 4 * math.ceil(width / tile))            # values + fp32 tile scales

    widths = {"wq, wk, wv": c.hidden, "wo": c.heads * c.head_dim, "w_gate, w_up": c.hidden,
              "w_down": c.ffn}
    return FP8Cache(layer=layer_saved(c, precision).bytes(batch, seq),
                    inputs={k: 2 * N * w for k, w in widths.items()},
                    inputs_fp8={k: fp8(w) for k, w in widths.items()},
                    swiglu=4 * 2 * N * c.ffn, swiglu_inputs_fp8=2 * fp8(c.ffn))


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
    """The tracker's peak of ``labkit.model``'s forward under ``torch.no_grad()``, fp32 or after
    ``model.half()``; ``loss=True`` also computes the loss (in fp32, over an fp32 copy of the logits)."""
    from .config import preset
    from .model import build_model
    from .track import MemoryTracker
    from .units import check_positive
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
