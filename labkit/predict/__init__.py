"""Predict the memory of one training step, per device, as named tensors.

``estimate`` finds the peak of a steady-state step as the largest of a few moments (the loss,
the start of backward, the worst layer of the backward pass, the embedding's backward, the
optimizer step). Each moment is a list of named tensors: the model states (by the recipe's
bytes per parameter, sharded by ZeRO), what autograd saves in each layer
(``labkit.predict.layers``), autocast's weight copies, the transient gradients and the optimizer's
temporaries. The byte rules it reads are torch-free and load no mechanism (tests/test_imports.py
checks it): ``core.recipe`` (precisions), ``layers`` (the model), ``core.recompute`` (the
policies), ``formats`` (NF4, 8-bit AdamW), ``parallel.data.zero``,
``parallel.pipeline.schedules`` (pipeline stages) and ``parallel.expert.compose`` (expert
parallelism inside data parallelism).

    terms.py    a named tensor, the Estimate they add up to
    states.py   model states by the recipe's bytes, ZeRO's units, buckets, shards and messages
    moments.py  the candidate peaks: loss, each layer's backward, embedding, optimizer, LoRA
    step.py     one pipeline stage: what each layer keeps, its moments, the largest of them
"""
from __future__ import annotations

from labkit.core.config import ModelConfig, preset
from labkit.core.recipe import Layout, Recipe, device_type, layout_from, recipe_from
from labkit.core.units import check_positive, dtype_bytes
from labkit.parallel.pipeline import schedules
from labkit.predict.layers import count_params  # noqa: F401  (re-exported)
from labkit.predict.step import _Step
from labkit.predict.terms import Estimate, Tensor  # noqa: F401  (re-exported)


