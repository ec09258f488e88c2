"""Context parallelism for any labkit model: each of ``cp`` ranks runs the whole model on
1/cp of every sequence; only attention needs the other ranks' tokens (ring or Ulysses).

    tokens (B, T) on every rank --shard--> (B, T/cp) and their positions
      embedding, norms, MLPs, LM head: per token, nothing sent
      attention: ring_attention (K/V round the ring) or ulysses_attention (two all-to-alls)
      backward, then each gradient averaged over the cp ranks (as data parallelism does)

Every rank holds the whole model; activations are those of T/cp tokens
(``labkit.estimate(..., layout=Layout(cp=...))`` counts the step with seq / cp tokens). The
optimizer state is whole on every rank, or sharded over the cp ranks by labkit's ZeRO
(``cp_train(zero_stage=...)``), as Megatron-LM's distributed optimizer and torchtitan's FSDP
shard it over dp x cp (the estimate's ``Layout.data_ranks``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from labkit.core.config import preset
from labkit.core.recipe import Layout
from labkit.core.units import check_choice
from labkit.parallel.cluster import RankContext, default_backend, run
from labkit.parallel.comm import CommCounter
from labkit.parallel.context.ring import ring_attention, zigzag_positions, zigzag_shard
from labkit.parallel.context.ulysses import contiguous_shard, ulysses_attention
from labkit.parallel.data.data_parallel import DataParallel
from labkit.parallel.data.fsdp import ADAMW
from labkit.parallel.data.zero_step import ZeroOptimizer
from labkit.parallel.steps import RankStep, measure_rank
from labkit.predict import estimate
from labkit.transformer.model import build_model, use_attention

KINDS = ("ring", "ulysses")


def shard_sequence(x: torch.Tensor, comm: CommCounter, kind: str) -> torch.Tensor:
    """This rank's tokens of x (B, T, ...): the zigzag chunks for the ring, a slice for Ulysses."""
    check_choice("context-parallel kind", kind, KINDS)
    if kind == "ring":
        return zigzag_shard(x, comm.world, comm.rank)
    return contiguous_shard(x, comm.world, comm.rank)


def positions(batch: int, seq: int, comm: CommCounter, kind: str, device=None) -> torch.Tensor:
    """(batch, seq / cp) positions of this rank's tokens, for the rotary embedding."""
    check_choice("context-parallel kind", kind, KINDS)
    if kind == "ring":
        pos = zigzag_positions(seq, comm.world, comm.rank, device)
    else:
        pos = torch.arange(seq, device=device).chunk(comm.world)[comm.rank]
    return pos.expand(batch, -1)


@contextlib.contextmanager
def context_parallel(comm: CommCounter, kind: str = "ring", block: int = 128):
    """Inside the block, labkit models' attention runs over the cp ranks of ``comm``: give the
    model this rank's tokens (``shard_sequence``) and their ``positions``. Put the backward pass
    inside it too."""
    check_choice("context-parallel kind", kind, KINDS)
    if kind == "ring":
        core = lambda q, k, v: ring_attention(q, k, v, comm, block)      # noqa: E731
    else:
        core = lambda q, k, v: ulysses_attention(q, k, v, comm)         # noqa: E731
    with use_attention(core):
        yield


def cp_loss(model, tokens, targets, comm: CommCounter, kind: str = "ring", block: int = 128):
    """The mean loss of this rank's tokens of (B, T) ``tokens`` and ``targets`` (every rank
    passes the same rows); ranks hold equal token counts, so the mean of their losses is the
    whole sequence's. Call ``.backward()`` inside ``context_parallel``."""
    B, T = tokens.shape
    window = getattr(getattr(model, "cfg", None), "sliding_window", 0)
    if window and T >= window:                   # each rank sees T / cp: check the whole row
        raise ValueError(f"the ring and Ulysses cores have no sliding window ({window} tokens, "
                         f"{T} in the row): use a sequence shorter than the window")
    pos = positions(B, T, comm, kind, tokens.device)
    return model(shard_sequence(tokens, comm, kind), shard_sequence(targets, comm, kind),
                 position_ids=pos)


# ---- measured on a local cluster ------------------------------------------------------------------
@dataclass
class ContextStep(RankStep):
    """One cp rank's steps; ``final``: the weights after them, by name."""

    final: dict | None = None


def cp_train(ctx: RankContext, model_name: str = "tiny", batch: int = 1, seq: int = 64,
             steps: int = 2, kind: str = "ring", dtype=torch.float32, block: int = 128,
             keep_weights: bool = False, zero_stage: int = 0) -> ContextStep:
    """``steps`` AdamW steps of ``model_name`` with the sequence over every rank of ``ctx``
    (cp = world size), the same rows on every rank; the tracker measures the last step.
    ``zero_stage`` 1-3: labkit's ZeRO over the cp ranks (``ZeroOptimizer``), as Megatron-LM's
    distributed optimizer spans dp x cp; 0: every gradient averaged in place."""
    torch.manual_seed(0)
    model = build_model(preset(model_name), dtype=dtype, device=ctx.device)
    comm = CommCounter(ctx.group)
    if zero_stage:
        opt = ZeroOptimizer(model, ctx.group, zero_stage, lr=ADAMW["lr"],
                            weight_decay=ADAMW["weight_decay"], betas=ADAMW["betas"],
                            eps=ADAMW["eps"])
    else:                                       # each gradient all-reduced in place, averaged
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        DataParallel(model, ctx.group).finish_before(opt)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=g)
               .to(ctx.device) for _ in range(steps)]

    def forward(tokens, targets):
        comm.reset()                            # the last step's bytes
        return cp_loss(model, tokens, targets, comm, kind, block)

    with context_parallel(comm, kind, block):
        step = measure_rank(ctx, model, forward, opt, batches, sent=lambda: comm.sent)
    final = ({n: p.detach().clone() for n, p in model.named_parameters()} if keep_weights
             else None)
    return ContextStep(**vars(step), final=final)


def cp_scaling(model_name: str = "small", batch: int = 1, seq: int = 512, cps=(1, 2, 4),
               kind: str = "ring", zero_stage: int = 0, timeout_s: float = 300) -> list[dict]:
    """Each cp's ranks (``steps``) beside ``labkit.estimate`` with ``Layout(cp=...)`` (fp32,
    AdamW as a for-loop, the defaults of the device the ranks run on); one cluster run per cp."""
    rows = []
    for cp in cps:
        steps = run(cp_train, cp, model_name, batch, seq, kind=kind, zero_stage=zero_stage,
                    timeout_s=timeout_s)
        whose = "cuda" if default_backend(cp) == "nccl" else "cpu"
        layout = Layout(cp=cp, zero_stage=zero_stage if cp > 1 else 0,
                        ddp_buckets=False)                      # averaged in place, not DDP
        est = estimate(model_name, batch, seq, precision="fp32", device=whose,
                       optimizer_impl="for-loop", attention="tiled" if kind == "ring" else "sdpa",
                       layout=layout)
        rows.append(dict(cp=cp, kind=kind, zero_stage=zero_stage, steps=steps, estimate=est))
    return rows
