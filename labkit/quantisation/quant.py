"""Weight quantisation for memory-lean fine-tuning: the quantisers of lab 06.

- int8 with one scale per tensor, per output channel or per block of values: absmax
  (symmetric, x ~= q * s) or zero-point (asymmetric, x ~= (q - z) * s).
- NF4 (Dettmers et al., 2023, "QLoRA"): 16 levels at quantiles of N(0, 1), one absmax per
  block of 64 weights, and double quantisation: those fp32 scales stored in 8 bits per block
  of 256, which takes the overhead from 0.5 to 0.127 bits per parameter.
- Two 4-bit codes per byte: what makes a 4-bit weight cost half a byte.
- LLM.int8() (Dettmers et al., 2022): the few activation features with |x| >= 6 go through a
  16-bit matmul, the rest through int8 x int8 with int32 accumulation.
- ``QuantLinear`` (packed NF4 weight, dequantised in forward) and ``LoRALinear`` (Hu et al.,
  2021, "LoRA": a frozen base plus a trainable low-rank update B A): together, QLoRA.

Every stored result says its exact bytes (``nbytes``), so a lab can add them up.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
import torch.nn.functional as F
from torch import nn

from labkit.core.units import check_choice, check_positive
from labkit.predict.formats import nf4_bits_per_param  # noqa: F401

SCHEMES = ("absmax", "zero-point")
GRANULARITIES = ("tensor", "channel", "block")
NF4_OFFSET = 0.9677083          # QLoRA's outermost quantile: (1 - 1/(2*15) + 1 - 1/(2*16)) / 2


# ----------------------------------------------------------------------------- stored result

@dataclass
class Quantized:
    """Codes and the numbers that bring them back; ``x ~= (codes - zero_points) * scales``
    per group (absmax: no zero points; NF4: ``codebook[codes] * scales``)."""

    codes: torch.Tensor                 # int8 (absmax), uint8 (zero-point), packed uint8 (nf4)
    scales: torch.Tensor | Quantized    # fp32 (groups,), or themselves quantised (double quant)
    zero_points: torch.Tensor | None    # uint8 (groups,) for zero-point, else None
    scales_mean: torch.Tensor | None    # fp32 (): subtracted before double quantisation
    shape: tuple                        # the original tensor's shape
    scheme: str                         # "absmax" | "zero-point" | "nf4"
    granularity: str                    # "tensor" | "channel" | "block"
    block: int                          # values per scale (the group size)

    @property
    def bits(self) -> int:
        """Bits per code: 4 for NF4, 8 for int8."""
        return 4 if self.scheme == "nf4" else 8

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact stored bytes: codes (packed if 4-bit), scales, zero points, second-level scales."""
        scales = self.scales.nbytes if isinstance(self.scales, Quantized) else _bytes(self.scales)
        return _bytes(self.codes) + scales + _bytes(self.zero_points) + _bytes(self.scales_mean)

    @property
    def bits_per_param(self) -> float:
        """Stored bits per original value, overheads included."""
        return 8 * self.nbytes / self.numel


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _groups(x: torch.Tensor, granularity: str, block: int) -> torch.Tensor:
    """x as (groups, values per group): one scale per row of the result."""
    if granularity == "tensor":
        return x.reshape(1, -1)                                             # (1, N)
    if granularity == "channel":
        if x.dim() < 2:
            raise ValueError(f"per-channel scales need a tensor of 2 or more dimensions (one "
                             f"scale per output channel, dim 0), got shape {tuple(x.shape)}; "
                             "use granularity='tensor' or 'block'")
        return x.reshape(x.shape[0], -1)                                    # (out, N/out)
    check_positive("block", block)
    if x.numel() % block:
        raise ValueError(f"block={block} does not divide the {x.numel()} values of shape "
                         f"{tuple(x.shape)}; pad the tensor or pass a block that divides it")
    return x.reshape(-1, block)                                             # (N/block, block)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """An all-zero group gets scale 1 (its codes are 0 anyway), not a division by zero."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# ----------------------------------------------------------------------------- int8

