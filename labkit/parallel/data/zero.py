"""ZeRO (Rajbhandari et al., 2020): partition the model states over the data-parallel ranks.

Stage 1 partitions the optimizer state, stage 2 the gradients too, stage 3 the parameters
too. This file holds the byte rules both the paper's formula (``labkit.predict.papers``) and
``labkit.estimate`` use; the mechanism itself is ``labkit.parallel.data.zero_step``.
"""
from __future__ import annotations

SHARDED_FROM_STAGE = {"params": 3, "grads": 2, "optimizer": 1}


def shard(n: int, dp: int) -> int:
    """One rank's share of ``n`` (bytes or elements) split over ``dp`` ranks: the ceiling,
    as a flat buffer padded to a multiple of ``dp`` gives every rank the same share."""
    return -(-n // dp)


def per_rank(n: int, state: str, zero_stage: int, dp: int) -> int:
    """What one rank holds of a model state (``params``, ``grads``, ``optimizer``) of ``n``."""
    return shard(n, dp) if zero_stage >= SHARDED_FROM_STAGE[state] else n


def padded(n: int, dp: int) -> int:
    """Elements of a flat buffer of ``n`` padded so that ``dp`` ranks get equal shards."""
    return shard(n, dp) * dp


def units(block_numels: list[int], rest_numel: int, stage: int) -> list[int]:
    """Elements of each unit ZeRO shards, reduces and gathers as one flat buffer, in the order
    AdamW steps them: stage 1 one unit (the whole model); from stage 2 the rest of the model
    (embedding, final norm, LM head) and then one per block, as
    ``labkit.parallel.data.zero_step``."""
    if stage <= 1:
        return [rest_numel + sum(block_numels)]
    return ([rest_numel] if rest_numel else []) + list(block_numels)


def bytes_sent(numels: list[int], stage: int, dp: int, grad_bytes: int, weight_bytes: int,
               micro_batches: int = 1) -> int:
    """Bytes one rank sends per step over a ring, for units of ``numels`` elements: DDP's
    all-reduce (stage 0) sends 2 (N - 1) / N of the gradients; ZeRO reduce-scatters the
    gradients and all-gathers the weights, (N - 1) / N of each padded unit, the weights twice
    at stage 3 (before the forward and again before the backward): the paper's 2Ψ / 3Ψ. With
    ``micro_batches`` accumulated, stages 2 and 3 reduce-scatter after each, stage 3 gathers
    twice for each; DDP and stage 1 reduce once."""
    if dp == 1:
        return 0
    if stage == 0:
        return sum(2 * (dp - 1) * n * grad_bytes // dp for n in numels)
    scatters, gathers = zero_messages(stage, micro_batches)
    return sum((dp - 1) * shard(n, dp) * (scatters * grad_bytes + gathers * weight_bytes)
               for n in numels)


def replica_bytes(numels: list[int], stage: int, shard_ranks: int, replicas: int,
                  grad_bytes: int, micro_batches: int = 1) -> int:
    """HSDP: bytes one rank sends per step all-reducing its gradient shard of each unit over
    ``replicas`` copies, after each reduce-scatter: 2 (R - 1) / R of the shard."""
    scatters, _ = zero_messages(stage, micro_batches)
    return sum(scatters * (2 * (replicas - 1) * shard(n, shard_ranks) * grad_bytes // replicas)
               for n in numels)


def zero_messages(stage: int, micro_batches: int = 1) -> tuple[int, int]:
    """(reduce-scatters, all-gathers) of each unit per step under ZeRO ``stage`` (1-3)."""
    scatters = micro_batches if stage >= 2 else 1
    gathers = 2 * micro_batches if stage == 3 else 1
    return scatters, gathers
