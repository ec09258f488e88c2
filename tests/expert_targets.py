"""What the expert-parallel tests run on each rank (spawn imports it by name): every check's
figures from one start-up of the cluster (``everything`` for test_expert.py, ``composed`` for
test_compose.py)."""
import torch

from labkit.core.config import preset

from labkit.parallel.expert.expert_parallel import (build, ep_dp_step, ep_optimizer, ep_steps,
                                                    forward_backward, shard_kept)
from labkit.parallel.steps import rank_tokens

SEQ = 32          # one row of SEQ tokens per rank
STEP_SEQ = 64     # training steps: long enough that the peak falls in the backward pass
HOT = 1.0         # router bias on rank 0's experts: every token goes there
HOTS = (0.0, 0.03, HOT)   # unbiased (about balanced), most tokens, every token on rank 0
# the forward/backward cases checked against one process: name, dtype, router bias
CASES = (("fp64", torch.float64, None), ("fp32", torch.float32, None),
         ("fp64 skewed", torch.float64, HOT))


def everything(ctx) -> dict:
    """name -> this rank's result (see test_expert.py)."""
    torch.set_num_threads(1)
    out = {name: forward_backward(ctx, seq=SEQ, dtype=dtype, hot=hot)
           for name, dtype, hot in CASES}
    out["steps"] = ep_steps(ctx, [dict(seq=STEP_SEQ, hot=hot) for hot in HOTS])
    out["kept"] = shard_kept(ctx, seq=SEQ)
    return out


# ep x dp on 4 ranks (test_compose.py): the layouts measured, and the step's size
WORLD = 4
LAYOUTS = ((2, 2), (4, 1), (1, 4))          # (ep, dp)
BATCH, STEP_SEQ_4 = 2, 64
ZERO_STAGES = (1, 2, 3)                     # with the experts' units over their dp group
# experts large beside the rest: their bucket, made early in a block's backward, sets the peak
BIG_EXPERTS = dict(moe_ffn=512, routed_experts=16)
LORA_RANK = 8


def composed(ctx) -> dict:
    """ep 2 x dp 2 against one process (fp64, unbiased and skewed routers, and ZeRO-1's
    gradients), and each layout's steady training step (fp32, for-loop AdamW; and ZeRO-1)."""
    torch.set_num_threads(1)
    out = {name: forward_backward(ctx, seq=SEQ, dtype=torch.float64, hot=hot, ep=2)
           for name, hot in (("fp64", None), ("fp64 skewed", HOT))}
    out["steps"] = {(ep, dp): ep_dp_step(ctx, ep, batch=BATCH, seq=STEP_SEQ_4)
                    for ep, dp in LAYOUTS}
    # ZeRO-1: each expert shard's states over its dp copies, the rest over the 4 ranks
    out["fp64 zero-1"] = forward_backward(ctx, seq=SEQ, dtype=torch.float64, ep=2, zero_stage=1)
    for stage in ZERO_STAGES:
        out[f"zero-{stage} steps"] = {(ep, dp): ep_dp_step(ctx, ep, batch=BATCH, seq=STEP_SEQ_4,
                                                           zero_stage=stage)
                                      for ep, dp in LAYOUTS}
        out[f"zero-{stage} params"] = zero_params(ctx, stage)
        out[f"zero-{stage} big experts"] = ep_dp_step(ctx, 2, preset("tiny-moe", **BIG_EXPERTS),
                                                      batch=BATCH, seq=STEP_SEQ_4,
                                                      zero_stage=stage)
    # LoRA: adapters train on the frozen model, the routed experts' shards frozen too
    out["lora steps"] = {(ep, dp, stage): ep_dp_step(ctx, ep, batch=BATCH, seq=STEP_SEQ_4,
                                                     zero_stage=stage, lora_rank=LORA_RANK)
                         for ep, dp in LAYOUTS for stage in (0, 1, 2)}
    return out


def zero_params(ctx, stage: int, steps: int = 2) -> list:
    """Every parameter, whole, after ``steps`` fp64 AdamW steps of ep 2 x dp 2 under ZeRO
    ``stage`` (the experts' units over their dp copies)."""
    model, groups = build(ctx, dtype=torch.float64, ep=2)
    _, opt = ep_optimizer(model, groups, "fp64", stage)
    for tokens in rank_tokens(ctx, model.cfg.vocab_size, 1, SEQ, steps, 0):   # (1, SEQ + 1)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return opt.full_parameters()
