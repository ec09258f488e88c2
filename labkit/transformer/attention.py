"""Attention three ways, and why the tiled one reads less memory (lab 07).

- ``naive_attention``: softmax(q k^T / sqrt(d)) v written out: the (B, H, T, T) probabilities
  are made in memory and autograd keeps them for the backward pass.
- ``tiled_attention``: FlashAttention's online softmax (Dao et al. 2022; the loop order of
  FlashAttention-2, Dao 2023) in plain PyTorch, as a ``torch.autograd.Function`` taking what
  SDPA takes (any leading dims, any number of keys, grouped kv heads). Queries and
  keys are taken a block at a time with a running max and sum; the forward pass keeps only
  q, k, v, the output and one log-sum-exp per row, and the backward pass recomputes the
  probabilities block by block.
- "sdpa": ``F.scaled_dot_product_attention``, PyTorch's fused kernel (``labkit.transformer.model``'s
  default), which keeps the same tensors as the tiled one.

``labkit.transformer.traffic`` counts what each reads and writes in GPU memory (the paper's
Theorem 2) for the on-chip memory of real GPUs; its names are re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.core.recipe import ATTENTION_IMPLS  # noqa: F401  (the vocabulary lives in the core)
from labkit.core.units import check_choice, check_positive, dtype_bytes
from labkit.predict.layers import Dtypes, attention_core_saved
from labkit.transformer.traffic import (KiB, LOOP_ORDERS, SRAM_PER_SM, TILE, Sram,  # noqa: F401
                                        fitted_block, hbm_accesses, hbm_ratio,   # re-exported
                                        hbm_ratio_all_l2_hits, hbm_ratio_tiles)


# ---- naive: the (T, T) matrix in memory -------------------------------------------------------
def soft_cap(x, cap: float):
    """cap * tanh(x / cap) (Gemma 2's soft-capping of scores and logits); x itself if cap is 0.
    Autograd keeps the tanh's output, a tensor the size of x."""
    return torch.tanh(x / cap) * cap if cap else x


def repeat_kv(x, groups: int):
    """(B, Hkv, T, d) -> (B, Hkv * groups, T, d): each key/value head copied for its queries."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def naive_attention(q, k, v, causal: bool = True, softcap: float = 0.0, mask=None,
                    window: int = 0):
    """softmax(q k^T / sqrt(d) + mask) v, every matrix made in memory.

    q: (B, H, T, d); k, v: (B, Hkv, Tk, d) with Hkv dividing H (grouped-query attention: the
    key and value heads are repeated). Causal: query i sees keys 0..i (top-left, as SDPA).
    Autograd keeps the probabilities (B, H, T, Tk) - in fp32, and a 16-bit copy for 16-bit
    inputs or under autocast - the repeated k and v, and q. ``softcap`` > 0: the scores become softcap * tanh(s / softcap)
    first (Gemma 2, as transformers' eager attention), which keeps the tanh's output too.
    ``mask``: bool (T, Tk), True where a query may see a key, in place of ``causal``.
    ``window`` > 0 (causal): query i sees only keys i - window + 1 .. i (a sliding window).
    """
    H, T, d, Tk = q.shape[1], q.shape[2], q.shape[3], k.shape[2]
    _check_heads(H, k.shape[1])
    k, v = repeat_kv(k, H // k.shape[1]), repeat_kv(v, H // v.shape[1])      # (B, H, Tk, d)
    # scale the scores, not q: a scaled copy of q would be kept for the backward pass too
    scores = (q @ k.transpose(-2, -1)) * d ** -0.5                          # (B, H, T, Tk)
    scores = soft_cap(scores, softcap)                  # tanh keeps its output for backward
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif causal:   # an additive mask: adding keeps nothing for backward (masked_fill keeps it)
        future = torch.full((T, Tk), float("-inf"), dtype=scores.dtype,
                            device=scores.device).triu(1)                     # (T, Tk)
        if window:                                      # and keys past the window: a band
            future = future + torch.full_like(future, float("-inf")).tril(-window)
        scores = scores + future
    # 16-bit scores get an fp32 softmax, as Meta's LLaMA code and transformers' eager
    # attention run it (and CUDA's autocast; CPU's would leave it in bf16): autograd keeps the
    # fp32 probabilities and the 16-bit copy the matmul with v takes
    low = scores.dtype in (torch.float16, torch.bfloat16)
    fp32 = torch.float32 if low or torch.is_autocast_enabled(q.device.type) else None
    probs = scores.softmax(dim=-1, dtype=fp32)                                 # (B, H, T, Tk)
    return probs.to(v.dtype) @ v                                               # (B, H, T, dv)


def _check_heads(heads: int, kv_heads: int) -> None:
    if heads % kv_heads:
        raise ValueError(f"kv heads ({kv_heads}) must divide query heads ({heads}): choose "
                         f"kv_heads among the divisors of {heads}")


# ---- tiled: online softmax, block by block ----------------------------------------------------
def _check_shapes(q, k, v) -> None:
    """A ValueError naming the fix for q, k, v the tiled core cannot take."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not q.dim() == k.dim() == v.dim() >= 2:
        raise ValueError(f"q, k and v must be (..., T, d) with as many dims each, got {shapes}: "
                         f"give k and v q's dims (unsqueeze the missing ones)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim (their last), got {shapes}: "
                         f"project them to the same d")
    if k.shape[-2] != v.shape[-2] or k.shape[-2] == 0:
        raise ValueError(f"k and v must hold the same number of keys, one or more, got {shapes}: "
                         f"give one value per key")
    if q.dim() == 2:
        return
    if k.shape[-3] != v.shape[-3]:
        raise ValueError(f"k and v must have as many heads, got {shapes}: give each key head "
                         f"its value head")
    _check_heads(q.shape[-3], k.shape[-3])
    if not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        raise ValueError(f"q, k and v must have the same dims before the heads, got {shapes}: "
                         f"expand k and v to q's leading dims {tuple(q.shape[:-3])}")


def _as_4d(x):
    """(..., H, T, d) -> (B, H, T, d), every leading dim in B (a view where strides allow);
    (T, d) -> (1, 1, T, d); a (B, H, T, d) tensor is returned as it is."""
    return x.flatten(0, -4) if x.dim() >= 4 else x.view((1,) * (4 - x.dim()) + x.shape)


def _query_block(q, start: int, end: int, groups: int, dtype):
    """q's rows start..end of every head, in ``dtype``, grouped under their key/value head:
    (B, H, T, d) -> (B, Hkv, groups * rows, d), so one matmul with k (B, Hkv, cols, d) serves
    a whole group of query heads (no repeated k or v)."""
    B, H, _, d = q.shape
    block = q[:, :, start:end].to(dtype)                                       # (B, H, rows, d)
    return block.reshape(B, H // groups, groups * (end - start), d)


def _ungroup(x, groups: int):
    """(B, Hkv, groups * rows, w) -> (B, H, rows, w): back to one row block per query head."""
    B, Hkv, n, w = x.shape
    return x.reshape(B, Hkv * groups, n // groups, w)


class Positions:
    """Where each query and key sits in the sequence, for the causal mask: query i sees key j
    when k_pos[j] <= q_pos[i] (and, with a ``window``, q_pos[i] - k_pos[j] < window). Both
    ascending (1-D tensors or lists). ``None`` in their place: no mask (every key seen). Kept
    as lists: a tile's mask is made only where it is needed."""

    def __init__(self, q_pos, k_pos, window: int = 0):
        self.device = q_pos.device if isinstance(q_pos, torch.Tensor) else None
        self._q, self._k = (p.tolist() if isinstance(p, torch.Tensor) else list(p)
                            for p in (q_pos, k_pos))
        self.window = window

    @classmethod
    def top_left(cls, Tq: int, Tk: int, device, window: int = 0):
        """Query i sees keys 0..i, as SDPA's ``is_causal`` (the last ``window`` of them)."""
        positions = cls([], [], window)
        positions.device, positions._q, positions._k = device, range(Tq), range(Tk)
        return positions

    def stale(self, i: int, j_end: int) -> bool:
        """True if every key of a tile ending at j_end is past the window of rows i.. ."""
        return bool(self.window) and self._k[j_end - 1] <= self._q[i] - self.window

    def skips(self, i: int, i_end: int, j: int) -> bool:
        """True if no query of rows i..i_end sees the first key of tile j (nor any after it)."""
        return self._k[j] > self._q[i_end - 1]

    def future(self, i: int, i_end: int, j: int, j_end: int, groups: int):
        """(groups * rows, cols) bool, True where a query would see a key past it (or, with a
        window, too far back); None if no query of the tile would."""
        near = not self.window or self._k[j] > self._q[i_end - 1] - self.window
        if self._k[j_end - 1] <= self._q[i] and near:
            return None
        rows = self._positions(self._q, i, i_end).repeat(groups)                  # (groups*rows,)
        cols = self._positions(self._k, j, j_end)                                 # (cols,)
        hidden = rows[:, None] < cols[None, :]
        return hidden if near else hidden | (rows[:, None] - cols[None, :] >= self.window)

    def _positions(self, positions, start: int, end: int):
        """positions[start:end] as a tensor: made on the device for a range (no copy from the
        host), from the list otherwise."""
        if isinstance(positions, range):
            return torch.arange(positions[start], positions[end - 1] + 1, device=self.device)
        return torch.tensor(positions[start:end], device=self.device)


def _cap(s, softcap: float):
    """Soft-capped scores softcap * tanh(s / softcap) and the tanh (None when softcap is 0)."""
    if not softcap:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def _mask_future(s, positions, i: int, i_end: int, j: int, j_end: int, groups: int) -> None:
    """-inf in the scores ``s`` where a query would see a key past it (nothing without positions)."""
    future = positions.future(i, i_end, j, j_end, groups) if positions is not None else None
    if future is not None:
        s.masked_fill_(future, float("-inf"))


def attend_blocks(q, k, v, out, lse, positions, block: int, softcap: float = 0.0):
    """FlashAttention-2's forward loop: ``out`` (B, T_q, H, dv) and ``lse`` (B, H, T_q) written
    in place, q (B, H, T_q, d) against k, v (B, Hkv, T_k, d | dv), ``block`` rows and columns
    at a time, in ``lse``'s dtype. A row that sees no key gets 0 and a log-sum-exp of -inf.
    ``softcap`` > 0 caps each tile's scores (FlashAttention-2's ``softcap``)."""
    B, H, Tq, _ = q.shape
    Tk, dv, work = k.shape[2], v.shape[-1], lse.dtype
    g, scale = H // k.shape[1], q.shape[-1] ** -0.5
    with torch.autocast(q.device.type, enabled=False):         # the blocks compute in `work`
        for i in range(0, Tq, block):
            i_end = min(i + block, Tq)
            qi = _query_block(q, i, i_end, g, work) * scale                # (B, Hkv, g*rows, d)
            row_max = qi.new_full(qi.shape[:-1], float("-inf"))            # (B, Hkv, g*rows)
            row_sum = qi.new_zeros(qi.shape[:-1])                          # (B, Hkv, g*rows)
            acc = qi.new_zeros(*qi.shape[:-1], dv)                         # (B, Hkv, g*rows, dv)
            for j in range(0, Tk, block):
                if positions is not None and positions.skips(i, i_end, j):
                    break                                    # causal: no key past the last row
                j_end = min(j + block, Tk)
                if positions is not None and positions.stale(i, j_end):
                    continue                                 # a window: no row reaches back
                kj = k[:, :, j:j_end].to(work)                             # (B, Hkv, cols, d)
                vj = v[:, :, j:j_end].to(work)                             # (B, Hkv, cols, dv)
                s, _ = _cap(qi @ kj.transpose(-2, -1), softcap)            # (B, Hkv, g*rows, cols)
                _mask_future(s, positions, i, i_end, j, j_end, g)         # a diagonal block
                new_max = torch.maximum(row_max, s.amax(dim=-1))
                shift = new_max.masked_fill(new_max == float("-inf"), 0)  # rows seeing no key yet
                p = torch.exp(s - shift[..., None])                        # (B, Hkv, g*rows, cols)
                rescale = torch.exp(row_max - shift)          # what the old sums were counted in
                row_sum = row_sum * rescale + p.sum(dim=-1)
                acc = acc * rescale[..., None] + p @ vj
                row_max = new_max
            o = _ungroup(acc / row_sum.masked_fill(row_sum == 0, 1)[..., None], g)  # (B, H, rows, dv)
            out[:, i:i_end] = o.transpose(1, 2)
            lse[:, :, i:i_end] = _ungroup((row_max + row_sum.log())[..., None], g)[..., 0]


def attend_blocks_backward(q, k, v, grad_out, lse, delta, positions, block: int,
                           every_row_sees_a_key: bool = False, softcap: float = 0.0):
    """FlashAttention-2's backward loop: (dq, dk, dv) in ``lse``'s dtype, the probabilities
    recomputed block by block from q, k and the rows' log-sum-exp ``lse`` (B, H, T_q);
    ``delta`` (B, H, T_q) is rowsum(dO * O). All four (B, H | Hkv, T, d) as in the forward.
    ``every_row_sees_a_key``: lse has no -inf row, so no check (a device sync) is needed."""
    B, H, Tq, _ = q.shape
    Tk, g, scale, work = k.shape[2], H // k.shape[1], q.shape[-1] ** -0.5, lse.dtype
    if not every_row_sees_a_key and torch.isinf(lse).any():   # rows that saw no key: s = -inf
        lse = lse.masked_fill(torch.isinf(lse), 0)
    with torch.autocast(q.device.type, enabled=False):
        dq = torch.zeros(q.shape, dtype=work, device=q.device)                  # (B, H, T_q, d)
        dk = torch.zeros(k.shape, dtype=work, device=k.device)                # (B, Hkv, T_k, d)
        dv = torch.zeros(v.shape, dtype=work, device=v.device)               # (B, Hkv, T_k, dv)
        for j in range(0, Tk, block):                    # each key block once, as in the paper
            j_end = min(j + block, Tk)
            kj = k[:, :, j:j_end].to(work)                                 # (B, Hkv, cols, d)
            vj = v[:, :, j:j_end].to(work)                                 # (B, Hkv, cols, dv)
            for i in range(0, Tq, block):
                i_end = min(i + block, Tq)
                if positions is not None and (positions.skips(i, i_end, j)
                                              or positions.stale(i, j_end)):
                    continue                             # causal or a window: no row sees it
                qi = _query_block(q, i, i_end, g, work)                    # (B, Hkv, g*rows, d)
                doi = _query_block(grad_out, i, i_end, g, work)            # (B, Hkv, g*rows, dv)
                lse_i = _query_block(lse[..., None], i, i_end, g, work)         # (.., g*rows, 1)
                delta_i = _query_block(delta[..., None], i, i_end, g, work)      # (.., g*rows, 1)
                s, t = _cap((qi @ kj.transpose(-2, -1)) * scale, softcap)  # (B, Hkv, g*rows, cols)
                _mask_future(s, positions, i, i_end, j, j_end, g)
                p = torch.exp(s - lse_i)                      # the forward's probabilities again
                dv[:, :, j:j_end] += p.transpose(-2, -1) @ doi         # summed over the group
                ds = p * (doi @ vj.transpose(-2, -1) - delta_i)          # softmax's backward
                if t is not None:
                    ds = ds * (1 - t * t)                            # through the cap's tanh
                dk[:, :, j:j_end] += (ds.transpose(-2, -1) @ qi) * scale
                dq[:, :, i:i_end] += _ungroup(ds @ kj, g) * scale
    return dq, dk, dv


class TiledAttention(torch.autograd.Function):
    """FlashAttention's forward and backward passes (Algorithms 1 and 2 of FlashAttention-2)
    in PyTorch: every block in fp32 (fp64 for fp64 inputs), never a (T_q, T_k) matrix, never
    repeated key/value heads. Takes what ``tiled_attention`` takes.

    Keeps for backward: q, k, v, the output O (in q's dtype) and the log-sum-exp of each row
    (B, H, T_q) in the blocks' dtype - what SDPA's flash kernel keeps.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, block: int, softcap: float = 0.0, window: int = 0):
        _check_shapes(q, k, v)
        inputs, shape = (q, k, v), (*q.shape[:-1], v.shape[-1])                # (..., T_q, dv)
        q, k, v = _as_4d(q), _as_4d(k), _as_4d(v)      # (B, H, T_q, d), (B, Hkv, T_k, d or dv)
        B, H, Tq, _ = q.shape
        work = torch.promote_types(q.dtype, torch.float32)           # the blocks' dtype
        out = q.new_empty(B, Tq, H, v.shape[-1])  # (B, T_q, H, dv): wo's layout, so no copy later
        lse = q.new_empty(B, H, Tq, dtype=work)                                  # (B, H, T_q)
        positions = Positions.top_left(Tq, k.shape[2], q.device, window) if causal else None
        attend_blocks(q, k, v, out, lse, positions, block, softcap)
        out = out.transpose(1, 2).view(shape)                # (B, H, T_q, dv) as (..., T_q, dv)
        ctx.save_for_backward(*inputs, out, lse)
        ctx.causal, ctx.block, ctx.softcap, ctx.window = causal, block, softcap, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        shapes = q.shape, k.shape, v.shape
        q, k, v, out, grad_out = (_as_4d(t) for t in (q, k, v, out, grad_out))
        positions = (Positions.top_left(q.shape[2], k.shape[2], q.device, ctx.window)
                     if ctx.causal else None)
        work = lse.dtype
        with torch.autocast(q.device.type, enabled=False):
            # D = rowsum(dO * O): the softmax's backward needs it once per row
            delta = (grad_out.to(work) * out.to(work)).sum(dim=-1)                # (B, H, T_q)
        # causal top-left: every row sees key 0; not causal: every key
        dq, dk, dv = attend_blocks_backward(q, k, v, grad_out, lse, delta, positions, ctx.block,
                                            every_row_sees_a_key=True, softcap=ctx.softcap)
        grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return (*(grad.view(shape) for grad, shape in zip(grads, shapes)), None, None, None, None)


def tiled_attention(q, k, v, causal: bool = True, block: int = 128, softcap: float = 0.0,
                    window: int = 0):
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)``'s result,
    ``block`` queries by ``block`` keys at a time.

    q: (..., H, T_q, d); k, v: (..., Hkv, T_k, d) with Hkv dividing H, or all three (T, d).
    Returns (..., H, T_q, dv).
    Causal: query i sees keys 0..i (top-left, as SDPA; FlashAttention-2's kernel: bottom-right).
    ``softcap`` > 0: each tile's scores are capped as ``naive_attention`` caps them, and the
    backward pass recomputes the tanh (FlashAttention-2's ``softcap``): nothing more is kept.
    ``window`` > 0 (causal): each query sees its last ``window`` keys, tiles beyond skipped
    (FlashAttention-2's ``window_size``).
    """
    check_positive("block (queries and keys per tile)", block)
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a number >= 0 (0: no soft-capping), got {softcap!r}")
    return TiledAttention.apply(q, k, v, causal, block, float(softcap), int(window))


# ---- measured: one core's forward + backward ------------------------------------------------
CORE_LAYOUTS = ("bhnd", "model")   # q, k, v (1, H, T, d)-contiguous, or views of (1, T, H, d)


def core(impl: str, block: int = 128):
    """The causal attention function ``impl`` names: q, k, v (B, H, T, d) -> (B, H, T, d)."""
    check_choice("attention implementation", impl, ATTENTION_IMPLS)
    if impl == "naive":
        return naive_attention
    if impl == "tiled":
        return lambda q, k, v: tiled_attention(q, k, v, block=block)
    return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                              is_causal=True)


def core_inputs(seq: int, heads: int = 8, head_dim: int = 64, dtype=torch.float32,
                device="cpu", layout: str = "bhnd"):
    """q, k, v (1, H, T, d) leaves and the output's gradient, seeded. ``layout="bhnd"``: each
    (1, H, T, d)-contiguous; ``"model"``: the same numbers lying in memory as (1, T, H, d), as a
    model's projections (and o_proj's backward) leave them: SDPA's CPU gradients need no copy
    (the tiled core's, (1, H, T, d)-contiguous, then do)."""
    check_choice("input layout", layout, CORE_LAYOUTS)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, heads, seq, head_dim, generator=g).to(device, dtype)
               for _ in range(4)]
    if layout == "model":                       # (1, T, H, d) in memory, viewed as (1, H, T, d)
        tensors = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors]
    q, k, v, grad = tensors
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def core_peak_bytes(impl: str, seq: int, heads: int = 8, head_dim: int = 64,
                    dtype=torch.float32, device="cpu", block: int = 128,
                    layout: str = "bhnd") -> int:
    """Peak bytes one forward + backward of ``impl`` adds to its inputs (q, k, v and the
    output's gradient), measured by ``labkit.training.track.MemoryTracker``; exact on the CPU.
    ``layout`` as in ``core_inputs``: SDPA's CPU backward writes gradients (1, T, H, d)-major,
    so "bhnd" leaves have one copied into their layout at the peak, "model" ones none."""
    from labkit.training.track import MemoryTracker

    q, k, v, grad = core_inputs(seq, heads, head_dim, dtype, device, layout)
    with MemoryTracker(timeline=False) as mt:
        for t in (q, k, v, grad):        # counted from the start: a view of an untracked
            mt.tag(t, "other")            # input (as tiling takes) would count it later
        before = mt.current
        mt.reset_peak()
        core(impl, block)(q, k, v).backward(grad)
    return mt.peak - before


