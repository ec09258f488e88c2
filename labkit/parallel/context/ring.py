"""Ring attention: causal attention over a sequence split across ``cp`` ranks, each rank holding
at most three ranks' keys and values at once - its own, the block it sends, the block arriving
(Liu et al., 2023; the load-balanced "zigzag" split of Megatron-LM's context parallelism and of
ring-flash-attn).

Each rank holds its queries, keys and values for 2 of the sequence's 2 cp chunks - chunk r and
chunk 2 cp - 1 - r - so that under the causal mask every rank does the same work:

    positions  0 ........................................ T
    chunks     | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |     (cp = 4)
    rank       | 0 | 1 | 2 | 3 | 3 | 2 | 1 | 0 |

Forward, cp steps: attend to the K/V block held, pass it to the next rank while computing,
receive the previous rank's. Each step gives an output and a log-sum-exp per row; FlashAttention's
online softmax merges them. Backward, cp steps again: the K/V blocks go round once more, and the
gradient of each block's keys and values travels with it, each rank adding its part, until it
comes home.

The blocks run ``labkit.transformer.attention``'s tiled loops, masked by the tokens' positions;
the gradients dK, dV travel in fp32 (the blocks' dtype; torch's ``context_parallel`` also sends
them in fp32). Production runs a FlashAttention kernel per block, and moves K/V in more than one
way: TransformerEngine (Megatron-LM) has ``cp_comm_type`` "p2p" (this ring), "all_gather", "a2a"
(Ulysses) and "a2a+p2p"; torch 2.13's experimental ``context_parallel`` all-gathers K/V after the
first block by default (``set_rotate_method("alltoall")`` shifts them rank to rank).
"""
from __future__ import annotations

import torch

from labkit.core.units import check_positive
from labkit.parallel.comm import CommCounter
from labkit.transformer.attention import (Positions, _check_heads, _check_shapes,
                                          attend_blocks, attend_blocks_backward)


# ---- the split ----------------------------------------------------------------------------------
def _check_split(seq: int, cp: int) -> None:
    check_positive("cp (context-parallel ranks)", cp)
    if seq % (2 * cp):
        other = f", or choose cp dividing {seq // 2}" if seq % 2 == 0 else ""
        raise ValueError(f"the sequence ({seq} tokens) must split into 2 x cp = {2 * cp} equal "
                         f"chunks: pad it to a multiple of {2 * cp}{other}")


def check_sequence_shards(q, k, v, split: str) -> None:
    """A ValueError naming the fix unless q (B, H, T, d), k (B, Hkv, T, d), v (B, Hkv, T, dv)
    hold one rank's T tokens, Hkv dividing H."""
    if not q.dim() == k.dim() == v.dim() == 4 or not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError(f"context parallelism takes q (B, H, T, d), k and v (B, Hkv, T, d) with "
                         f"one T (this rank's tokens), got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}: split the sequence with {split}")
    _check_shapes(q, k, v)
    _check_heads(q.shape[1], k.shape[1])


def zigzag_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions rank ``rank`` holds: chunk rank, then chunk 2 cp - 1 - rank. (2 seq / 2cp,)."""
    _check_split(seq, cp)
    c = seq // (2 * cp)
    far = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange(far * c, (far + 1) * c, device=device)])


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``x`` along ``dim`` (the sequence): (..., T, ...) -> (..., T/cp, ...)."""
    _check_split(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Every rank's ``zigzag_shard``, in rank order -> the whole sequence along ``dim``."""
    cp = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(cp)] +
                     [halves[r][1] for r in reversed(range(cp))], dim=dim)


# ---- the ring -----------------------------------------------------------------------------------
def _pack(a, b):
    """Two tensors as one flat message (one send per step)."""
    return torch.cat([a.flatten(), b.flatten()])


def _unpack(flat, a_shape, b_shape):
    n = a_shape.numel()
    return flat[:n].view(a_shape), flat[n:].view(b_shape)


