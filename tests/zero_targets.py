"""What the ZeRO tests run on each rank (spawn imports it by name), and one process's reference."""
import torch

from labkit.core.config import preset
from labkit.parallel.data.zero_step import ZeroOptimizer
from labkit.training.train import make_optimizer
from labkit.transformer.model import build_model

BATCH, SEQ, STEPS, LR = 4, 16, 3, 1e-2     # BATCH rows split over 1, 2 or 4 ranks


def batches(steps=STEPS):
    """The same global batches everywhere: (BATCH, SEQ + 1) tokens per step."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def fresh_model(dtype=torch.float32):
    torch.manual_seed(0)
    return build_model(preset("tiny"), dtype=dtype)


DTYPES = {"fp32": torch.float32, "bf16-master": torch.bfloat16, "fp64": torch.float64}


def train_reference(precision="fp32", n=1):
    """One process, torch's AdamW (bf16: under MasterWeights), each step's gradient the mean of
    the n slices' gradients (n = 1: one backward over the whole batch): losses, params."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # tiny matmuls: a 2nd thread only waits (60x slower when busy)
    try:
        return _train_reference(precision, n)
    finally:
        torch.set_num_threads(threads)


def _train_reference(precision, n):
    model = fresh_model(DTYPES[precision])
    opt = make_optimizer(model.parameters(), "adamw", impl="for-loop", lr=LR,
                         master_weights=precision == "bf16-master")
    params = list(model.parameters())
    losses = []
    for rows in batches():
        total, loss_sum = [torch.zeros_like(p) for p in params], 0.0
        for part in rows.chunk(n):                                  # (BATCH / n, SEQ + 1) each
            loss = model(part[:, :-1], part[:, 1:])
            loss.backward()
            loss_sum += loss.item()
            for t, p in zip(total, params):
                t += p.grad
                p.grad = None
        for t, p in zip(total, params):
            p.grad = t / n
        opt.step()
        opt.zero_grad()
        losses.append(loss_sum / n)
    return losses, [p.detach().clone() for p in params]


def train_zero(ctx, runs):
    """For each (stage, precision) in runs: train STEPS steps on this rank's rows from the same
    initial model; return what the tests compare, keyed by (stage, precision)."""
    torch.set_num_threads(1)          # this rank's own process: one thread suits tiny matmuls
    per_rank = BATCH // ctx.world_size
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    out = {}
    for stage, precision in runs:
        model = fresh_model(DTYPES[precision])
        opt = ZeroOptimizer(model, ctx.group, stage, precision, lr=LR)
        losses, sent = [], []
        for rows in batches():
            rows = rows[mine]                                       # (BATCH / N, SEQ + 1)
            loss = model(rows[:, :-1], rows[:, 1:])
            loss.backward()
            grads_after_backward = sum(t.nbytes for t, c in opt.memory_tags() if c == "grads")
            grads_after_backward += sum(u.bucket.nbytes for u in opt.units if u.bucket is not None)
            opt.step()
            losses.append(loss.item())
            sent.append(opt.last_step)
            if len(sent) < STEPS:
                opt.zero_grad()
        # what this rank holds between steps (before zero_grad): full parameters, full gradients
        param_bytes = sum(u.flat.untyped_storage().nbytes() for u in opt.units)
        grad_bytes = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        out[stage, precision] = dict(
            losses=losses, params=opt.full_parameters(), sent=sent, param_bytes=param_bytes,
            grad_bytes=grad_bytes, grads_after_backward=grads_after_backward, state_bytes=opt.state_bytes(), master_bytes=opt.master_bytes(),
            numel=opt.numel, shard_numel=opt.shard_numel, units=len(opt.units))
    return out


def step_with_a_missing_gradient(ctx, stage):
    """A backward that reaches only the embedding: the step must say which unit waited."""
    model = fresh_model()
    opt = ZeroOptimizer(model, ctx.group, stage)
    tokens = batches(1)[0]
    (model.embed(tokens).sum() * 0).backward()       # no gradient for anything else
    try:
        opt.step()
    except ValueError as error:
        return str(error)
    return None
