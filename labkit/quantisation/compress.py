"""Two ways to store fewer numbers per weight, checked against common advice in lab 06:
2:4 structured sparsity and low-rank factorisation.

- 2:4 sparsity (Mishra et al., 2021, "Accelerating Sparse Deep Neural Networks"; NVIDIA Ampere's
  sparse tensor cores): in every group of 4 consecutive weights of a row of nn.Linear.weight
  (out, in) - 4 input features - the 2 of largest magnitude stay, the other 2 become zero. What
  is stored is half the values plus, per kept value, its 2-bit position in its group: in fp16,
  16 + 2 = 18 bits per kept value, 9 bits per original parameter (43.75% saved, not 50%); with
  int8 values, 8 + 2 = 10 bits per kept value, 5 per parameter (37.5% saved). torch's
  ``to_sparse_semi_structured`` allocates the same: 9/16 of the dense fp16 bytes, 10/16 of int8.
- Low rank (Eckart-Young): W (out, in) ~ B A with B (out, r), A (r, in) from a truncated SVD, the
  best rank-r approximation in Frobenius norm; its error is the norm of the dropped singular
  values. r (out + in) numbers replace out x in, so a saving sets the largest rank allowed.

``compress_weight`` returns (approximation, stored bytes) as ``gptq.quantize_weight`` does, so
the same loop can compare them with quantisation on the trained ``small`` model.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

import torch

from labkit.core.units import check_positive, torch_dtype
from labkit.quantisation.quant import _bytes, pack_4bit, quantize_int8, unpack_4bit

SPARSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)
METHODS = ("2:4 fp16", "2:4 int8", "low-rank 25% fp16")


def _check_weight(w: torch.Tensor, groups_of_4: bool = False) -> None:
    if w.dim() != 2:
        raise ValueError(f"weight is (out, in) as nn.Linear.weight, got shape {tuple(w.shape)}")
    if groups_of_4 and w.shape[1] % 4:
        raise ValueError(f"2:4 sparsity groups 4 consecutive input features, but in_features="
                         f"{w.shape[1]} of shape {tuple(w.shape)} is not a multiple of 4; pad "
                         "the input dimension with zero columns to a multiple of 4")


# ----------------------------------------------------------------------------- 2:4 sparsity

@dataclass
class Sparse24:
    """A 2:4-sparse weight as sparse tensor cores read it: the kept values, their positions.

    Our layout (cuSPARSELt and torch's ``to_sparse_semi_structured`` store the same amounts,
    arranged for the hardware): ``values`` (out, in/2) holds each group's two kept weights in
    column order; each group's two positions p0 < p1 (0..3, 2 bits each) make one nibble
    p0 * 4 + p1, and ``quant.pack_4bit`` puts two groups in a byte, row by row (one zero nibble
    pads an odd group count). int8 values carry one fp32 absmax scale per row. fp32 is here for
    exact checks: sparse tensor cores pair fp32/tf32 values 1:2, not 2:4.
    """

    values: torch.Tensor            # (out, in/2) fp16/bf16/fp32, or int8 codes
    metadata: torch.Tensor          # (ceil(out * in / 8),) uint8: a nibble of positions per group
    shape: tuple                    # (out, in), the dense weight's shape
    scales: torch.Tensor | None     # (out,) fp32 for int8 values, else None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact stored bytes: kept values, packed positions, int8 scales."""
        return _bytes(self.values) + _bytes(self.metadata) + _bytes(self.scales)

    @property
    def bits_per_param(self) -> float:
        """Stored bits per ORIGINAL (dense) parameter: 9.0 for fp16."""
        return 8 * self.nbytes / self.numel


def _keep_2_of_4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's 2 largest-magnitude positions, in increasing order, and their values."""
    groups = w.reshape(w.shape[0], -1, 4)                                   # (out, G, 4)
    positions = groups.abs().topk(2, dim=-1).indices.sort(dim=-1).values    # (out, G, 2)
    return positions, groups.gather(-1, positions)                          # (out, G, 2) both