def quantize_int8(w: torch.Tensor, scheme: str = "absmax", granularity: str = "tensor",
                  block: int = 64) -> Quantized:
    """Round each group of w to 8-bit integers with its own scale.

    absmax: s = max|x| / 127, q = round(x / s) in [-127, 127]; zero maps to zero exactly.
    zero-point: the range [min, max] (widened to hold 0) spread over [0, 255]:
    s = (max - min) / 255, z = round(-min / s), q = round(x / s) + z. Uses all 256 codes
    when the values are one-signed (activations after ReLU), at one extra byte per group.
    """
    check_choice("scheme", scheme, SCHEMES)
    check_choice("granularity", granularity, GRANULARITIES)
    groups = _groups(w.detach().float(), granularity, block)                # (G, n)
    if scheme == "absmax":
        scales = _nonzero(groups.abs().amax(dim=1) / 127)                   # (G,)
        codes = (groups / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        zero_points = None
    else:
        low = groups.amin(dim=1).clamp(max=0)                               # (G,)
        high = groups.amax(dim=1).clamp(min=0)
        scales = _nonzero((high - low) / 255)
        zero_points = (-low / scales).round().clamp(0, 255)                 # (G,)
        codes = ((groups / scales[:, None]).round() + zero_points[:, None]).clamp(0, 255)
        codes, zero_points = codes.to(torch.uint8), zero_points.to(torch.uint8)
    return Quantized(codes.reshape(w.shape), scales, zero_points, None, tuple(w.shape), scheme,
                     granularity, groups.shape[1])


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 tensor that a ``Quantized`` stands for (its original shape)."""
    scales = q.scales
    if isinstance(scales, Quantized):                                       # double quantised
        scales = dequantize(scales) + q.scales_mean                         # (G,)
    if q.scheme == "nf4":
        codes = unpack_4bit(q.codes)                                        # (N,) in 0..15
        values = nf4_codebook().to(scales.device)[codes.long()].reshape(-1, q.block)
    else:
        values = q.codes.reshape(scales.shape[0], -1).float()               # (G, n)
        if q.zero_points is not None:
            values = values - q.zero_points[:, None].float()
    return (values * scales[:, None]).reshape(q.shape)


# ----------------------------------------------------------------------------- 4-bit packing

def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes (0..15) per byte, the first in the high nibble: (N,) -> (N/2,) uint8."""
    codes = codes.reshape(-1)
    if codes.numel() % 2:
        raise ValueError(f"pack_4bit needs an even number of codes, got {codes.numel()}; "
                         "pad with one zero code and remember the true length")
    has_values = not (isinstance(codes, FakeTensor) or codes.is_meta)   # shapes, no values
    if has_values and codes.numel() and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("4-bit codes must lie in 0..15; quantise to 16 levels before packing")
    pairs = codes.to(torch.uint8).reshape(-1, 2)                            # (N/2, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]                                 # (N/2,)


def unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_4bit``: (N/2,) uint8 -> (N,) uint8 codes in 0..15."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes are uint8, got {packed.dtype}; pass pack_4bit's output")
    packed = packed.reshape(-1)
    return torch.stack([packed >> 4, packed & 0x0F], dim=1).reshape(-1)    # (N,)


# ----------------------------------------------------------------------------- NF4

def nf4_codebook() -> torch.Tensor:
    """QLoRA's 16 NF4 levels in [-1, 1]: 8 positive and 7 negative quantiles of N(0, 1), and 0.

    As bitsandbytes' ``create_normal_map(offset=0.9677083, use_extra_value=True)``: quantiles
    at evenly spaced probabilities from 0.5 to ``offset`` (fp32 steps, as there), divided by
    the largest; both sides start at ``offset``, so -1, 0 and 1 are levels. Asymmetric on
    purpose: 16 levels cannot hold an exact 0 and be symmetric.
    """
    return torch.tensor(_nf4_levels())                                      # (16,) fp32


@functools.lru_cache(maxsize=1)
def _nf4_levels() -> tuple[float, ...]:
    """``nf4_codebook``'s values, computed once on real tensors whatever mode is active (fake
    tensors, a tracker): each dequantisation of a 7B model's 224 linears asks for them."""
    with _disable_current_modes():
        positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9)[:-1].double())  # (8,)
        negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8)[:-1].double())
        levels = torch.cat([negative, positive.new_zeros(1), positive]).float().sort().values
        return tuple((levels / levels.max()).tolist())                      # fp32 values


