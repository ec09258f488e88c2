"""FP8 quantisation with fine-grained scales (DeepSeek-V3 technical report, section 3.3): one
scale per 1 x 128 tile of activations, per 128 x 128 block of weights; what caching a layer's
linear inputs in FP8 (as V3 does) would save. Lab 02's last mechanism."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
    """Bytes of a dense GQA layer's saved tensors (``labkit.predict.layers.layer_saved``) and of its
    linear layers' inputs, in 16 bits and in FP8 with 1 x ``tile`` scales: a byte what-if."""
    from labkit.core.config import preset
    from labkit.predict.layers import layer_saved
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
