"""One training step with the options every lab toggles: precision, optimizer, recompute.

Precisions (what is stored, what is computed):

- ``fp32``: fp32 weights, gradients, optimizer state and activations.
- ``bf16``: everything in bf16 ("pure bf16"; the optimizer state too).
- ``bf16-master``: bf16 weights, gradients and activations; the optimizer keeps fp32 master
  weights and fp32 moments (the mixed precision of Micikevicius et al. and the ZeRO paper).
- ``bf16-mixed``: fp32 weights, gradients and state; matmuls in bf16 under
  ``torch.autocast`` (PyTorch AMP). Autocast keeps bf16 copies of the weights for the
  backward pass, so they count as activations.
- ``fp16-mixed``: as bf16-mixed in fp16, with a loss scaler (``torch.amp.GradScaler``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .track import MemoryTracker, Timeline
from .units import Breakdown, check_choice

from .recipe import (DEVICES, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS,  # noqa: F401
                     default_optimizer_impl)


def device() -> torch.device:
    """The device every lab uses: the GPU when CUDA is present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


default_device = device          # measure_step has a parameter called device


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the weights are stored in."""
    check_choice("precision", precision, PRECISIONS)
    if precision == "fp16-master":
        raise ValueError("fp16-master is estimated, not run: its bytes are bf16-master's; "
                         "measure precision='bf16-master'")
    return torch.bfloat16 if precision in ("bf16", "bf16-master") else torch.float32


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast computes in, or None when autocast is off."""
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)


class MasterWeights:
    """An optimizer over fp32 master copies of low-precision weights (Micikevicius et al., 2018).

    Each step turns the bf16 gradients into fp32 ones (freeing each bf16 gradient as it goes),
    steps the fp32 masters, and copies them back into the bf16 weights, so small updates are
    not rounded away. The masters count as optimizer state: 4 bytes per parameter.
    """

    def __init__(self, params, make_inner):
        self.params = list(params)
        self.masters = [p.detach().float().requires_grad_(True) for p in self.params]
        self.inner = make_inner(self.masters)
        self.param_groups = self.inner.param_groups

    @property
    def state(self) -> dict:
        """Per weight: its fp32 master and the inner optimizer's state for it."""
        return {p: {"master": m, **self.inner.state.get(m, {})}
                for p, m in zip(self.params, self.masters)}

    def step(self):
        for p, master in zip(self.params, self.masters):
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        self.inner.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                p.copy_(master)

    def zero_grad(self, set_to_none: bool = True):
        for p, master in zip(self.params, self.masters):
            p.grad = master.grad = None


def make_optimizer(params, optimizer: str = "adamw", impl: str | None = None, lr: float = 1e-3,
                   device: str | torch.device = "cpu", master_weights: bool = False):
    """A torch optimizer by the course's names; ``impl`` picks AdamW's implementation;
    ``master_weights`` wraps it in ``MasterWeights``."""
    if master_weights:
        return MasterWeights(params, lambda masters: make_optimizer(masters, optimizer, impl,
                                                                     lr, device))
    check_choice("optimizer", optimizer, OPTIMIZERS)
    impl = impl or default_optimizer_impl(device)
    check_choice("optimizer implementation", impl, OPTIMIZER_IMPLS)
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
             "fused": dict(fused=True)}[impl]
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **flags)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, **flags)
    if optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **flags)
    raise ValueError("adamw-8bit is modelled by labkit.estimate only: measuring it needs "
                     "bitsandbytes (lab 06); use optimizer='adamw' to measure")


@dataclass
class StepResult:
    loss: float | None          # None on fake tensors


