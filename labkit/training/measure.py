"""Measure one training step of any model: its bytes at the peak, by category, and over time.

``measure_step`` runs ``labkit.training.step.train_step`` under ``labkit.MemoryTracker`` - on real
tensors, or on fake tensors (``FakeTensorMode``: real shapes and bytes, no memory) for models
of any size. It takes labkit's own model (a ``ModelConfig`` or preset name), any
``nn.Module`` (a Hugging Face causal LM, say), or a function that builds one.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake

from labkit.core.recipe import Layout, Recipe, device_type, layout_from, recipe_from
from labkit.core.units import Breakdown, check_positive
from labkit.training.step import device as default_device, make_optimizer, param_dtype, train_step
from labkit.training.track import MemoryTracker, Timeline


@dataclass
class Measurement(Breakdown):
    """A ``Breakdown`` measured by the tracker, with its timeline and whose step it was.

    ``device``: whose defaults the step used ("cuda": foreach AdamW); with ``fake`` the
    tensors were CPU fake tensors whatever the device.
    """

    timeline: Timeline = field(default_factory=Timeline)
    events: list | None = None       # the step's storage events, with measure_step(events=True)
    device: str = "cpu"
    fake: bool = False
    optimizer_impl: str = ""
    cuda_peak: int | None = None     # torch.cuda.max_memory_allocated for the same step
    loss: float | None = None


def init_optimizer_state(model_or_params, optimizer):
    """Allocate the optimizer's state with one step on zero gradients (no forward pass needed).
    Given a module, its parameters; frozen ones (``requires_grad=False``) get no state. On fake
    tensors, where no value matters, torch's Adam and AdamW make their state as their first step
    does but without the step (over FSDP2's DTensors a step costs ~13 s of sharding rules)."""
    params = list(model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module)
                  else model_or_params)
    if hasattr(optimizer, "per_param"):                     # OptimizerInBackward: each one's
        for p, one in optimizer.per_param.items():
            init_optimizer_state([p], one)
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    inner = getattr(optimizer, "inner", optimizer)          # MasterWeights: its AdamW
    if type(inner) in (torch.optim.Adam, torch.optim.AdamW) and params and all(
            is_fake(p) for p in params):
        if inner is not optimizer:                          # the masters' gradients
            for p, master in zip(optimizer.params, optimizer.masters):
                master.grad = None if p.grad is None else torch.zeros_like(master)
        for group in inner.param_groups:                    # torch's own lazy initialisation
            inner._init_group(group, [], [], [], [], [], [])
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _check_one_device(layout: Layout) -> None:
    """measure_step runs one device's step: a layout over several ranks is measured on them."""
    spread = {name: getattr(layout, name) for name in ("dp", "tp", "pp", "ep", "cp")
              if getattr(layout, name) > 1}
    if spread or layout.offload:
        what = ", ".join(f"{k}={v}" for k, v in spread.items()) or "offload=True"
        raise ValueError(f"measure_step measures one device's step; {what} spreads it over "
                         "ranks: measure those with labkit.parallel (cluster.run(zero_steps, "
                         "...) for dp and ZeRO, fsdp.fake_fsdp2_peak for FSDP2 on a fake group, "
                         "tensor/pipeline/expert for tp, pp and ep), or compare with "
                         "lk.estimate(..., layout=...)")


# ---- what is measured, where, and whose defaults ---------------------------------------------
@dataclass
class _Setup:
    build: object                  # a ModelConfig, a module as given, or a function
    mode: FakeTensorMode | None    # fake tensors, or None for real ones
    whose: str                     # "cuda" or "cpu": whose defaults
    runs_on: torch.device          # where the tensors live


def _fake_mode_of(module):
    """The FakeTensorMode the module's parameters were made under, or None for real ones."""
    params = list(module.parameters())
    fake = [p for p in params if isinstance(p, FakeTensor)]
    if fake and len(fake) < len(params):
        raise ValueError("the module mixes fake and real parameters; build all of it under "
                         "one FakeTensorMode (or pass a function that builds it)")
    return fake[0].fake_mode if fake else None


