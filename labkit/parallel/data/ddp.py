"""Plain data parallelism (PyTorch ``DistributedDataParallel``): every rank holds all the
model states, plus the reducer's gradient buckets. Li et al., "PyTorch Distributed" (2020).

Each rank trains a whole copy of the model on its own rows; after the backward pass every
gradient is averaged over the ranks, so the copies stay equal. DDP does not all-reduce one
gradient at a time: its reducer copies the gradients into a few flat **buckets** and
all-reduces a bucket as soon as all its gradients are ready, overlapping the messages with
the rest of the backward pass::

    param.grad (each weight's shape) --copy, / N--> bucket (flat, <= bucket_cap_mb)
                                     --all-reduce--> bucket (summed) --copy--> param.grad

Where the buckets live, and when (measured with ``ddp_step``, see the tests):

- One flat tensor per bucket, in the parameters' dtype, holding the parameters in reverse
  order (the order their gradients arrive), with no padding: the buckets together hold
  exactly the gradients' bytes, whatever ``bucket_cap_mb`` is (it only sets how many).
- They are allocated when DDP is constructed (one bucket for the whole model) and rebuilt once,
  at the start of the second forward pass (the old ones freed first), in the order the first
  backward produced the gradients, closing a bucket once it reaches ``bucket_cap_mb`` (the
  first one at 1 MiB when ``bucket_cap_mb`` is left to torch's default). From then on they
  stay allocated for as long as the DDP module lives: through the forward pass, the backward
  pass and the optimizer step, also after ``zero_grad(set_to_none=True)``.
- ``gradient_as_bucket_view=False`` (the default): ``param.grad`` are tensors of their own
  next to the buckets. From the backward pass to ``zero_grad`` a rank holds the gradients
  twice: G in ``param.grad`` and G in the buckets.
- ``gradient_as_bucket_view=True``: once a gradient is copied into its bucket, ``param.grad``
  becomes a view of the bucket and its own tensor is freed (in the backward pass about one
  parameter's gradient is alive beside the buckets), so the optimizer steps on the buckets
  themselves: G in all, but held in the forward pass too, where one process with
  ``zero_grad(set_to_none=True)`` holds none.

The rule (``grads_held``, ``extra_bytes``): per rank, with G the gradients' bytes,

    moment                       one process   DDP, bucket views off   DDP, bucket views on
    forward                      0             G                       G
    end of backward, optimizer   G             2G                      G

Under ``bf16-master`` the optimizer wrapper turns each bf16 ``param.grad`` into an fp32 copy
before AdamW steps, so at the step the rank holds the (bf16) buckets alone.

The tracker sees the buckets through DDP's communication hook: torch's own all-reduce hook
(``default_hooks.allreduce_hook``, documented to give the same result as no hook) that also
tags each bucket as gradients (``labkit.training.track.tag_live``). It divides by N before the
all-reduce instead of while copying: the same numbers for N = 2 (a power of two), a last-bit
difference otherwise; the same bytes (checked: equal peaks with and without it).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from labkit.core.config import preset
from labkit.core.recipe import TRAINABLE
from labkit.core.units import check_choice, check_positive
from labkit.parallel.cluster import RankContext
from labkit.parallel.data.data_parallel import DataParallel
from labkit.parallel.steps import RankStep, measure_rank, rank_tokens
from labkit.quantisation.lora import apply_lora
from labkit.training.step import make_optimizer, param_dtype
from labkit.training.track import current, tag_live
from labkit.transformer.model import build_model

# what a step can measure here: fp16-mixed needs a loss scaler, which measure_rank has no room for
PRECISIONS = ("fp32", "bf16", "bf16-mixed", "bf16-master")
MOMENTS = ("forward", "backward", "optimizer")
# DDP rebuilds its buckets at the second forward; the third step is the first steady one
MIN_STEPS = 3


# ---- the byte rule -------------------------------------------------------------------------
def bucket_bytes(grad_bytes: int) -> int:
    """Bytes of DDP's gradient buckets on each rank: flat copies of all the gradients, in their
    dtype and without padding, so exactly ``grad_bytes`` for any ``bucket_cap_mb`` or N."""
    check_positive("grad_bytes", grad_bytes)
    return grad_bytes


def grads_held(grad_bytes: int, gradient_as_bucket_view: bool) -> dict[str, int]:
    """Gradient bytes a DDP rank holds at each moment of a steady step (buckets + ``param.grad``
    after ``zero_grad(set_to_none=True)``): what the tracker counts as "grads" there."""
    buckets = bucket_bytes(grad_bytes)
    own = 0 if gradient_as_bucket_view else grad_bytes     # param.grad next to the buckets
    return {"forward": buckets, "backward": buckets + own, "optimizer": buckets + own}


def extra_bytes(grad_bytes: int, gradient_as_bucket_view: bool) -> dict[str, int]:
    """What DDP adds to one process's step at each moment: ``grads_held`` minus the
    ``param.grad`` one process holds (none in the forward pass, all of them after it)."""
    one_process = {"forward": 0, "backward": grad_bytes, "optimizer": grad_bytes}
    held = grads_held(grad_bytes, gradient_as_bucket_view)
    return {moment: held[moment] - one_process[moment] for moment in MOMENTS}


# ---- the communication hook: torch's all-reduce, with the buckets shown to the tracker -----
class BucketLog:
    """What a rank saw in its last step: each bucket's bytes, the bytes it sent (a ring
    all-reduce sends 2 (N - 1) / N of the buffer from every rank), and the gradient bytes the
    tracker counted as the forward pass and the optimizer step began."""

    def __init__(self, group):
        self.group, self.world = group, dist.get_world_size(group=group)
        self.buckets: list[int] = []         # bytes of bucket 0, 1, ... (the reducer's order)
        self.sent = Counter()                # collective -> bytes sent in the last backward
        self.held: dict[str, int] = {}       # moment -> bytes counted as "grads" then

    def note(self, moment: str):
        """Remember the gradient bytes the measuring tracker counts now, as ``held[moment]``."""
        tracker = current()
        if tracker is not None:
            self.held[moment] = tracker.by_category["grads"]


def allreduce_and_tag(log: BucketLog, bucket):
    """DDP comm hook (``bucket``: a ``dist.GradBucket``; no annotations, DDP checks them):
    count the bucket as gradients in every tracker running, then average it over the ranks."""
    flat = bucket.buffer()                   # (elements of the bucket,) the bucket itself
    if bucket.index() == 0:                  # the reducer hands the buckets over in order
        log.buckets, log.sent = [], Counter()
    log.buckets.append(flat.nbytes)
    log.sent["all_reduce"] += 2 * (log.world - 1) * flat.nbytes // log.world
    tag_live(flat, "grads")                  # every tracker running now counts it as gradients
    return default_hooks.allreduce_hook(log.group, bucket)


# ---- one rank's measured steps ---------------------------------------------------------------
@dataclass
class DDPStep(RankStep):
    """A rank's ``RankStep`` and what the rule is checked with: the buckets, the gradients'
    bytes, and the gradient bytes held as the last forward pass and optimizer step began."""

    buckets: list = field(default_factory=list)   # bytes of each bucket all-reduced, last step
    grad_bytes: int = 0                            # every parameter's gradient, its dtype
    params: torch.Tensor | None = None             # all parameters after the steps, flat
    held: dict = field(default_factory=dict)       # moment -> "grads" bytes then (last step)


def _check(model_name, batch, seq, steps, precision, bucket_cap_mb):
    """ValueError naming the fix for any bad argument, before a model or a message exists."""
    preset(model_name)                                    # unknown names raise, listing them
    for name, value in (("batch", batch), ("seq", seq), ("steps", steps)):
        check_positive(name, value)
    if steps < MIN_STEPS:
        raise ValueError(f"steps={steps}: use steps >= {MIN_STEPS}; DDP rebuilds its buckets "
                         "at the second forward pass, the third step is the first steady one")
    check_choice("precision", precision, PRECISIONS)
    if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool)
                                      or not isinstance(bucket_cap_mb, (int, float))
                                      or not bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB (or None for torch's "
                         f"default, 25), got {bucket_cap_mb!r}")


def _model_and_optimizer(model_name, precision, seed, device, trainable="all", lora_rank=16):
    """The labkit model (same weights for every seed-equal caller), with rank-``lora_rank``
    LoRA adapters on a frozen model if ``trainable="lora"``, and a for-loop AdamW of what trains."""
    torch.manual_seed(seed)
    model = build_model(preset(model_name), param_dtype(precision), device)
    if trainable == "lora":
        apply_lora(model, lora_rank)
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], "adamw",
                               impl="for-loop", master_weights=precision == "bf16-master")
    return model, optimizer


def _finish(step: RankStep, model, log: BucketLog | None, keep_params: bool) -> DDPStep:
    """The ``RankStep`` with the gradients' bytes, the log's buckets and moments, the weights."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    flat = (torch.cat([p.detach().flatten().float() for p in model.parameters()])
            if keep_params else None)
    if log is None:                          # one process: no buckets
        return DDPStep(**vars(step), grad_bytes=grads, params=flat)
    return DDPStep(**vars(step), buckets=list(log.buckets), grad_bytes=grads, params=flat,
                   held=dict(log.held))