def train_step(model, optimizer, tokens, targets, precision: str = "fp32", scaler=None,
               tracker=None, loss_factor: float = 1.0, offload: bool = False) -> StepResult:
    """forward -> backward -> optimizer step -> zero_grad(set_to_none), phases marked on ``tracker``.

    ``loss_factor`` multiplies the loss before backward (lab 02 shrinks gradients with it);
    the loss reported is the model's own. ``offload`` keeps what autograd saves in pinned
    CPU memory (``torch.autograd.graph.save_on_cpu``): GPU memory for PCIe traffic.
    """
    phase = tracker.phase if tracker is not None else (lambda name: contextlib.nullcontext())
    dtype = autocast_dtype(precision)
    autocast = (torch.autocast(tokens.device.type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())
    saving = (torch.autograd.graph.save_on_cpu(pin_memory=tokens.device.type == "cuda")
              if offload else contextlib.nullcontext())
    with saving:
        with phase("forward"), autocast:
            loss = model(tokens, targets)
        with phase("backward"):
            scaled = loss * loss_factor if loss_factor != 1.0 else loss
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
    with phase("optimizer"):
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(None if isinstance(loss, FakeTensor) else loss.item())


# ---- one measured training step ----------------------------------------------------------
@dataclass
class Measurement(Breakdown):
    """A ``Breakdown`` measured by the tracker, with its timeline and whose step it was.

    ``device``: whose defaults the step used ("cuda": foreach AdamW); with ``fake`` the
    tensors were CPU fake tensors whatever the device.
    """

    timeline: Timeline = field(default_factory=Timeline)
    device: str = "cpu"
    fake: bool = False
    optimizer_impl: str = ""
    cuda_peak: int | None = None     # torch.cuda.max_memory_allocated for the same step
    loss: float | None = None


def init_optimizer_state(model, optimizer):
    """Allocate the optimizer's state with one step on zero gradients (no forward pass needed)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _causal_lm_loss(model, tokens):
    """A Hugging Face causal LM's loss: it shifts the labels by one position itself."""
    return model(input_ids=tokens, labels=tokens).loss


def _fake_mode_of(module):
    """The FakeTensorMode the module's parameters were made under, or None for real ones."""
    params = list(module.parameters())
    fake = [p for p in params if isinstance(p, FakeTensor)]
    if fake and len(fake) < len(params):
        raise ValueError("the module mixes fake and real parameters; build all of it under "
                         "one FakeTensorMode (or pass a function that builds it)")
    return fake[0].fake_mode if fake else None


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


def _vocab_size(model) -> int:
    """How many token ids the model embeds: from labkit's config or ``model.config``."""
    size = getattr(getattr(model, "cfg", None) or getattr(model, "config", None),
                   "vocab_size", None)
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__}: "
                         f"measure_step draws tokens below model.config.vocab_size; "
                         f"give the module a config with vocab_size")
    return size