def _setup(cfg, fake: bool | None, device: str | None) -> _Setup:
    """Fake or real, whose defaults, where: from the arguments, or a given module's tensors."""
    if not isinstance(cfg, torch.nn.Module):
        fake = True if fake is None else fake
        where = device or ("cuda" if fake else default_device())
        whose = device_type(where)
        return _Setup(cfg, FakeTensorMode() if fake else None, whose,
                      torch.device("cpu" if fake else where))
    mode = _fake_mode_of(cfg)
    if fake is not None and fake != (mode is not None):
        raise ValueError(f"fake={fake} but the module's parameters are "
                         f"{'fake' if mode else 'real'} tensors; build the module under "
                         f"FakeTensorMode (or pass a function that builds it) to measure it on "
                         f"fake tensors, or leave fake unset")
    here = next(cfg.parameters()).device
    if mode is None and device is not None and device_type(device) != here.type:
        raise ValueError(f"the module's parameters are on {here}, not {device}; move it with "
                         f"module.to({device!r}) or pass device={here.type!r}")
    return _Setup(cfg, mode, device_type(device or ("cuda" if mode else here.type)), here)


def _build(setup: _Setup, precision: str, recompute: str, loss_chunk: int | None = None,
           trainable: str = "all", lora_rank: int = 16, weight_format: str | None = None,
           every: int = 2):
    """The module to train: labkit's model built from its config (with ``recompute`` - k of
    "every-k" from ``every`` - ``loss_chunk`` and LoRA adapters), the given module, or what
    the given function builds in the precision's weight dtype. Recompute is set before the
    adapters go in: checkpointing runs whole blocks, whatever their linears have become."""
    from labkit.transformer.checkpointing import apply_recompute
    from labkit.core.config import ModelConfig
    from labkit.transformer.model import Transformer, build_model

    dtype = param_dtype(precision)
    if isinstance(setup.build, ModelConfig):
        model = build_model(setup.build, dtype, setup.runs_on)
    elif isinstance(setup.build, torch.nn.Module):
        model = setup.build
    else:                         # build_model's way: set the default dtype, do not convert
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(setup.runs_on):
                model = setup.build()
        finally:
            torch.set_default_dtype(previous)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"the function passed to measure_step returned "
                            f"{type(model).__name__}, not an nn.Module")
    _check_weights(model, precision)
    if recompute != "none" or isinstance(setup.build, ModelConfig):
        if not isinstance(model, Transformer):
            raise ValueError(f"recompute={recompute!r} applies to labkit's model only; for another "
                             f"module turn on its own checkpointing (Hugging Face: "
                             f"model.gradient_checkpointing_enable()) and pass recompute='none'")
        apply_recompute(model, recompute, every)
    if loss_chunk is not None:
        if not isinstance(model, Transformer):
            raise ValueError(f"loss_chunk={loss_chunk} applies to labkit's model only; give "
                             f"another module a chunked loss through loss_fn "
                             f"(labkit.transformer.loss.chunked_cross_entropy) and leave "
                             f"loss_chunk None")
        model.loss_chunk = loss_chunk
    if trainable == "lora":
        from labkit.quantisation.lora import apply_lora
        if not isinstance(model, Transformer):
            raise ValueError(f"trainable='lora' adapts labkit's model only; give another module "
                             f"its adapters (PEFT) and pass trainable='all'")
        apply_lora(model, lora_rank, weight_format=weight_format)
    return model.train()


def _check_weights(model, precision: str) -> None:
    """The weights must be stored as ``precision`` stores them: a module is measured as it is
    (``module.to(dtype)`` cannot swap fake parameters)."""
    sizes = {}
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    most = max(sizes, key=sizes.get, default=None)      # a few may differ (fp32 routers)
    want = param_dtype(precision)
    if most is not None and most != want:
        raise ValueError(f"precision={precision!r} stores weights in {want}, but the module's "
                         f"are {most}; build it with torch.set_default_dtype({want}) or pass a "
                         f"function that builds it (measure_step then sets the dtype)")