def ddp_step(ctx, model_name: str = "tiny", batch: int = 1, seq: int = 32, steps: int = 3,
             precision: str = "fp32", bucket_cap_mb: float | None = None,
             gradient_as_bucket_view: bool = False, forward_sync_buffers: bool = False,
             seed: int = 0, keep_params: bool = False, trainable: str = "all",
             lora_rank: int = 16) -> DDPStep:
    """Train ``model_name`` under DDP on this rank's rows (``batch`` of them); the tracker
    measures the last step, the buckets counted as gradients. ``trainable="lora"``: LoRA's
    adapters on the frozen model (each rank a replica; only the adapters are bucketed).

    ``bucket_cap_mb=None`` is torch's default: 25 MiB and a first bucket of 1 MiB (an explicit
    25 gives no small first bucket). ``forward_sync_buffers`` (True in DDP) broadcasts every
    buffer from rank 0 before each forward pass, through a flat copy of them all; labkit's only
    buffers are the RoPE tables, equal on every rank, so it is off here.
    """
    _check(model_name, batch, seq, steps, precision, bucket_cap_mb)
    check_choice("trainable", trainable, TRAINABLE)
    model, optimizer = _model_and_optimizer(model_name, precision, seed, ctx.device, trainable,
                                            check_positive("lora_rank", lora_rank))
    ddp = DistributedDataParallel(
        model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
        process_group=ctx.group, bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        forward_sync_buffers=forward_sync_buffers)
    log = BucketLog(ctx.group)
    ddp.register_comm_hook(log, allreduce_and_tag)

    def forward(tokens, targets):            # (batch, seq) each
        log.note("forward")                  # what the rank holds before the forward pass
        return ddp(tokens, targets)

    # ... and as the optimizer steps (bf16-master: its inner AdamW, after the fp32 copies)
    stepping = getattr(optimizer, "inner", optimizer)
    stepping.register_step_pre_hook(lambda opt, args, kwargs: log.note("optimizer"))

    batches = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps, seed)
    step = measure_rank(ctx, ddp, forward, optimizer, batches, precision, sent=lambda: log.sent)
    return _finish(step, model, log, keep_params)