def _warm_up(params, optimizer):
    """``init_optimizer_state`` for the trainable parameters only (frozen ones get no state)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_step(cfg, batch: int = 1, seq: int = 2048, precision: str = "bf16-mixed",
                 optimizer: str = "adamw", recompute: str = "none", fake: bool | None = None,
                 device: str | None = None, optimizer_impl: str | None = None,
                 warmup: bool = True, seed: int = 0, loss_fn=None) -> Measurement:
    """Run one training step under the tracker; bytes at its peak.

    ``cfg``: what is trained -
    - a ``ModelConfig`` or preset name: ``labkit.model`` built from it (``fake`` by default);
    - an ``nn.Module`` as it is: real tensors, or fake ones made under a ``FakeTensorMode``
      (the step reuses that mode); ``fake`` follows its parameters;
    - a function of no arguments that returns a module (``lambda: AutoModelForCausalLM.
      from_config(hf_cfg)``): called inside the step's FakeTensorMode (``fake`` by default)
      with the default dtype set to ``precision``'s weight dtype, as ``build_model`` does.
    The loss: labkit's ``Transformer`` is called ``model(inputs, targets)``; any other module
    as a Hugging Face causal LM, ``model(input_ids=tokens, labels=tokens).loss`` (it shifts
    the labels itself); or ``loss_fn(model, tokens)`` with tokens (batch, seq), if given.
    Random tokens are drawn below the vocabulary size of labkit's config or ``model.config``.
    ``recompute`` applies to labkit's model only (another module brings its own, e.g.
    ``gradient_checkpointing_enable()``); a given labkit model keeps its own settings under
    "none". Only parameters with ``requires_grad`` are trained; a given module is put in
    training mode and takes the step (its weights change).

    ``device``: whose step it is, "cuda" or "cpu". A real step (``fake=False``) runs there
    (default: ``device()``; a given real module: where its parameters are). A fake step runs
    on CPU fake tensors - shapes and bytes real, no memory used, labkit's MoE routing
    balanced - with that device's defaults (default "cuda": AdamW foreach), because fake
    CUDA tensors cannot run on a CPU-only build; what a real GPU adds (CUDA context,
    allocator rounding, library workspaces) is not in it.
    ``warmup`` creates the optimizer state first, so the measured step is a steady-state one
    (the first step's peak is lower: its state is born inside ``optimizer.step()``).
    """
    from .checkpointing import apply_recompute, parse_policy
    from .config import ModelConfig, preset
    from .model import Transformer, build_model

    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (batch, seq)):
        raise ValueError(f"batch and seq must be positive integers, got batch={batch!r}, "
                         f"seq={seq!r}")
    weight_dtype = param_dtype(precision)
    parse_policy(recompute)
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    if isinstance(cfg, ModelConfig) and seq > cfg.max_seq:
        raise ValueError(f"seq={seq} exceeds the model's max_seq={cfg.max_seq}; "
                         f"use cfg.replace(max_seq={seq})")
    if not isinstance(cfg, (ModelConfig, torch.nn.Module)) and not callable(cfg):
        raise TypeError(f"measure_step takes a ModelConfig, a preset name, an nn.Module or a "
                        f"function that builds one, got {type(cfg).__name__}")
    given = cfg if isinstance(cfg, torch.nn.Module) else None
    if given is None:
        fake = True if fake is None else fake
        mode = FakeTensorMode() if fake else None
    else:                                   # the module's tensors decide: fake or real, where
        mode = _fake_mode_of(given)
        if fake is not None and fake != (mode is not None):
            raise ValueError(f"fake={fake} but the module's parameters are "
                             f"{'fake' if mode else 'real'} tensors; build the module under "
                             f"FakeTensorMode (or pass a function that builds it) to measure "
                             f"it on fake tensors, or leave fake unset")
        fake, here = mode is not None, next(given.parameters()).device
        if not fake and device is not None and torch.device(device).type != here.type:
            raise ValueError(f"the module's parameters are on {here}, not {device}; move it "
                             f"with module.to({device!r}) or pass device={here.type!r}")
        device = device or (None if fake else here.type)
    whose = torch.device(device or ("cuda" if fake else default_device())).type
    check_choice("device", whose, DEVICES)
    impl = optimizer_impl or default_optimizer_impl(whose)
    runs_on = here if given is not None else torch.device("cpu" if fake else whose)
    torch.manual_seed(seed)
    with mode or contextlib.nullcontext():
        if isinstance(cfg, ModelConfig):
            model = build_model(cfg, weight_dtype, runs_on)
        elif given is None:                 # a function that builds the module
            previous = torch.get_default_dtype()
            torch.set_default_dtype(weight_dtype)
            try:
                with torch.device(runs_on):
                    model = cfg()
            finally:
                torch.set_default_dtype(previous)
            if not isinstance(model, torch.nn.Module):
                raise TypeError(f"the function passed to measure_step returned "
                                f"{type(model).__name__}, not an nn.Module")
        else:
            model = given
        _check_weights(model, precision)
        if recompute != "none" or isinstance(cfg, ModelConfig):
            if not isinstance(model, Transformer):
                raise ValueError(f"recompute={recompute!r} applies to labkit's model only; for "
                                 f"another module turn on its own checkpointing (Hugging "
                                 f"Face: model.gradient_checkpointing_enable()) and pass "
                                 f"recompute='none'")
            apply_recompute(model, recompute)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, optimizer, impl, device=runs_on,
                             master_weights=precision == "bf16-master")
        scaler = (torch.amp.GradScaler(runs_on.type) if precision == "fp16-mixed" and not fake
                  else None)
        vocab = _vocab_size(model)
        if isinstance(model, Transformer) and loss_fn is None:
            tokens = torch.randint(0, vocab, (batch, seq + 1), device=runs_on)
            inputs, targets, step = tokens[:, :-1], tokens[:, 1:], model    # (B, T) each
        else:
            inputs, targets = torch.randint(0, vocab, (batch, seq), device=runs_on), None
            loss_of = loss_fn or _causal_lm_loss
            step = lambda tokens, targets: loss_of(model, tokens)           # noqa: E731
        if warmup:
            _warm_up(params, opt)
        if runs_on.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with MemoryTracker(model, opt) as mt:
            result = train_step(step, opt, inputs, targets, precision, scaler, tracker=mt)
    forward_end = [i for i, p in enumerate(mt.timeline.phase) if p == "forward"]
    at_end = {c: series[forward_end[-1]] if forward_end else 0
              for c, series in mt.timeline.by_category.items()}
    peak = mt.peak_by_category
    return Measurement(
        **peak, peak_phase=mt.peak_phase,
        saved_activations=at_end["activations"], saved_weight_cache=at_end["weight_cache"],
        timeline=mt.timeline, device=whose, fake=fake,
        optimizer_impl=impl, loss=result.loss,
        cuda_peak=torch.cuda.max_memory_allocated() if runs_on.type == "cuda" else None)


def bigram_corpus(vocab_size: int, n_tokens: int, seed: int = 0, branching: int = 4) -> torch.Tensor:
    """A seeded token stream where each token is followed by one of ``branching`` successors:
    learnable in a few dozen steps, its best loss is ln(branching)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
    choice = torch.randint(0, branching, (n_tokens,), generator=g)
    tokens = torch.empty(n_tokens, dtype=torch.long)
    tokens[0] = 0
    for i in range(1, n_tokens):
        tokens[i] = successors[tokens[i - 1], choice[i]]
    return tokens


def train(cfg, steps: int = 50, precision: str = "fp32", batch: int = 8, seq: int = 64,
          lr: float = 3e-3, seed: int = 0, scaler=None, loss_factor: float = 1.0,
          progress: bool = True) -> list[float]:
    """A short real training run of ``labkit.model`` on ``bigram_corpus``; the loss per step.

    Same seed, same initial weights and batches for every precision, so curves compare.
    ``scaler`` (a GradScaler or labkit's DynamicLossScaler) is used for fp16. AdamW ignores
    the gradients' overall size, so ``loss_factor`` changes nothing unless gradients underflow.
    """
    from tqdm.auto import trange
    from .config import preset
    from .model import build_model

    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    if steps <= 0 or batch <= 0 or seq <= 0:
        raise ValueError(f"steps, batch and seq must be positive, got {steps}, {batch}, {seq}")
    torch.manual_seed(seed)
    model = build_model(cfg, param_dtype(precision))
    opt = make_optimizer(model.parameters(), "adamw", lr=lr,
                         master_weights=precision == "bf16-master")
    corpus = bigram_corpus(cfg.vocab_size, steps * batch * (seq + 1), seed)
    rows = corpus.view(steps, batch, seq + 1)                                # (steps, B, T+1)
    losses = []
    for step in trange(steps, desc=f"training {cfg.name} ({precision})", disable=not progress):
        result = train_step(model, opt, rows[step, :, :-1], rows[step, :, 1:], precision, scaler,
                            loss_factor=loss_factor)
        losses.append(result.loss)
    return losses


def time_step(cfg, precision: str = "bf16-mixed", seq: int = 1024, batch: int = 1,
              device="cuda", repeats: int = 5, recompute: str = "none",
              offload: bool = False) -> float:
    """Median seconds of one real training step (after one warm-up step) on ``device``."""
    import statistics
    import time
    from .config import preset
    from .model import build_model

    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    device = torch.device(device)
    from .checkpointing import apply_recompute
    model = apply_recompute(build_model(cfg, param_dtype(precision), device), recompute)
    opt = make_optimizer(model.parameters(), device=device,
                         master_weights=precision == "bf16-master")
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16-mixed" else None
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(model, opt, tokens[:, :-1], tokens[:, 1:], precision, scaler, offload=offload)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