def _batch(model, batch: int, seq: int, loss_fn, device):
    """(inputs, targets, the callable ``train_step`` runs) for random tokens below the model's
    vocabulary: labkit's model takes shifted targets; a Hugging Face causal LM (or
    ``loss_fn(model, tokens)``) takes the tokens and shifts the labels itself."""
    from labkit.transformer.model import Transformer

    config = getattr(model, "cfg", None) or getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__}: "
                         f"measure_step draws tokens below model.config.vocab_size; give the "
                         f"module a config with vocab_size")
    if isinstance(model, Transformer) and loss_fn is None:
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
        return tokens[:, :-1], tokens[:, 1:], model                         # (B, T) each
    loss_of = loss_fn or (lambda m, tokens: m(input_ids=tokens, labels=tokens).loss)
    tokens = torch.randint(0, vocab, (batch, seq), device=device)           # (B, T)
    return tokens, None, lambda tokens, targets: loss_of(model, tokens)


# ---- the measurement ---------------------------------------------------------------------------
def measure_step(cfg, batch: int = 1, seq: int = 2048, precision: str = "bf16-mixed",
                 optimizer: str = "adamw", recompute: str = "none", *,
                 zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1, sp: bool = False,
                 optimizer_impl: str | None = None, device=None, every: int = 2,
                 loss_chunk: int | None = None, attention: str = "sdpa", trainable: str = "all",
                 lora_rank: int = 16, weight_format: str | None = None,
                 optimizer_in_backward: bool = False,
                 recipe: Recipe | None = None, layout: Layout | None = None,
                 fake: bool | None = None, warmup: bool = True, seed: int = 0, loss_fn=None,
                 events: bool = False, then: list[tuple[int, int]] = ()) -> Measurement:
    """Run one training step under the tracker; bytes at its peak.

    ``cfg``: a ``ModelConfig`` or preset name (labkit's model, fake by default); an
    ``nn.Module`` as it is (real, or fake made under a ``FakeTensorMode``, whose mode the step
    reuses); or a function of no arguments that builds a module (``lambda: AutoModelForCausalLM.
    from_config(hf_cfg)``), called in the step's FakeTensorMode with the precision's weight
    dtype as the default. ``recompute`` applies to labkit's model; another module brings its
    own. Only parameters with ``requires_grad`` train; a given module takes the step.
    ``loss_chunk``: labkit's model computes its loss that many tokens at a time
    (``labkit.transformer.loss``); None keeps the full logits. ``trainable="lora"`` freezes labkit's
    model and trains rank-``lora_rank`` adapters (alpha = 2 r) on every linear of its blocks, on an
    NF4 base with ``weight_format="nf4"`` (QLoRA; ``labkit.quantisation.lora``). ``attention``:
    labkit's model runs its attention core as "sdpa", "naive" or "tiled"
    (``labkit.transformer.attention``).
    ``recipe=lk.Recipe(...)`` gives all of these at once, as ``estimate`` takes it (a keyword
    it contradicts raises): LoRA and QLoRA compose with every recompute policy and autocast.
    The layout (``layout=`` or dp=, zero_stage=, ...) is one device's: a step spread over
    ranks is measured on them (``labkit.parallel``).

    ``device``: whose step it is, "cuda" ("cuda:1", a torch.device) or "cpu". A real step runs
    there (default: ``device()``, or where a given module is). A fake step runs on CPU fake
    tensors - shapes and bytes real, no memory used, labkit's MoE routing balanced - with that
    device's defaults (default "cuda": AdamW foreach), because fake CUDA tensors cannot run on a
    CPU-only build; what a real GPU adds (CUDA context, allocator rounding, library
    workspaces) is not in it. ``warmup`` creates the optimizer state first: a steady-state step.
    ``events=True`` keeps the tracker's log of storages made and freed (``.events``), which
    ``labkit.host.allocator.replay`` runs through a model of the CUDA caching allocator.
    ``then``: (batch, seq) of further steps run after the first under the same tracker (batches
    whose shape changes from step to step, the allocator's hard case); the peak is over all.
    """
    from labkit.transformer.model import Transformer, use_attention

    batch, seq = check_positive("batch", batch), check_positive("seq", seq)
    then = [(check_positive("batch", b), check_positive("seq", s)) for b, s in then]
    recipe = recipe_from(recipe, precision=precision, optimizer=optimizer,
                         optimizer_impl=optimizer_impl, recompute=recompute, every=every,
                         loss_chunk=loss_chunk, attention=attention, trainable=trainable,
                         lora_rank=lora_rank, weight_format=weight_format,
                         optimizer_in_backward=optimizer_in_backward)
    _check_one_device(layout_from(layout, dp=dp, zero_stage=zero_stage, tp=tp, sp=sp, pp=pp))
    precision, optimizer, attention = recipe.precision, recipe.optimizer, recipe.attention
    param_dtype(precision)
    cfg = _checked_model(cfg, max(s for _, s in [(batch, seq), *then]))
    setup = _setup(cfg, fake, device)
    impl = recipe.impl(setup.whose)
    torch.manual_seed(seed)
    with setup.mode or contextlib.nullcontext():
        model = _build(setup, precision, recipe.recompute, recipe.loss_chunk, recipe.trainable,
                       recipe.lora_rank, recipe.weight_format, recipe.every)
        if attention != "sdpa" and not isinstance(model, Transformer):
            raise ValueError(f"attention={attention!r} switches labkit's model only; measure "
                             f"another module with its own attention and attention='sdpa'")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, optimizer, impl, device=setup.runs_on,
                             master_weights=precision == "bf16-master",
                             in_backward=recipe.optimizer_in_backward)
        scaler = (torch.amp.GradScaler(setup.runs_on.type)
                  if precision == "fp16-mixed" and setup.mode is None else None)
        inputs, targets, step = _batch(model, batch, seq, loss_fn, setup.runs_on)
        if warmup:
            init_optimizer_state(params, opt)
        if setup.runs_on.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()        # reserved starts from the live tensors' segments
            torch.cuda.reset_peak_memory_stats()
        with MemoryTracker(model, opt, events=events) as mt, use_attention(attention):
            result = train_step(step, opt, inputs, targets, precision, scaler, tracker=mt,
                                autocast_cache=recipe.autocast_cache)
            for b, s in then:
                del inputs, targets             # the next batch replaces this one
                inputs, targets, step = _batch(model, b, s, loss_fn, setup.runs_on)
                result = train_step(step, opt, inputs, targets, precision, scaler, tracker=mt,
                                    autocast_cache=recipe.autocast_cache)
    return _measurement(mt, setup, impl, result.loss)


