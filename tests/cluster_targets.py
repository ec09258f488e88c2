"""Functions the cluster tests run on each rank: spawn imports them by name, so they live here."""
import os
import time

import torch
import torch.distributed as dist


def fail_on_rank(ctx, bad_rank):
    """bad_rank raises; the others wait in a collective that can never complete."""
    if ctx.rank == bad_rank:
        raise ZeroDivisionError(f"boom on rank {ctx.rank}")
    dist.barrier(group=ctx.group)
    return ctx.rank


def sleep_on_rank(ctx, slow_rank, seconds):
    """slow_rank sleeps past any test's timeout; the others return at once."""
    if ctx.rank == slow_rank:
        time.sleep(seconds)
    return ctx.rank


def hold_bytes(ctx, n):
    """Rank r allocates (r + 1) * n bytes and returns the buffer's size."""
    buf = torch.empty((ctx.rank + 1) * n, dtype=torch.uint8)  # ((r+1) n,)
    return buf.nbytes


def report(ctx):
    """What each rank's ctx holds, as plain values."""
    return ctx.rank, ctx.world_size, dist.get_world_size(group=ctx.group), str(ctx.device)


def exit_on_rank(ctx, bad_rank):
    """bad_rank dies without a word (as a crash or the OOM killer would end it)."""
    if ctx.rank == bad_rank:
        os._exit(3)
    dist.barrier(group=ctx.group)
    return ctx.rank
