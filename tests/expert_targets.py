"""What the expert-parallel tests run on each rank (spawn imports it by name): every check's
figures from one start-up of the cluster."""
import torch

from labkit.parallel.expert import ep_steps, forward_backward, shard_kept

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