def estimate(cfg: ModelConfig | str, batch: int = 1, seq: int = 2048,
             precision: str = "bf16-mixed", optimizer: str = "adamw", recompute: str = "none",
             zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1, sp: bool = False,
             optimizer_impl: str | None = None, device="cuda", every: int = 2,
             loss_chunk: int | None = None, attention: str = "sdpa", trainable: str = "all",
             lora_rank: int = 16, weight_format: str | None = None,
             optimizer_in_backward: bool = False,
             recipe: Recipe | None = None, layout: Layout | None = None) -> Estimate:
    """Predicted peak bytes per device of one steady-state training step, by category.

    The arguments are ``measure_step``'s. Give the step as keywords or as
    ``recipe=lk.Recipe(...)``, and the layout as keywords or as ``layout=lk.Layout(...)``:
    a keyword the recipe or layout contradicts raises. ``device`` ("cuda", "cuda:0", a
    torch.device): whose defaults (AdamW is foreach on "cuda", a for-loop on "cpu"); a real GPU
    adds its CUDA context, allocator rounding and library workspaces.
    With ``pp`` > 1 the device reported is the busiest stage. ``loss_chunk``: tokens per chunk
    of a chunked loss (``labkit.transformer.loss``), None for the full logits. ``attention``:
    the core (``labkit.transformer.attention``: "sdpa", "naive" or "tiled"). With ``ep`` > 1
    the device is one of the dp ranks under balanced routing
    (``labkit.parallel.expert.compose``); a skewed router loads one rank more
    (``labkit.parallel.expert.expert_parallel.routing_imbalance`` measures it).
    ``zero_stage=3`` models labkit's ZeroOptimizer (one unit gathered at a time) for full
    fine-tuning, and FSDP2 (its backward prefetch and held all-gather outputs) under LoRA, the
    only way LoRA shards its base; FSDP2 holds up to ~4% more than the first (lab 09 checks).
    """
    c = preset(cfg) if isinstance(cfg, str) else cfg
    recipe = recipe_from(recipe, precision=precision, optimizer=optimizer,
                         optimizer_impl=optimizer_impl, recompute=recompute, every=every,
                         loss_chunk=loss_chunk, attention=attention, trainable=trainable,
                         lora_rank=lora_rank, weight_format=weight_format,
                         optimizer_in_backward=optimizer_in_backward)
    layout = layout_from(layout, dp=dp, zero_stage=zero_stage, tp=tp, sp=sp, pp=pp)
    batch, seq = check_positive("batch", batch), check_positive("seq", seq)
    device = device_type(device)
    layout.check(c, seq)
    spread = [f"{k}={getattr(layout, k)}" for k in ("dp", "tp", "pp", "ep", "cp", "etp")
              if getattr(layout, k) > 1] + ["offload"] * layout.offload + [
              f"{layout.micro_batch_count} micro-batches"] * (layout.micro_batch_count > 1)
    if recipe.optimizer_in_backward and spread:
        raise ValueError(f"optimizer_in_backward is modelled (and measured) on one device and "
                         f"one micro-batch, not with {', '.join(spread)}: drop those (a "
                         f"micro-batch would update the weights each time), or drop "
                         f"optimizer_in_backward (--optimizer-in-backward)")
    if layout.param_dtype and recipe.recompute == "sqrt":
        raise ValueError("param_dtype='bf16' with recompute='sqrt': FSDP2 keeps a multi-block "
                         "unit's blocks gathered while it recomputes, not modelled; use 'full', "
                         "'selective' or 'every-k'")
    if layout.param_dtype and (recipe.precision != "bf16-master" or recipe.trainable != "all"):
        raise ValueError(f"param_dtype={layout.param_dtype!r} (FSDP2's MixedPrecisionPolicy) "
                         f"keeps fp32 master shards and computes in bf16: use "
                         f"precision='bf16-master' and trainable='all' with it (got "
                         f"{recipe.precision!r}, {recipe.trainable!r})")
    if layout.etp > 1 and recipe.recompute not in ("none", "full"):
        raise ValueError(f"etp={layout.etp} is modelled with recompute 'none' (measured by "
                         f"labkit.parallel.expert.expert_tensor) or 'full' (the same terms, not "
                         f"measured), not {recipe.recompute!r}")
    for name in ("replicas", "etp"):
        if getattr(layout, name) > 1 and recipe.trainable != "all":
            raise ValueError(f"{name}={getattr(layout, name)} is modelled for full fine-tuning: "
                             f"use trainable='all', or {name}=1 for {recipe.trainable}")
    stages = [sorted(i for chunk in chunks for i in chunk)              # interleaved: v chunks
              for chunks in schedules.chunk_layers(c.layers, layout.pp, layout.chunks,
                                                   layout.placement)]
    per_stage = [_Step(c, batch, seq, recipe, layout, device, s, layers).estimate()
                 for s, layers in enumerate(stages)]
    busiest = max(per_stage, key=lambda e: e.total)
    if layout.pp > 1:        # each stage's peak and what it keeps for the backward pass
        busiest.details["stages"] = [dict(total=e.total, saved_activations=e.saved_activations,
                                          peak_moment=e.details["peak moment"])
                                     for e in per_stage]
    return busiest


def kv_cache_bytes(cfg: ModelConfig | str, batch: int = 1, seq: int = 4096,
                   dtype: str = "bf16", tp: int = 1, windows: bool = True) -> int:
    """Bytes of the inference KV cache: per token and layer 2 * kv_heads * head_dim numbers
    (MHA, GQA, MQA), or for MLA the latent plus the shared RoPE key, kv_lora + rope. A layer
    with a sliding window keeps only its last ``sliding_window`` tokens (``windows=False``:
    every token, as a cache that ignores the window would). The cache's steady size: a server
    holds one chunk of new tokens more while it prefills."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    check_positive("batch", batch)
    check_positive("seq", seq)
    Layout(tp=tp).check(c, seq)
    if c.attention == "mla":
        per_token = c.kv_lora_rank + c.qk_rope_dim                             # not split by tp
    else:
        per_token = 2 * max(1, c.kv_heads // tp) * c.head_dim
    windowed = c.windowed_layers if windows else 0
    tokens = (c.layers - windowed) * seq + windowed * min(seq, c.sliding_window)
    return int(batch * tokens * per_token * dtype_bytes(dtype))
