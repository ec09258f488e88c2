"""8-bit AdamW: the moments kept as blockwise-quantised 8-bit codes (Dettmers et al., 2022).

"8-bit Optimizers via Block-wise Quantization" stores AdamW's two moments in one byte per
number instead of four. Each moment tensor is cut into blocks of ``block`` numbers; a block
keeps its largest magnitude (``absmax``, fp32) and, per number, the index (uint8) of the
nearest of 256 values of the *dynamic* map after dividing by that absmax. Each step
dequantises the moments, runs AdamW's update in fp32, and requantises them:

    m, v = code[m_codes] * m_absmax, code[v_codes] * v_absmax        # 8-bit -> fp32
    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2                    # AdamW, in fp32
    w = w (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)
    m_codes, m_absmax = nearest(m / absmax(m)), absmax(m)             # fp32 -> 8-bit (v alike)

Bytes of state for a parameter of n numbers: 2 x (n + 4 ceil(n / block)) against AdamW's 8n,
plus the two 256-value maps (2 KiB per optimizer; their lookup tables, 130 KiB, are counted
as "other": they speed up encoding and hold no state). As bitsandbytes (whose 0.50 optimizers this
follows: block 256, ``min_8bit_size`` 4096), the first moment uses the signed map and the
second (never negative) the unsigned one, and parameters under 4096 numbers (norm weights)
keep fp32 moments: their codes would save little and cost the most accuracy. The step runs
``chunk`` numbers (whole blocks) at a time, so its fp32 temporaries are 17 bytes per number of
one chunk (``step_temporary_bytes``), not of the largest parameter.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from labkit.core.units import check_positive
from labkit.predict.formats import (BLOCK, CHUNK, LOOKUP_BYTES, MAP_BYTES,  # noqa: F401
                                    MIN_8BIT_SIZE, eight_bit_state_bytes as state_bytes,
                                    step_temporary_bytes)
from labkit.training.track import MemoryTracker

EXPONENT_BITS = 7          # the dynamic map spans 7 decades: 1e-6 ... 1


# ---- the dynamic (tree) map ----------------------------------------------------------------------
def dynamic_map(signed: bool = True) -> torch.Tensor:
    """The 256 sorted values of the dynamic 8-bit map (bitsandbytes' ``create_dynamic_map``).

    A code is: a sign bit, then e zero bits naming the decade 10^-e (e = 0 ... 6), an indicator
    bit, and 6 - e bits of linear fraction: decade 10^-e holds 2^(6-e) values, the midpoints of
    as many equal bins of [0.1, 1]. Unsigned, the sign bit is one more fraction bit (twice the
    values per decade). With 0 and 1 added: 2 x 127 + 2 = 256 either way. The signed map has
    +1 but not -1 (its lowest value is -0.993): bitsandbytes' map, kept as it is.
    """
    values = [0.0, 1.0]
    for exponent in range(EXPONENT_BITS):                   # 0 ... 6: decades 1e-6 ... 1e0
        count = 2 ** exponent if signed else 2 ** (exponent + 1)
        edges = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        midpoints = (edges[:-1] + edges[1:]) / 2                            # (count,)
        decade = 10 ** (exponent - EXPONENT_BITS + 1) * midpoints
        values += decade.tolist() + ((-decade).tolist() if signed else [])
    return torch.tensor(sorted(values), dtype=torch.float32)                 # (256,)


# ---- the nearest value of a map ------------------------------------------------------------------
@dataclass
class Codebook:
    """A sorted 256-value map and its nearest-value lookup.

    The nearest value's index is the number of midpoints between neighbours that lie below
    (``torch.bucketize``; a tie goes to the lower value). Bucketize is a binary search, ~40 ns
    a number on a laptop CPU: it made an 8-bit step of ``small`` 4x an fp32 one. So a table
    gives, for each 16-bit prefix of a float32 (sign, exponent, 7 bits of mantissa), the index
    at the prefix's lowest number; where no prefix spans two midpoints (checked here; true of
    the dynamic maps), one comparison finishes, 5x faster than the search:
    ``index = table[prefix] + (midpoint[table[prefix]] < x)``.
    """

    values: torch.Tensor                  # (256,) sorted
    midpoints: torch.Tensor               # (256,): the 255 midpoints, then +inf
    prefix_table: torch.Tensor | None     # (65536,) uint8, or None: bucketize every number

    @classmethod
    def of(cls, values: torch.Tensor) -> "Codebook":
        if values.shape != (256,) or not bool((values.diff() > 0).all()):
            raise ValueError("a codebook needs 256 strictly increasing values, e.g. "
                             "dynamic_map(signed=True)")
        midpoints = (values[1:] + values[:-1]) / 2                           # (255,)
        prefixes = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32)        # (65536,)
        ends = torch.stack([prefixes << 16, (prefixes << 16) | 0xFFFF]).view(torch.float32)
        lowest = torch.bucketize(ends.amin(dim=0), midpoints, out_int32=True)
        highest = torch.bucketize(ends.amax(dim=0), midpoints, out_int32=True)
        in_range = (ends.abs() <= 1).all(dim=0)                # normed numbers lie in [-1, 1]
        table = (lowest.to(torch.uint8) if int((highest - lowest)[in_range].max()) <= 1
                 else None)
        return cls(values, torch.cat([midpoints, midpoints.new_tensor([float("inf")])]), table)

    def nearest(self, normed: torch.Tensor) -> torch.Tensor:
        """uint8 index of the nearest value for each number of ``normed`` (fp32, in [-1, 1])."""
        if self.prefix_table is None:
            return torch.bucketize(normed, self.midpoints[:-1], out_int32=True).to(torch.uint8)
        prefixes = (normed.view(torch.int32) >> 16).add_(2 ** 15)           # (n,) 0 ... 65535
        lowest = self.prefix_table[prefixes]                                 # (n,) uint8
        del prefixes                                                         # 4 bytes a number
        return lowest + (self.midpoints[lowest.int()] < normed)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.values, self.midpoints, self.prefix_table) if t is not None]


# ---- blockwise quantisation ----------------------------------------------------------------------
def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """(blocks, block) view of ``flat``, zero-padded (a copy) to a whole number of blocks."""
    blocks = math.ceil(flat.numel() / block)
    if blocks * block != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, blocks * block - flat.numel()))
    return flat.view(blocks, block)


def _codebook(code) -> Codebook:
    return code if isinstance(code, Codebook) else Codebook.of(code)


def quantize_blockwise(x: torch.Tensor, code, block: int = BLOCK, overwrite: bool = False):
    """(uint8 codes shaped as ``x``, fp32 absmax per block): each number divided by its block's
    largest magnitude, then replaced by the index of the nearest value of ``code`` (a 256-value
    map or its ``Codebook``). ``overwrite``: an fp32 ``x`` may be divided in place (no copy)."""
    check_positive("block", block)
    blocked = _blocks(x.detach().reshape(-1).float(), block)                 # (blocks, block)
    absmax = blocked.abs().amax(dim=1)                                       # (blocks,)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]   # 0s stay 0
    normed = (blocked.div_(scale) if overwrite else blocked / scale).view(-1)[:x.numel()]
    return _codebook(code).nearest(normed).view(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code,
                         block: int = BLOCK) -> torch.Tensor:
    """fp32 numbers shaped as ``codes``: each code's map value times its block's absmax."""
    values = code.values if isinstance(code, Codebook) else code
    blocked = _blocks(values[codes.reshape(-1).int()], block)                # (blocks, block)
    return blocked.mul_(absmax[:, None]).view(-1)[:codes.numel()].view(codes.shape)


def _constant_codebook(signed: bool) -> Codebook:
    """The dynamic map's codebook, made on real tensors (it reads its own values) and handed
    to the fake mode as constants when one runs (``labkit.measure_step`` on fake tensors)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        book = Codebook.of(dynamic_map(signed))
    mode = detect_fake_mode()
    if mode is None:
        return book
    return Codebook(*(None if t is None else mode.from_tensor(t)
                      for t in (book.values, book.midpoints, book.prefix_table)))