def _scatter(positions: torch.Tensor, values: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Dense (out, in): each group's ``values`` at its ``positions``, zeros elsewhere."""
    groups = values.new_zeros(shape[0], shape[1] // 4, 4)                   # (out, G, 4)
    return groups.scatter(-1, positions, values).reshape(shape)            # (out, in)


def prune_2_4(w: torch.Tensor) -> torch.Tensor:
    """w (out, in) with the 2 smallest-magnitude weights of every 4 along a row set to zero."""
    _check_weight(w, groups_of_4=True)
    positions, kept = _keep_2_of_4(w.detach())
    return _scatter(positions, kept, tuple(w.shape))


def compress_2_4(w: torch.Tensor, dtype: torch.dtype = torch.float16) -> Sparse24:
    """Prune w (out, in) to 2:4 and store the kept half in ``dtype`` with 2-bit positions.

    int8 rounds the kept values to int8 with one absmax scale per row (``quant.quantize_int8``,
    per channel). A weight already 2:4 and exact in ``dtype`` comes back unchanged.
    """
    _check_weight(w, groups_of_4=True)
    if dtype not in SPARSE_DTYPES:
        raise ValueError(f"2:4 values are stored as one of {SPARSE_DTYPES}, got {dtype}")
    out, cols = w.shape
    positions, kept = _keep_2_of_4(w.detach())                              # (out, G, 2)
    nibbles = (positions[..., 0] * 4 + positions[..., 1]).reshape(-1)       # (out * G,) 0..15
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])                # pad to whole bytes
    kept = kept.reshape(out, cols // 2)                                     # (out, in/2)
    scales = None
    if dtype == torch.int8:
        q = quantize_int8(kept, "absmax", "channel")
        values, scales = q.codes, q.scales                                  # (out, in/2), (out,)
    else:
        values = kept.to(dtype)
    return Sparse24(values, pack_4bit(nibbles), (out, cols), scales)


def decompress_2_4(s: Sparse24) -> torch.Tensor:
    """The dense fp32 (out, in) weight a ``Sparse24`` stands for: zeros where it pruned."""
    out, cols = s.shape
    nibbles = unpack_4bit(s.metadata)[:out * cols // 4].long()              # (out * G,)
    positions = torch.stack([nibbles // 4, nibbles % 4], dim=-1)            # (out * G, 2)
    values = s.values.float()                                               # (out, in/2)
    if s.scales is not None:
        values = values * s.scales[:, None]
    return _scatter(positions.reshape(out, -1, 2), values.reshape(out, -1, 2), s.shape)


# ----------------------------------------------------------------------------- low rank

@dataclass
class LowRank:
    """W (out, in) ~ b @ a, the factors stored in ``a.dtype``."""

    a: torch.Tensor             # (rank, in)
    b: torch.Tensor             # (out, rank)

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def numel(self) -> int:
        """Parameters of the dense weight it replaces."""
        return self.b.shape[0] * self.a.shape[1]

    @property
    def nbytes(self) -> int:
        """Exact stored bytes: rank (out + in) numbers in the factors' dtype."""
        return _bytes(self.a) + _bytes(self.b)

    @property
    def bits_per_param(self) -> float:
        """Stored bits per dense parameter: 16 r (out + in) / (out in) in fp16."""
        return 8 * self.nbytes / self.numel

    def dense(self) -> torch.Tensor:
        """b @ a in fp32: (out, in)."""
        return self.b.float() @ self.a.float()


def low_rank(w: torch.Tensor, rank: int, dtype: torch.dtype = torch.float16) -> LowRank:
    """The best rank-``rank`` approximation of w (out, in) (truncated SVD), factors in ``dtype``.

    The singular values are split evenly, b = U sqrt(S), a = sqrt(S) V^T, so that neither
    factor holds all the scale (fp16 keeps its relative precision in both).
    """
    _check_weight(w)
    check_positive("rank", rank)
    if rank > min(w.shape):
        raise ValueError(f"rank={rank} exceeds min(out, in) = {min(w.shape)} of shape "
                         f"{tuple(w.shape)}; a rank that high stores more than the dense weight")
    u, s, vh = torch.linalg.svd(w.detach().double(), full_matrices=False)   # (out,k) (k,) (k,in)
    root = s[:rank].sqrt()
    b = u[:, :rank] * root[None, :]                                         # (out, rank)
    a = root[:, None] * vh[:rank]                                           # (rank, in)
    return LowRank(a.to(dtype), b.to(dtype))


def rank_for_saving(out_features: int, in_features: int, saving: float) -> int:
    """The largest rank r whose factors hold at most (1 - saving) of the dense elements:
    r (out + in) <= (1 - saving) out in; floor(0.375 d) for a d x d matrix at 25%."""
    check_positive("out_features", out_features)
    check_positive("in_features", in_features)
    if not 0 <= saving < 1:
        raise ValueError(f"saving is the fraction of memory saved, in [0, 1) (0.25 for 25%), "
                         f"got {saving}")
    kept = 1 - Fraction(str(saving))            # exact: 0.25 -> 3/4, no float rounding
    rank = math.floor(kept * out_features * in_features / (out_features + in_features))
    if rank < 1:
        raise ValueError(f"no rank saves {saving:.0%} of a ({out_features}, {in_features}) "
                         "matrix: even rank 1 stores more; ask for a smaller saving")
    return rank


# ----------------------------------------------------------------------------- one layer

def compress_weight(method: str, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(approximation (out, in) fp32, stored bytes) of one weight by a method as in ``METHODS``:
    "2:4 D" for D in fp16, bf16, fp32, int8; "low-rank N% D" saves N percent, D in fp16, bf16,
    fp32."""
    weight = weight.detach().float()
    sparse = re.fullmatch(r"2:4 (fp16|bf16|fp32|int8)", method)
    factored = re.fullmatch(r"low-rank (\d+(?:\.\d+)?)% (fp16|bf16|fp32)", method)
    if sparse:
        dtype = torch.int8 if sparse[1] == "int8" else torch_dtype(sparse[1])
        s = compress_2_4(weight, dtype)
        return decompress_2_4(s), s.nbytes
    if factored:
        rank = rank_for_saving(*weight.shape, float(factored[1]) / 100)
        f = low_rank(weight, rank, torch_dtype(factored[2]))
        return f.dense(), f.nbytes
    raise ValueError(f"unknown compression method {method!r}; use one of {METHODS} ('2:4 D' "
                     "with D in fp16, bf16, fp32, int8; 'low-rank N% D' with D in fp16, bf16, "
                     "fp32)")