def quantize_nf4(w: torch.Tensor, block: int = 64, double_quant: bool = True,
                 dq_block: int = 256) -> Quantized:
    """Blockwise NF4: each block of ``block`` values scaled by its absmax into [-1, 1], each
    value stored as the index of the nearest NF4 level, two per byte.

    Double quantisation (QLoRA, section 3): the fp32 block scales, minus their mean, are
    themselves int8 absmax-quantised in blocks of ``dq_block``: 8 bits per block instead of
    32, plus one fp32 per ``dq_block`` blocks. bitsandbytes uses its 8-bit dynamic float map
    there; plain absmax int8 is used here because lab 06 has just shown it, and the scales
    (positive, centred by the mean) are evenly spread, where a float map gains little.
    """
    groups = _groups(w.detach().float(), "block", block)                    # (G, block)
    if groups.numel() % 2:
        raise ValueError(f"NF4 packs two codes per byte, so it needs an even number of values "
                         f"(got {groups.numel()}); pad the tensor by one zero")
    scales = _nonzero(groups.abs().amax(dim=1))                             # (G,)
    levels = nf4_codebook().to(groups.device)
    midpoints = (levels[1:] + levels[:-1]) / 2                              # (15,)
    codes = torch.bucketize(groups / scales[:, None], midpoints)            # (G, block) 0..15
    packed = pack_4bit(codes)                                               # (G * block / 2,)
    quantized = Quantized(packed, scales, None, None, tuple(w.shape), "nf4", "block", block)
    if double_quant:
        check_positive("dq_block", dq_block)
        if scales.numel() % dq_block:
            raise ValueError(f"double quantisation groups the {scales.numel()} block scales in "
                             f"blocks of dq_block={dq_block}, which does not divide them; "
                             f"pass a tensor of a multiple of {block * dq_block} values, a "
                             "dq_block that divides the scale count, or double_quant=False")
        mean = scales.mean()
        quantized.scales = quantize_int8(scales - mean, "absmax", "block", dq_block)
        quantized.scales_mean = mean
    return quantized


# ----------------------------------------------------------------------------- LLM.int8()

