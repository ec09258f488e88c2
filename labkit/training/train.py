"""Training runs of the course's models: a loss curve (``train``), the time of a step
(``time_step``) and 8-bit against fp32 AdamW (``compare_with_adamw``). One step's mechanism
- precisions, optimizers, ``train_step`` - is ``labkit.training.step``, whose names import
from here too.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from labkit.core.config import preset
from labkit.core.recipe import (DEVICES, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS,  # noqa: F401
                                Recipe, default_optimizer_impl)
from labkit.core.units import check_positive
from labkit.predict import estimate
from labkit.quantisation.lora import apply_lora
from labkit.quantisation.optim8bit import (BLOCK, MAP_BYTES, AdamW8bit, optimizer_state_bytes,
                                           state_bytes)
from labkit.training.step import (MasterWeights, StepResult, autocast_dtype,  # noqa: F401
                                  bigram_corpus, device, make_optimizer, param_dtype, train_step)
from labkit.transformer.checkpointing import apply_recompute
from labkit.transformer.model import build_model


def train(cfg, steps: int = 50, precision: str = "fp32", batch: int = 8, seq: int = 64,
          lr: float = 3e-3, seed: int = 0, scaler=None, loss_factor: float = 1.0,
          progress: bool = True, trainable: str = "all", lora_rank: int = 16,
          weight_format: str | None = None) -> list[float]:
    """A short real training run of ``labkit.transformer.model`` on ``bigram_corpus``; the
    loss per step.

    Same seed, same initial weights and batches for every precision, so curves compare.
    ``scaler`` (a GradScaler or labkit's DynamicLossScaler) is used for fp16. AdamW ignores
    the gradients' overall size, so ``loss_factor`` changes nothing unless gradients underflow.
    ``trainable="lora"`` trains rank-``lora_rank`` adapters on the frozen model (QLoRA with
    ``weight_format="nf4"``; ``labkit.quantisation.lora``), the optimizer over the adapters only.
    """
    from tqdm.auto import trange

    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    if steps <= 0 or batch <= 0 or seq <= 0:
        raise ValueError(f"steps, batch and seq must be positive, got {steps}, {batch}, {seq}")
    torch.manual_seed(seed)
    Recipe(precision, trainable=trainable, lora_rank=lora_rank, weight_format=weight_format)
    model = build_model(cfg, param_dtype(precision))
    if trainable == "lora":
        apply_lora(model, lora_rank, weight_format=weight_format)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, "adamw", lr=lr,
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
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    device = torch.device(device)
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


# ---- 8-bit against fp32 AdamW on a course model -------------------------------------------------
@dataclass
class Comparison:
    """Two training runs of one model from the same seed on the same batches."""

    losses_fp32: list[float]
    losses_8bit: list[float]
    state_bytes_fp32: int        # measured by MemoryTracker after training
    state_bytes_8bit: int
    expected_bytes_8bit: int     # sum of state_bytes() over the parameters + the two maps
    estimated_bytes_8bit: int    # labkit.estimate(..., optimizer="adamw-8bit").optimizer
    seconds_per_step_fp32: float
    seconds_per_step_8bit: float

    @property
    def max_loss_difference(self) -> float:
        return max(abs(a - b) for a, b in zip(self.losses_fp32, self.losses_8bit))


def compare_with_adamw(model_name: str = "small", steps: int = 50, batch: int = 4,
                       seq: int = 64, seed: int = 0, lr: float = 3e-3,
                       tokens_used: int = 256, block: int = BLOCK) -> Comparison:
    """Train ``model_name`` with torch's AdamW (fp32 moments) and with ``AdamW8bit``.

    Same initial weights (``seed``), same batches, same hyperparameters (weight decay 0.1, as
    ``make_optimizer``). The batches are ``bigram_corpus`` over the
    first ``tokens_used`` tokens of the vocabulary, so a few dozen steps show a falling loss.
    """
    for name, value in (("steps", steps), ("batch", batch), ("seq", seq)):
        check_positive(name, value)
    cfg = preset(model_name)
    if not 0 < tokens_used <= cfg.vocab_size:
        raise ValueError(f"tokens_used must be in 1 ... vocab_size={cfg.vocab_size}, "
                         f"got {tokens_used}")
    rows = bigram_corpus(tokens_used, steps * batch * (seq + 1), seed)
    rows = rows.view(steps, batch, seq + 1)                                  # (steps, B, T+1)
    makers = {"fp32": lambda params: make_optimizer(params, "adamw", "for-loop", lr=lr),
              "8bit": lambda params: AdamW8bit(params, lr=lr, weight_decay=0.1, block=block)}
    losses, state, seconds = {}, {}, {}
    for name, make in makers.items():
        torch.manual_seed(seed)
        model = build_model(cfg)
        opt = make(model.parameters())
        start = time.perf_counter()
        losses[name] = [train_step(model, opt, rows[i, :, :-1], rows[i, :, 1:]).loss
                        for i in range(steps)]
        seconds[name] = (time.perf_counter() - start) / steps
        state[name] = optimizer_state_bytes(opt)
    expected = sum(state_bytes(p.numel(), block) for p in model.parameters()) + MAP_BYTES
    estimated = estimate(cfg, batch, seq, precision="fp32", optimizer="adamw-8bit",
                         device="cpu").optimizer
    return Comparison(losses["fp32"], losses["8bit"], state["fp32"], state["8bit"], expected,
                      estimated, seconds["fp32"], seconds["8bit"])
