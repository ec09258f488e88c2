"""Rank functions for benchmarks/zero_steps.py (spawn imports them by module name)."""
import time

import torch

from labkit.core.config import preset
from labkit.parallel.data.zero_step import ZeroOptimizer
from labkit.parallel.steps import rank_tokens
from labkit.training.train import make_optimizer, train_step
from labkit.transformer.model import build_model


def step_seconds(ctx, stage: int, model_name: str, batch: int, seq: int, steps: int) -> list:
    """Seconds of each training step on this rank: DDP (stage 0) or labkit's ZeRO stage."""
    torch.manual_seed(0)
    model = build_model(preset(model_name))
    if stage == 0:
        forward = torch.nn.parallel.DistributedDataParallel(model, process_group=ctx.group)
        opt = make_optimizer(model.parameters(), "adamw", impl="for-loop")
    else:
        forward, opt = model, ZeroOptimizer(model, ctx.group, stage)
    seconds = []
    for tokens in rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps):
        start = time.perf_counter()
        train_step(forward, opt, tokens[:, :-1], tokens[:, 1:])
        seconds.append(time.perf_counter() - start)
    return seconds
