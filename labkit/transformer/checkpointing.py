"""Activation recomputation ("checkpointing") policies applied to labkit's ``Transformer``.

A recomputed unit keeps only its input for the backward pass and runs its forward again
there (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost"). The policies:

- ``none``: keep every activation.
- ``selective``: every block recomputes, but keeps the outputs of its matmuls and of
  attention; only the cheap elementwise ops and norms run again (the op-level policy of
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``, as in torchtitan, which
  also recomputes every second matmul; Korthikanti et al., 2022, recompute the attention core
  instead, which SDPA's fused kernel already avoids storing).
- ``every-k``: one block in every k recomputes (blocks k-1, 2k-1, ...), the others keep
  everything - torchtitan's ``selective_ac_option=k``. ``every-1`` is ``full``. The name
  may carry k (``"every-3"``); plain ``"every-k"`` takes k from ``every``.
- ``sqrt``: Chen et al.'s sqrt(n) schedule: the n blocks are cut into segments of
  round(sqrt(n)) blocks, each recomputed as one unit from its first block's input.
  Fewer inputs kept than ``full``; a whole segment is rebuilt at once in the backward pass.
- ``full``: every block recomputes from its input (one segment per layer).

``recompute_cost`` counts what the extra forward costs in FLOPs.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from labkit.core.config import preset
from labkit.core.recompute import RECOMPUTE_POLICIES, Unit, parse_policy, plan  # noqa: F401
from labkit.transformer.model import build_model

aten = torch.ops.aten
# what ``selective`` keeps: the outputs of matmuls and of fused attention (any backend)
KEEP_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default}


# ... and of the MoE experts' grouped matmul (``labkit.transformer.grouped_mm``), by name: the op
# exists once the model is imported, which this module does not do
KEEP_OP_NAMES = {"labkit::grouped_mm"}


def keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    """``selective``'s op policy: save matmul and attention outputs, recompute the rest."""
    keep = op in KEEP_OPS or op.name() in KEEP_OP_NAMES
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model, policy: str = "none", every: int = 2):
    """Set which blocks of ``model`` recompute their activations; returns the model.

    ``model.recompute[i]`` holds how many blocks recompute as one unit from block i's input
    (0: none; the blocks inside a unit hold 0 and are run by it). ``model.blocks`` is never
    touched, so parameter names stay the same and policies can be switched on one model.
    """
    name, _ = parse_policy(policy, every)
    return _set_recompute(model, recompute_spans(len(model.blocks), policy, every),
                          name == "selective")


def recompute_spans(layers: int, policy: str = "none", every: int = 2) -> list[int]:
    """``model.recompute`` for ``policy``: per block, how many blocks recompute from its input."""
    spans = [0] * layers
    for u in plan(layers, policy, every):
        spans[u.first] = u.last - u.first if u.recompute else 0
    return spans


def _set_recompute(model, spans, selective: bool):
    model.recompute = list(spans)
    model.checkpoint_options = (
        {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                         keep_matmuls_and_attention)} if selective else {})
    return model


# ---- what recomputation costs ---------------------------------------------------------
def _attention_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _attention_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


# FlopCounterMode knows the CUDA attention kernels but not the CPU one: count it the same way
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
}


@dataclass
class RecomputeCost:
    """FLOPs of one forward + backward pass with and without recomputation."""

    policy: str
    flops: int             # with the policy
    baseline_flops: int    # policy "none"

    @property
    def extra(self) -> float:
        """Extra work as a fraction of the step: ``full`` adds one forward of the blocks only
        (not the embedding or LM head), so a little under 1/3."""
        return self.flops / self.baseline_flops - 1


def step_flops(cfg, policy: str = "none", seq: int = 512, batch: int = 1, every: int = 2,
               fake: bool = True) -> int:
    """Matmul and attention FLOPs of ``loss.backward()`` after a forward, as FlopCounterMode counts.

    Elementwise ops are not counted (they are memory-bound): ``selective`` costs ~0 here.
    Attention counts as a whole T x T product: FlopCounterMode ignores causality.
    Counted on one- and two-block copies of the model and summed block by block: equal to
    ``counted_step_flops``, which counts a step of the whole model for each policy.
    """
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    name, _ = parse_policy(policy, every)
    rest, dense, moe = _block_flops(cfg, seq, batch, fake)
    kind = [dense if i < cfg.dense_layers else moe for i in range(cfg.layers)]
    total = rest + sum(b.step for b in kind)
    for unit in plan(cfg.layers, policy, every):
        for i in range(unit.first, unit.last) if unit.recompute else ():
            b = kind[i]
            if name == "selective":
                total += b.selective
            else:      # a unit's blocks before its last also run their output's last matmul
                total += b.recompute + (b.inner if i < unit.last - 1 else 0)
    return total


def counted_step_flops(cfg, policy: str = "none", seq: int = 512, batch: int = 1,
                       every: int = 2, fake: bool = True) -> int:
    """``step_flops`` counted on one step of the whole model: one fake step per policy."""
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    name, _ = parse_policy(policy, every)
    return _counted_flops(cfg, tuple(recompute_spans(cfg.layers, policy, every)),
                          name == "selective", seq, batch, fake)


@dataclass(frozen=True)
class BlockFlops:
    """FlopCounterMode's count for one kind of block (dense or MoE)."""

    step: int        # forward + backward, activations kept
    recompute: int   # one more forward, recomputed as a unit of its own
    inner: int       # more inside a longer unit: a checkpoint's recomputation stops after the
                     # last op whose output backward needs, so it skips the unit's last matmul
    selective: int   # recomputed under ``selective`` (elementwise ops only: 0)


@functools.lru_cache(maxsize=64)
def _block_flops(cfg, seq: int, batch: int, fake: bool):
    """(FLOPs outside the blocks, the dense block's, the MoE block's) from copies of ``cfg``
    with one and two blocks of each kind; a kind the model lacks is None."""
    def kind(dense: bool) -> tuple[int, BlockFlops]:
        def count(layers, spans, selective=False):
            probe = cfg.replace(layers=layers, dense_layers=layers if dense else 0)
            return _counted_flops(probe, spans, selective, seq, batch, fake)
        one, two = count(1, (0,)), count(2, (0, 0))
        recompute = count(1, (1,)) - one
        block = BlockFlops(two - one, recompute, count(2, (2, 0)) - two - 2 * recompute,
                           count(1, (1,), selective=True) - one)
        return one - block.step, block

    kinds = {dense: kind(dense) for dense, n in ((True, cfg.dense_layers),
                                                 (False, cfg.moe_layers)) if n}
    rest = next(iter(kinds.values()))[0]
    return rest, *(kinds[dense][1] if dense in kinds else None for dense in (True, False))


@functools.lru_cache(maxsize=128)
def _counted_flops(cfg, spans: tuple[int, ...], selective: bool, seq: int, batch: int,
                   fake: bool) -> int:
    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = _set_recompute(build_model(cfg), spans, selective)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
    return counter.get_total_flops()


def recompute_cost(cfg, policy: str, seq: int = 512, batch: int = 1, every: int = 2,
                   fake: bool = True) -> RecomputeCost:
    """The FLOPs ``policy`` adds to a training step's forward and backward passes."""
    return RecomputeCost(policy, step_flops(cfg, policy, seq, batch, every, fake),
                         step_flops(cfg, "none", seq, batch, every, fake))
