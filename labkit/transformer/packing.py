"""Packed rows: several documents in one row, each attending only within itself - through one
dense additive mask (``document_mask``), or document by document with no mask
(``VarlenAttention``, flash-attn's varlen kernel given ``cu_seqlens``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def document_mask(doc_ids, dtype):
    """(B, T) document ids -> additive (B, 1, T, T) mask: 0 where query i may see key j (same
    document, j <= i), -inf elsewhere. Made once per forward and shared by every layer: given
    a bool mask, SDPA would make and keep a float copy of it in each layer."""
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal                 # (B, T, T)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    return mask.masked_fill(~allowed, float("-inf")).unsqueeze(1)                  # (B, 1, T, T)


def cu_seqlens(doc_ids) -> tuple[int, ...]:
    """(B, T) document ids -> where each document starts in the B*T tokens laid end to end, and
    B*T: flash-attn's ``cu_seqlens``. A row's padding (id -1) is one more run, as in the mask."""
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)                          # (B, T)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return tuple(starts.flatten().nonzero().flatten().tolist()) + (B * T,)


class Varlen(tuple):
    """``cu_seqlens`` passed where a mask goes: attention runs document by document, no mask."""


def _documents(offsets, T: int):
    """(row, start, end) of each document in its row, from offsets into the B*T tokens."""
    for start, end in zip(offsets[:-1], offsets[1:]):                 # never across rows
        yield start // T, start % T, end - start // T * T


def _causal(q, k, v):
    """One document's causal attention: q (1, H, L, d), k and v (1, Hkv, L, d) -> (1, H, L, dv).
    Four dimensions: with three, the CPU's SDPA falls back to the math path (an L x L matrix)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


class VarlenAttention(torch.autograd.Function):
    """Causal attention inside each document of packed rows with no (T, T) mask: one SDPA call
    per document, written into one output. flash-attn's ``flash_attn_varlen_func`` (given
    ``cu_seqlens``) and FlexAttention's document block mask do it in one kernel on a GPU.

    Keeps q, k and v (the output is wo's input, kept anyway), as the varlen kernel does, but not
    its log-sum-exp per row (B*H*T fp32): the backward runs each document's attention again.
    """

    @staticmethod
    def forward(ctx, q, k, v, offsets):
        B, H, T, _ = q.shape
        out = q.new_empty(B, T, H, v.shape[-1])                        # (B, T, H, dv): wo's layout
        for r, a, b in _documents(offsets, T):
            out[r:r + 1, a:b] = _causal(*(t[r:r + 1, :, a:b] for t in (q, k, v))).transpose(1, 2)
        ctx.save_for_backward(q, k, v)
        ctx.offsets = offsets
        return out.transpose(1, 2)                                     # (B, H, T, dv)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for r, a, b in _documents(ctx.offsets, q.shape[2]):
            piece = [t[r:r + 1, :, a:b].detach().requires_grad_() for t in (q, k, v)]
            with torch.enable_grad():
                y = _causal(*piece)                                     # (1, H, L, dv)
            for g, d in zip(torch.autograd.grad(y, piece, grad[r:r + 1, :, a:b]), grads):
                d[r:r + 1, :, a:b] = g
        return *grads, None
