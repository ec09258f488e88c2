"""Functions the context-parallel tests run on every rank of a local gloo cluster."""
import torch
import torch.nn.functional as F

from labkit.parallel.comm import CommCounter
from labkit.parallel.context.ring import ring_attention, zigzag_shard
from labkit.parallel.context.ulysses import contiguous_shard, ulysses_attention


def full_inputs(B, H, Hkv, T, d, dv, dtype=torch.float64, seed=0):
    """q, k, v and the output's gradient for the whole sequence, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, d, generator=g, dtype=dtype),
            torch.randn(B, Hkv, T, d, generator=g, dtype=dtype),
            torch.randn(B, Hkv, T, dv, generator=g, dtype=dtype),
            torch.randn(B, H, T, dv, generator=g, dtype=dtype))


def attention_shards(ctx, cases, kind="ring", block=128):
    """For each (B, H, Hkv, T, d, dv): this rank's output and gradients of q, k, v, and the
    bytes it sent."""
    comm = CommCounter(ctx.group)
    shard = zigzag_shard if kind == "ring" else contiguous_shard
    results = []
    for case in cases:
        q, k, v, grad = full_inputs(*case)
        mine = [shard(t, ctx.world_size, ctx.rank, dim=2).clone().requires_grad_()
                for t in (q, k, v)]
        comm.reset()
        if kind == "ring":
            out = ring_attention(*mine, comm, block=block)
        else:
            out = ulysses_attention(*mine, comm)
        out.backward(shard(grad, ctx.world_size, ctx.rank, dim=2))
        results.append(dict(out=out.detach(), grads=[t.grad for t in mine], sent=dict(comm.sent)))
    return results


def one_process(B, H, Hkv, T, d, dv, dtype=torch.float64, seed=0):
    """SDPA on the whole sequence: its output and gradients."""
    q, k, v, grad = full_inputs(B, H, Hkv, T, d, dv, dtype, seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)
    out.backward(grad)
    return out.detach(), [q.grad, k.grad, v.grad]


def trained(ctx, kind, model_name="tiny", seq=64, steps=2, dtype=torch.float64):
    """``cp_train`` in fp64 with its final weights: the mechanism's comparison with one process."""
    from labkit.parallel.context.context_parallel import cp_train
    return cp_train(ctx, model_name, 2, seq, steps, kind, dtype=dtype, block=16, keep_weights=True)