# ---- the optimizer -------------------------------------------------------------------------------
class AdamW8bit(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter) whose moments are blockwise 8-bit codes between steps.

    State per parameter: ``m_codes``/``v_codes`` (uint8, the parameter's shape), ``m_absmax``/
    ``v_absmax`` (fp32, one per block) and ``step`` (an int); under ``min_8bit_size`` numbers,
    fp32 ``m`` and ``v`` instead. The two maps (``Codebook``) are the optimizer's:
    ``memory_tags`` shows them to ``MemoryTracker``.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, block: int = BLOCK,
                 min_8bit_size: int = MIN_8BIT_SIZE, chunk: int = CHUNK):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, "
                             f"{weight_decay}; e.g. lr=1e-3, eps=1e-8, weight_decay=0.01")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}; "
                             f"e.g. (0.9, 0.999)")
        check_positive("block", block)
        check_positive("min_8bit_size", min_8bit_size)
        if not isinstance(chunk, int) or chunk <= 0 or chunk % block:
            raise ValueError(f"chunk must be a positive multiple of block={block} (whole blocks "
                             f"are requantised), got {chunk!r}; e.g. chunk={CHUNK}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.block, self.min_8bit_size, self.chunk = block, min_8bit_size, chunk
        self.signed_map = _constant_codebook(signed=True)         # first moment: any sign
        self.unsigned_map = _constant_codebook(signed=False)      # second moment: >= 0

    def memory_tags(self) -> list:
        """(tensor, category) for MemoryTracker: the two maps decode the state, so they are
        optimizer state; their lookup tables only speed up encoding ("other")."""
        maps = (self.signed_map, self.unsigned_map)
        return ([(book.values, "optimizer") for book in maps]
                + [(t, "other") for book in maps for t in book.tensors()[1:]])

    def _init_state(self, p: torch.Tensor, state: dict):
        state["step"] = 0
        if p.numel() < self.min_8bit_size:
            state["m"] = torch.zeros_like(p, dtype=torch.float32)
            state["v"] = torch.zeros_like(p, dtype=torch.float32)
            return
        blocks = math.ceil(p.numel() / self.block)
        for name in ("m", "v"):
            state[f"{name}_codes"] = torch.zeros_like(p, dtype=torch.uint8)
            state[f"{name}_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

    def _moments(self, state: dict, lo: int, hi: int):
        """fp32 (m, v) of numbers lo ... hi: views of the stored ones, or new tensors
        dequantised from their codes (lo at a block boundary)."""
        if "m" in state:
            return state["m"].view(-1)[lo:hi], state["v"].view(-1)[lo:hi]
        blocks = slice(lo // self.block, math.ceil(hi / self.block))
        return (dequantize_blockwise(state["m_codes"].view(-1)[lo:hi], state["m_absmax"][blocks],
                                     self.signed_map, self.block),
                dequantize_blockwise(state["v_codes"].view(-1)[lo:hi], state["v_absmax"][blocks],
                                     self.unsigned_map, self.block))

    def _store(self, state: dict, lo: int, hi: int, m: torch.Tensor, v: torch.Tensor):
        """Requantise numbers lo ... hi into the state's own buffers (no new storages)."""
        if "m" in state:
            return                                           # fp32 moments: updated in place
        blocks = slice(lo // self.block, math.ceil(hi / self.block))
        for name, moment, code in (("m", m, self.signed_map), ("v", v, self.unsigned_map)):
            codes, absmax = quantize_blockwise(moment, code, self.block, overwrite=True)
            state[f"{name}_codes"].view(-1)[lo:hi].copy_(codes)
            state[f"{name}_absmax"][blocks].copy_(absmax)
            del codes, absmax                                # before the next moment's codes

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for each parameter with a gradient, ``chunk`` numbers at a time."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                weights, grad = p.view(-1), p.grad.reshape(-1)                # (n,) each
                for lo in range(0, p.numel(), self.chunk):
                    hi = min(lo + self.chunk, p.numel())
                    self._update(weights[lo:hi], grad[lo:hi], state, lo, hi, group)
        return loss

    def _update(self, weights, grad, state: dict, lo: int, hi: int, group: dict):
        """Dequantise, update in fp32, requantise numbers lo ... hi of one parameter (a method:
        its fp32 temporaries, a few bytes per number of the chunk, die with it)."""
        lr, (beta1, beta2) = group["lr"], group["betas"]
        m, v = self._moments(state, lo, hi)                    # fp32, (hi - lo,)
        grad = grad.float()
        m.lerp_(grad, 1 - beta1)                               # as torch.optim.AdamW's for-loop
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        updated = weights.float()                              # weights itself when fp32
        updated.mul_(1 - lr * group["weight_decay"])
        bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
        denom = v.sqrt().div_(math.sqrt(bias2)).add_(group["eps"])
        updated.addcdiv_(m, denom, value=-lr / bias1)
        if updated is not weights:
            weights.copy_(updated)
        del grad, updated, denom                               # before requantising: a lower peak
        self._store(state, lo, hi, m, v)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of ``optimizer``'s state as ``MemoryTracker`` counts them (category "optimizer")."""
    with MemoryTracker(optimizer=optimizer) as mt:
        pass
    return mt.by_category["optimizer"]