def _checked_model(cfg, longest: int):
    """``cfg`` as measure_step builds it (a preset name's config); raises on what it cannot run."""
    from labkit.core.config import ModelConfig, preset
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    if isinstance(cfg, ModelConfig) and longest > cfg.max_seq:
        raise ValueError(f"seq={longest} exceeds the model's max_seq={cfg.max_seq}; "
                         f"use cfg.replace(max_seq={longest})")
    if not isinstance(cfg, (ModelConfig, torch.nn.Module)) and not callable(cfg):
        raise TypeError(f"measure_step takes a ModelConfig, a preset name, an nn.Module or a "
                        f"function that builds one, got {type(cfg).__name__}")
    return cfg


def _measurement(mt, setup, impl: str, loss: float) -> Measurement:
    """The tracker's peak as a Measurement, with what autograd kept at the end of forward."""
    forward = [i for i, p in enumerate(mt.timeline.phase) if p == "forward"]
    at_end = {c: series[forward[-1]] if forward else 0 for c, series in mt.timeline.by_category.items()}
    return Measurement(
        **mt.peak_by_category, peak_phase=mt.peak_phase,
        saved_activations=at_end["activations"], saved_weight_cache=at_end["weight_cache"],
        timeline=mt.timeline, events=mt.events, device=setup.whose, fake=setup.mode is not None,
        optimizer_impl=impl, loss=loss,
        cuda_peak=torch.cuda.max_memory_allocated() if setup.runs_on.type == "cuda" else None)