def _merge(out, lse, out_s, lse_s):
    """Fold one block's (out_s, lse_s) into the running (out, lse), in place: FlashAttention's
    online softmax, one block of keys at a time. out (B, T, H, dv), lse (B, H, T)."""
    new = torch.logaddexp(lse, lse_s)                                             # (B, H, T)
    shift = new.masked_fill(new == float("-inf"), 0)              # rows seeing no key yet
    out.mul_(torch.exp(lse - shift).transpose(1, 2)[..., None])
    out.add_(out_s * torch.exp(lse_s - shift).transpose(1, 2)[..., None])
    lse.copy_(new)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys, passed round a ring.

    q (B, H, T, d), k (B, Hkv, T, d), v (B, Hkv, T, dv): this rank's ``zigzag_shard`` of the
    sequence. Keeps what FlashAttention keeps (q, k, v, the output, a log-sum-exp per row), for
    T = seq / cp tokens; while a block travels, two more K/V blocks (the one sent, the one
    arriving) and in backward two of their fp32 gradients.
    """

    @staticmethod
    def forward(ctx, q, k, v, comm: CommCounter, block: int):
        B, H, T, _ = q.shape
        cp, rank = comm.world, comm.rank
        work = torch.promote_types(q.dtype, torch.float32)             # the blocks' dtype
        q_pos = zigzag_positions(T * cp, cp, rank, q.device)
        out = q.new_zeros(B, T, H, v.shape[-1], dtype=work)                     # (B, T, H, dv)
        lse = q.new_full((B, H, T), float("-inf"), dtype=work)                  # (B, H, T)
        out_s, lse_s = torch.empty_like(out), torch.empty_like(lse)            # one block's
        kv = _pack(k, v)
        for step in range(cp):
            held = (rank - step) % cp                       # whose keys and values I hold now
            if step < cp - 1:                               # pass them on while computing
                pending = comm.exchange(kv, (rank + 1) % cp, (rank - 1) % cp, "ring K/V")
            k_s, v_s = _unpack(kv, k.shape, v.shape)
            positions = Positions(q_pos, zigzag_positions(T * cp, cp, held, q.device))
            attend_blocks(q, k_s, v_s, out_s, lse_s, positions, block)
            _merge(out, lse, out_s, lse_s)
            if step < cp - 1:
                kv = pending.wait()
        del out_s, lse_s, kv
        out = out.to(q.dtype).transpose(1, 2)                                   # (B, H, T, dv)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.block = comm, block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, block = ctx.comm, ctx.block
        cp, rank = comm.world, comm.rank
        T, work = q.shape[2], lse.dtype
        after, before = (rank + 1) % cp, (rank - 1) % cp
        q_pos = zigzag_positions(T * cp, cp, rank, q.device)
        with torch.autocast(q.device.type, enabled=False):
            delta = (grad_out.to(work) * out.to(work)).sum(dim=-1)                 # (B, H, T)
        dq = torch.zeros(q.shape, dtype=work, device=q.device)
        kv, grads = _pack(k, v), None           # grads: the held block's dK, dV summed so far
        for step in range(cp):
            held = (rank - step) % cp
            if step < cp - 1:
                pending = comm.exchange(kv, after, before, "ring K/V (backward)")
            k_s, v_s = _unpack(kv, k.shape, v.shape)
            positions = Positions(q_pos, zigzag_positions(T * cp, cp, held, q.device))
            # the merged lse: every row saw its own key
            dq_s, dk_s, dv_s = attend_blocks_backward(q, k_s, v_s, grad_out, lse, delta,
                                                      positions, block, every_row_sees_a_key=True)
            dq += dq_s
            mine = _pack(dk_s, dv_s)
            del dq_s, dk_s, dv_s                    # packed: not kept through the next block
            if grads is not None:
                mine += grads.wait()                # what the ranks before me added to it
            # on to the rank that holds this block next; the last step sends it home
            grads = comm.exchange(mine, after, before, "ring dK/dV", tag=1)
            if step < cp - 1:
                kv = pending.wait()
        dk, dv = _unpack(grads.wait(), k.shape, v.shape)           # my own block's, complete
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q, k, v, comm: CommCounter, block: int = 128):
    """Causal ``softmax(q k^T / sqrt(d)) v`` over the whole sequence, from this rank's
    ``zigzag_shard`` of q (B, H, T, d), k and v (B, Hkv, T, d); returns this rank's (B, H, T, dv).
    ``comm``: a ``CommCounter`` over the context-parallel group (its bytes in ``comm.sent``)."""
    check_positive("block (queries and keys per tile)", block)
    check_sequence_shards(q, k, v, "zigzag_shard")
    _check_split(q.shape[2] * comm.world, comm.world)
    return RingAttention.apply(q, k, v, comm, block)
