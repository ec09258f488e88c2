"""DeepSpeed-Ulysses (Jacobs et al., 2023): context parallelism by all-to-all instead of a ring.

Each of ``cp`` ranks holds a contiguous slice of the sequence for every head. One all-to-all
turns that into every token for heads / cp of the heads; attention runs as on one GPU (any
kernel, FlashAttention included); a second all-to-all turns the output back:

    q (B, H, T/cp, d)  --all_to_all-->  (B, H/cp, T, d)  --attention-->  --all_to_all-->  (B, H, T/cp, d)

Its limit here, as in DeepSpeed's first version: heads and key/value heads must divide by cp
(some implementations repeat the key/value heads instead). Each all-to-all sends (cp - 1) / cp
of the rank's q, k, v or output, four in the forward pass and four in the backward: the bytes
per rank fall as 1 / cp, where the ring's approach 3 x the whole sequence's K/V. The all-to-alls sit right
before and after the attention that needs them: they cannot overlap it, where the ring's next
block travels while the present one computes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.core.units import check_positive
from labkit.parallel.comm import AllToAll, CommCounter
from labkit.parallel.context.ring import check_sequence_shards


def contiguous_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of the sequence along ``dim``: (..., T, ...) -> T/cp."""
    check_positive("cp (context-parallel ranks)", cp)
    if x.shape[dim] % cp:
        raise ValueError(f"the sequence ({x.shape[dim]} tokens) must split into cp = {cp} equal "
                         f"slices: pad it to a multiple of {cp}")
    return x.chunk(cp, dim=dim)[rank]


def _heads_to_sequence(x, comm: CommCounter, name: str):
    """(B, H, T/cp, d) -> (B, H/cp, T, d): every rank's tokens for my heads."""
    B, H, T, d = x.shape
    cp = comm.world
    rows = x.reshape(B, cp, H // cp, T, d).transpose(0, 1).contiguous()     # (cp, B, H/cp, T, d)
    got = AllToAll.apply(rows.flatten(0, 1), [B] * cp, [B] * cp, comm, name)  # (cp*B, H/cp, T, d)
    return got.view(cp, B, H // cp, T, d).permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * T, d)


def _sequence_to_heads(x, comm: CommCounter, name: str):
    """(B, H/cp, T, d) -> (B, H, T/cp, d): my tokens for every head."""
    B, h, T, d = x.shape
    cp = comm.world
    rows = x.view(B, h, cp, T // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, h, T/cp, d)
    got = AllToAll.apply(rows.flatten(0, 1), [B] * cp, [B] * cp, comm, name)  # (cp*B, h, T/cp, d)
    return got.view(cp, B, h, T // cp, d).transpose(0, 1).reshape(B, cp * h, T // cp, d)


def ulysses_attention(q, k, v, comm: CommCounter, attention=None):
    """Causal attention over the whole sequence from this rank's ``contiguous_shard`` of
    q (B, H, T, d), k and v (B, Hkv, T, d): (B, H, T, dv) for this rank's tokens.
    ``attention``: the core run on (B, H/cp, seq, d) - SDPA's causal one by default."""
    check_sequence_shards(q, k, v, "contiguous_shard")
    cp = comm.world
    for what, heads in (("query heads", q.shape[1]), ("key/value heads", k.shape[1])):
        if heads % cp:
            raise ValueError(f"Ulysses splits heads over cp ranks: {what} ({heads}) must divide "
                             f"by cp = {cp}; choose cp among the divisors of {heads}, or use "
                             f"ring attention (any number of heads)")
    q, k, v = (_heads_to_sequence(t, comm, f"all_to_all {n}") for t, n in zip((q, k, v), "qkv"))
    if attention is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=k.shape[1] != q.shape[1])
    else:
        out = attention(q, k, v)
    return _sequence_to_heads(out, comm, "all_to_all out")