class OutlierMatmul(NamedTuple):
    """``x @ w.T`` by LLM.int8(), and how many input features went the 16-bit way."""

    out: torch.Tensor           # (..., out_features), x's dtype
    n_outliers: int


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 (M, K) @ int8 (K, N) -> exact int32 (M, N).

    ``torch._int_mm`` (int32 accumulation) where it runs: any shape on CPU, M > 16 and K, N
    multiples of 8 on CUDA. Elsewhere an fp64 matmul, exact here: |sum| <= K * 127**2 < 2**53.
    """
    M, K = a.shape
    N = b.shape[1]
    on_cuda_ok = a.is_cuda and M > 16 and K % 8 == 0 and N % 8 == 0
    if K and (a.device.type == "cpu" or on_cuda_ok):
        return torch._int_mm(a, b.contiguous())
    return (a.double() @ b.double()).to(torch.int32)


def _absmax_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vector-wise int8: one absmax scale per row. (R, K) -> codes (R, K) int8, scales (R,)."""
    scales = _nonzero(x.abs().amax(dim=1) / 127)
    return (x / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def int8_matmul_with_outliers(x: torch.Tensor, w: torch.Tensor,
                              threshold: float = 6.0) -> OutlierMatmul:
    """``x @ w.T`` (w as ``nn.Linear.weight``: out x in) by LLM.int8()'s decomposition.

    Input features (columns of x) with any |value| >= threshold are multiplied in x's dtype
    (fp16/bf16 on a GPU, fp32 on CPU). The rest: x row-wise and w per output feature absmax
    int8, int8 x int8 -> int32, then rescaled by both scales. ``threshold=math.inf`` turns the
    decomposition off: plain vector-wise int8.
    """
    if threshold <= 0:
        raise ValueError(f"threshold must be positive (LLM.int8() uses 6.0), got {threshold}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but w is {tuple(w.shape)} (out x in); "
                         "pass nn.Linear.weight, not its transpose")
    rows = x.reshape(-1, x.shape[-1])                                       # (R, K)
    outlier = (rows.abs() >= threshold).any(dim=0)                          # (K,)
    out = rows[:, outlier] @ w[:, outlier].to(x.dtype).T                    # (R, N) 16-bit part
    if not outlier.all():
        xq, x_scales = _absmax_int8_rows(rows[:, ~outlier].float())         # (R, K'), (R,)
        wq, w_scales = _absmax_int8_rows(w[:, ~outlier].float())            # (N, K'), (N,)
        acc = int8_matmul(xq, wq.T)                                         # (R, N) int32
        out = out + (acc.float() * x_scales[:, None] * w_scales[None, :]).to(x.dtype)
    return OutlierMatmul(out.reshape(*x.shape[:-1], w.shape[0]), int(outlier.sum()))


# ----------------------------------------------------------------------------- layers

class QuantLinear(nn.Module):
    """A frozen linear layer whose weight lives as packed NF4 codes and (double-quantised)
    scales, dequantised to the input's dtype in every forward: y = x W~^T + b.

    No floating-point weight is kept: the packed codes and scales are the whole state
    (``nbytes``), frozen ``nn.Parameter``s as bitsandbytes' ``Params4bit`` stores them, so that
    ``model.parameters()``, ``state_dict`` and the tracker's "params" see the weight in the
    format it has, and an optimizer skips it (``requires_grad=False``).
    """

    def __init__(self, linear: nn.Linear, block: int = 64, double_quant: bool = True,
                 dq_block: int = 256):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"QuantLinear is built from an nn.Linear, got {type(linear).__name__}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q = quantize_nf4(linear.weight, block, double_quant, dq_block)
        self.block, self.double_quant = block, double_quant
        frozen = lambda t: nn.Parameter(t, requires_grad=False)             # noqa: E731
        self.codes = frozen(q.codes)                                        # (out * in / 2,)
        if double_quant:
            self.dq_block = q.scales.block
            self.scale_codes = frozen(q.scales.codes)                       # int8 (G,)
            self.scale_scales = frozen(q.scales.scales)                     # fp32 (G/dq_block,)
            self.scales_mean = frozen(q.scales_mean.reshape(1))             # fp32 (1,): FSDP2
                                                                            # shards no scalar
        else:
            self.scales = frozen(q.scales)                                  # fp32 (G,)
        self.bias = None if linear.bias is None else frozen(linear.bias.detach().clone())

    def quantized(self) -> Quantized:
        """The stored weight as a ``Quantized`` (its tensors are this module's parameters)."""
        shape = (self.out_features, self.in_features)
        if not self.double_quant:
            return Quantized(self.codes, self.scales, None, None, shape, "nf4", "block",
                             self.block)
        scales = Quantized(self.scale_codes, self.scale_scales, None, None,
                           tuple(self.scale_codes.shape), "absmax", "block", self.dq_block)
        return Quantized(self.codes, scales, None, self.scales_mean.reshape(()), shape, "nf4",
                         "block", self.block)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight: packed codes, scales and the bias."""
        return sum(_bytes(p) for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _NF4Matmul.apply(x, self, bias)                              # (..., out)


class _NF4Matmul(torch.autograd.Function):
    """y = x W~^T + b with W~ dequantised in forward and again in backward: F.linear on the
    dequantised weight would save it for the input's gradient, a whole 16- or 32-bit copy of
    every layer alive until backward (bitsandbytes' 4-bit matmul saves the codes, as here)."""

    @staticmethod
    def forward(ctx, x, layer: "QuantLinear", bias):                      # x (..., in)
        ctx.layer = layer
        weight = dequantize(layer.quantized()).to(x.dtype)                  # (out, in), freed
        return F.linear(x, weight, bias)                                    # (..., out)

    @staticmethod
    def backward(ctx, grad):                                                # (..., out)
        weight = dequantize(ctx.layer.quantized()).to(grad.dtype)           # (out, in) again
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return grad @ weight, None, grad_bias                               # (..., in)


class LoRALinear(nn.Module):
    """A frozen base layer plus a trainable low-rank update (Hu et al., 2021):
    y = base(x) + (alpha / r) * dropout(x) A^T B^T, A (r x in), B (out x r).

    B starts at zero, so the layer starts as its base; only A and B train: r (in + out)
    parameters instead of in x out.
    """

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if not isinstance(base, (nn.Linear, QuantLinear)):
            raise ValueError(f"LoRALinear wraps an nn.Linear or a QuantLinear, "
                             f"got {type(base).__name__}")
        check_positive("r", r)
        if alpha <= 0:
            raise ValueError(f"alpha must be positive (often r or 2 r), got {alpha}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout is a probability in [0, 1), got {dropout}")
        self.base = base.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        weight = getattr(base, "weight", None)
        dtype = weight.dtype if weight is not None else torch.float32
        device = base.codes.device if weight is None else weight.device
        self.A = nn.Parameter(torch.empty(r, base.in_features, dtype=dtype, device=device))
        self.B = nn.Parameter(torch.zeros(base.out_features, r, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))    # as nn.Linear (and peft) do
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.added(self.base(x), self.update(x))                     # (..., out)

    def added(self, out: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """The base's output plus (alpha / r) times the update, in the base's dtype (PEFT's)."""
        return out + (self.scaling * update).to(out.dtype)

    def update(self, x: torch.Tensor) -> torch.Tensor:
        """dropout(x) A^T B^T, not yet scaled by alpha / r: (..., in) -> (..., out)."""
        x = self.dropout(x)
        # under autocast the matmul casts x itself: a copy in A's dtype would only be cast back
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.A.dtype)
        return x @ self.A.T @ self.B.T

    def merge(self) -> nn.Linear:
        """A plain nn.Linear with W + (alpha / r) B A: the adapter folded in for inference."""
        if not isinstance(self.base, nn.Linear):
            raise ValueError("merge() needs an nn.Linear base; folding B A into 4-bit weights "
                             "would requantise them: dequantise to an nn.Linear first")
        merged = nn.Linear(self.base.in_features, self.base.out_features,
                           bias=self.base.bias is not None, device=self.A.device,
                           dtype=self.base.weight.dtype)
        with torch.no_grad():
            delta = (self.scaling * (self.B @ self.A)).to(self.base.weight.dtype)
            merged.weight.copy_(self.base.weight + delta)
            if self.base.bias is not None:
                merged.bias.copy_(self.base.bias)
        return merged


# ----------------------------------------------------------------------------- a model's weights

WEIGHT_STORAGE = ("bf16", "fp8 block 128", "int8 per channel", "nf4", "int4 group 128")


def stored_bytes(storage: str, fan_out: int, fan_in: int) -> int:
    """Exact bytes of one (fan_out, fan_in) weight stored as ``storage`` (WEIGHT_STORAGE).

    int8 per channel and nf4 as ``quantize_int8`` / ``quantize_nf4`` store them; int4 group
    128 as ``gptq``'s grid (codes and zero points 4 bits, fp16 scales); fp8 block 128 as
    DeepSeek-V3's checkpoint: e4m3 values and one fp32 scale per 128 x 128 tile.
    """
    check_choice("storage", storage, WEIGHT_STORAGE)
    check_positive("fan_out", fan_out)
    check_positive("fan_in", fan_in)
    n = fan_out * fan_in
    if storage == "bf16":
        return 2 * n
    if storage == "fp8 block 128":
        return n + 4 * math.ceil(fan_out / 128) * math.ceil(fan_in / 128)
    if storage == "int8 per channel":
        return n + 4 * fan_out                                  # int8 codes, fp32 scale per row
    if storage == "nf4":                                        # block 64, double quantisation
        blocks = math.ceil(n / 64)
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4
    groups = fan_out * math.ceil(fan_in / 128)                  # int4 group 128
    return math.ceil(n / 2) + 2 * groups + math.ceil(groups / 2)


@dataclass
class WeightBytes:
    """A model's weights in one storage: the quantised matmul weights and what stays bf16."""

    storage: str
    quantised: int      # bytes of the blocks' matmul weights (attention, MLPs, experts)
    kept: int           # bytes of the embedding, LM head, norms and routers, in bf16

    @property
    def total(self) -> int:
        return self.quantised + self.kept


def model_weight_bytes(cfg, storage: str) -> WeightBytes:
    """Bytes of a model's weights with every matmul weight of its blocks (each routed expert
    on its own) in ``storage``, and the embedding, LM head, norms and routers in bf16: what
    QLoRA, GPTQ and DeepSeek-V3's FP8 checkpoint quantise and what they keep."""
    from labkit.predict.layers import block_weights, embedding_weights, head_weights
    from labkit.core.config import preset

    c = preset(cfg) if isinstance(cfg, str) else cfg
    weights = (embedding_weights(c) + head_weights(c)
               + [w for i in range(c.layers) for w in block_weights(c, i >= c.dense_layers)])
    quantised = kept = 0
    for w in weights:
        if w.matmul and w.name.startswith(("attn.", "mlp.")) and w.name != "mlp.router":
            quantised += w.copies * stored_bytes(storage, w.fan_out, w.fan_in)
        else:
            kept += 2 * w.numel
    return WeightBytes(storage, quantised, kept)