def one_process_step(model_name: str = "tiny", batch: int = 2, seq: int = 32, steps: int = 3,
                     precision: str = "fp32", seed: int = 0,
                     keep_params: bool = False) -> DDPStep:
    """The same training without DDP in this process, on ``batch`` rows (all N ranks' rows at
    batch // N each): what DDP must equal, and the memory it adds to."""
    _check(model_name, batch, seq, steps, precision, None)
    ctx = RankContext(0, 1, None, torch.device("cpu"))
    model, optimizer = _model_and_optimizer(model_name, precision, seed, ctx.device)
    batches = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps, seed)
    step = measure_rank(ctx, model, model, optimizer, batches, precision)
    return _finish(step, model, None, keep_params)


@dataclass
class OwnDDPStep(RankStep):
    """A rank's ``RankStep`` under labkit's ``DataParallel`` and its last step's timeline."""

    timeline: list = field(default_factory=list)  # data_parallel.Event, seconds from the forward


def labkit_ddp_step(ctx, model_name: str = "tiny", batch: int = 1, seq: int = 32,
                    steps: int = 3, bucket_mb: float | None = 25, seed: int = 0) -> OwnDDPStep:
    """``ddp_step``'s training under labkit's own ``DataParallel`` (``data_parallel``): buckets
    of ``bucket_mb`` MiB all-reduced from gradient hooks, ``finish()`` before each step."""
    _check(model_name, batch, seq, steps, "fp32", None)
    model, optimizer = _model_and_optimizer(model_name, "fp32", seed, ctx.device)
    wrapped = DataParallel(model, ctx.group, bucket_mb=bucket_mb)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: wrapped.finish())
    batches = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps, seed)
    step = measure_rank(ctx, wrapped, wrapped, optimizer, batches)
    return OwnDDPStep(**vars(step), timeline=list(wrapped.timeline))


def ddp_steps(ctx, settings: list[dict]) -> list[DDPStep]:
    """``ddp_step(ctx, **s)`` for each of ``settings`` in one process group (one start-up)."""
    return [ddp_step(ctx, **s) for s in settings]