# ---- the core's bytes by formula (lab 07's panel; tests/test_widgets checks them) ----------
CORE_DTYPE = "bf16"              # the core's q, k, v, output and gradients (its tiles: fp32)


@dataclass(frozen=True)
class CoreBytes:
    """One layer's attention core (batch 1, MHA, bf16), beyond its inputs q, k, v (and dO):
    the tensors it keeps for the backward pass, and those alive at its forward + backward
    peak, by name, in bytes."""

    impl: str
    kept: dict
    at_peak: dict

    @property
    def kept_total(self) -> int:
        return sum(self.kept.values())

    @property
    def peak(self) -> int:
        return sum(self.at_peak.values())


def attention_core_bytes(impl: str, seq: int, heads: int, head_dim: int,
                         block: int = TILE) -> CoreBytes:
    """What ``labkit.transformer.attention.core(impl)`` keeps and holds at its peak, by formula: the
    kept tensors are ``labkit.predict.layers``' terms for the core less q, k, v; the backward pass
    adds the gradients. The bytes ``MemoryTracker`` counts when q, k, v are views of (1, T, H, d)
    projections, as in a model (tiled: ``seq`` a multiple of ``block``, two tiles or more)."""
    check_choice("attention implementation", impl, ATTENTION_IMPLS)
    for name, value in (("seq", seq), ("heads", heads), ("head_dim", head_dim),
                        ("block (queries and keys per tile)", block)):
        check_positive(name, value)
    T, H, d = seq, heads, head_dim
    size = dtype_bytes(CORE_DTYPE)
    unit = T * H * d * size                                # one (1, H, T, d) bf16 tensor
    # layers' terms: "q, k, v and <the output>" (of which only the output is not an input
    # here), then the log-sum-exp (sdpa, tiled) or the (T, T) probabilities (naive)
    terms = attention_core_saved(Dtypes.of(CORE_DTYPE), H, H, d, impl)
    kept = {"attention output (wo's input)": unit}
    kept.update({t.name: t.bytes(1, T) for t in terms if not t.name.startswith("q, ")})
    if impl == "naive":     # the softmax's backward: fp32 P (its bf16 copy freed), dP and dS
        pairs = H * T * T
        at_peak = {k: b for k, b in kept.items() if not k.startswith("attention probabilities")}
        return CoreBytes(impl, kept, {
            **at_peak, "fp32 probabilities (their bf16 copy freed)": 4 * pairs,
            "gradients of the probabilities and scores (dP, dS, fp32)": 8 * pairs,
            "gradient of v": unit})
    if impl == "sdpa":              # the fused backward kernel writes dq, dk, dv at once
        return CoreBytes(impl, kept, {**kept, "gradients of q, k, v": 3 * unit})
    # tiled (labkit.transformer.attention.TiledAttention.backward): fp32 gradients filled tile by
    # tile, and either a tile inside the loop (one tile's q, dO, k, v in fp32; 5 tiles: S, P, dS
    # and two temporaries) or the end, after the loop's tiles are freed (the gradients cast to bf16)
    b = min(block, T)
    tile = H * b * b * 4                                   # (1, H, b, b) fp32
    common = {**kept, "D = rowsum(dO * O) (fp32)": 4 * H * T,
              "gradients of q, k, v in fp32 (filled tile by tile)": 2 * 3 * unit}
    end = {"gradients cast back to bf16": 3 * unit}
    inside = {"one tile's q, dO, k, v in fp32": 4 * b * H * d * 4,
              "tiles in the loop: S, P, dS and two temporaries (fp32)": 5 * tile}
    return CoreBytes(impl, kept, {**common, **max(end, inside, key=lambda m: sum(m.values()))})
