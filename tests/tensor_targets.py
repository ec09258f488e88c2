"""What the tensor-parallel tests run on each rank (spawn imports it by name), and the one-process
parts they are compared with: the same seeds build the same weights and inputs everywhere."""
import itertools

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from labkit.core.config import preset
from labkit.parallel.comm import CommCounter
from labkit.parallel.tensor.comm import gather_from_sequence, my_tokens
from labkit.parallel.tensor.tensor_parallel import (STYLES, ParallelAttention, ParallelSwiGLU,
                                                    parallelize, parallelize_block,
                                                    tensor_parallel_step,
                                                    vocab_parallel_cross_entropy)
from labkit.quantisation.lora import apply_lora
from labkit.quantisation.quant import LoRALinear
from labkit.training.track import MemoryTracker, activations_per_module
from labkit.training.train import make_optimizer, train_step
from labkit.transformer.model import Block, GroupedQueryAttention, Rotary, SwiGLU, build_model

# tp = 1, 2 and 4 divide its heads (8), kv heads (4) and ffn (176); still grouped-query attention
CFG = preset("tiny").replace(name="tiny-tp", heads=8, kv_heads=4, head_dim=8)
# Gemma's block: a norm after each sub-layer (their weights' gradients summed over the ranks
# under sp), Gemma-style norms, q and k norms, GeGLU, the scaled embedding
GEMMA = CFG.replace(name="tiny-tp-gemma", norms="sandwich", norm_style="gemma", qk_norm=True,
                    activation="gelu_tanh", embed_scale=True)
BATCH, SEQ = 2, 16                  # SEQ: a multiple of 4 (sequence parallelism splits it)
MEMORY_SEQ = 256                    # one block's saved activations, measured in fp32
STEPS = 3                           # AdamW steps of the whole model, fp32
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
SMALL_SEQ = 256                     # ``small``'s step whose per-rank peak the estimate predicts
LORA_RANK = 8
IGNORED = 3                         # targets of the first row set to ignore_index (-100)
PARTS = ("mlp", "attention", "block")


def part(name: str, dtype):
    """(module, input x, probe): one process's sub-layer; the loss is (module(x) * probe).sum()."""
    torch.manual_seed(0)
    module = {"mlp": lambda: SwiGLU(CFG.hidden, CFG.ffn),
              "attention": lambda: GroupedQueryAttention(CFG),
              "block": lambda: Block(CFG, 0)}[name]().to(dtype)
    x = torch.randn(BATCH, SEQ, CFG.hidden, dtype=dtype)                     # (B, T, h)
    probe = torch.randn(BATCH, SEQ, CFG.hidden, dtype=dtype)                 # (B, T, h)
    return module, x, probe


def rope():
    return Rotary(CFG.rope_dim, CFG.max_seq, CFG.rope_theta)


def run_part(module, x, probe):
    """Forward and backward: the output, the input's gradient, the parameters' gradients, and
    the bytes the forward pass left alive (what it saved for backward, and the output)."""
    x = x.detach().clone().requires_grad_()
    with MemoryTracker() as mt:
        out = module(x, rope()) if isinstance(module, (GroupedQueryAttention, ParallelAttention,
                                                       Block)) else module(x)
        kept = mt.current
    (out * probe).sum().backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)        # the next run of the same weights starts afresh
    return dict(out=out.detach(), x_grad=x.grad, kept=kept, grads=grads)


class GatherThenLinears(torch.nn.Module):
    """The sequence-parallel MLP with ``gather_from_sequence`` as g before the plain column
    linears, which then keep all T tokens of their input for backward."""

    def __init__(self, mlp: ParallelSwiGLU):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):                                                     # (B, T/N, h)
        m, full = self.mlp, gather_from_sequence(x, self.mlp.comm)            # (B, T, h)
        return m.w_down(F.silu(m.w_gate(full)) * m.w_up(full))               # (B, T/N, h)


def tokens(seq=SEQ, batch=BATCH):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CFG.vocab_size, (batch, seq + 1), generator=g)


def fresh_model(dtype, cfg=CFG):
    torch.manual_seed(0)
    return build_model(cfg, dtype=dtype)


def run_model(model, one_process: bool = False):
    """The loss of one step and every parameter's gradient. One process's loss is taken here
    from its logits in their own dtype (the model's loss casts them to fp32, fp64 too), as the
    vocabulary-parallel loss does."""
    rows = tokens()
    if one_process:
        loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
    else:
        loss = model(rows[:, :-1], rows[:, 1:])
    loss.backward()
    return dict(loss=loss.detach(), grads={n: p.grad for n, p in model.named_parameters()})


def train_one_process(precision: str = "fp32") -> list:
    """The losses of ``tensor_parallel_step``'s steps in one process: same weights, rows, AdamW."""
    torch.manual_seed(0)
    model = build_model(CFG)
    optimizer = make_optimizer(model.parameters(), "adamw", impl="for-loop")
    g = torch.Generator().manual_seed(0)                  # labkit.parallel.steps.rank_tokens's rows
    rows = [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
    return [train_step(model, optimizer, r[:, :-1], r[:, 1:], precision).loss for r in rows]


def style(name: str) -> str:
    """'blocks.0.attn.wq.weight' -> 'column' (the style of the projection it belongs to)."""
    owner = name.rsplit(".", 2)[-2]
    return next((s for key, s in STYLES.items() if key.split(".")[-1] == owner), "replicated")


def shard_of(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The slice of a one-process parameter (or gradient) that rank ``rank`` holds; a LoRA
    column target's B splits its outputs (A whole), a row target's A its inputs (B whole)."""
    dim = {"column": 0, "vocab": 0, "row": 1}.get(style(name))
    if name.endswith((".A", ".B")):
        dim = {("column", "B"): 0, ("row", "A"): 1}.get((style(name), name[-1]))
    return full if dim is None else full.chunk(world, dim=dim)[rank]


def _parallel_part(name, module, comm, sp):
    if name == "mlp":
        return ParallelSwiGLU(module, comm, sp)
    if name == "attention":
        return ParallelAttention(module, comm, sp)
    return parallelize_block(module, comm, sp)


def compare(ctx, precision: str = "fp64") -> dict:
    """Every part on this rank, with and without sequence parallelism: {(part, sp): results}."""
    torch.set_num_threads(1)
    dtype, out = DTYPES[precision], {}
    for sp in (False, True):
        for name in PARTS:
            module, x, probe = part(name, dtype)
            comm = CommCounter(ctx.group)
            parallel = _parallel_part(name, module, comm, sp)
            if sp:                       # this rank's tokens in, this rank's tokens out
                x, probe = my_tokens(x, comm), my_tokens(probe, comm)
            out[name, sp] = run_part(parallel, x, probe) | dict(sent=dict(comm.sent))
            if name == "mlp" and sp:
                out["mlp gathered", sp] = run_part(GatherThenLinears(parallel), x, probe)
        for key, cfg in (("model", CFG), ("gemma", GEMMA)):
            model = fresh_model(dtype, cfg)
            parallelize(model, ctx, sp)
            out[key, sp] = run_model(model)
        for precision in ("fp32", "bf16-mixed"):
            out["train", precision, sp] = tensor_parallel_step(ctx, CFG, BATCH, SEQ, sp,
                                                               precision, STEPS)
        out["small", sp] = tensor_parallel_step(ctx, "small", 1, SMALL_SEQ, sp, "fp32", STEPS)
    out["loss"] = vocab_loss(ctx, dtype)
    out["loss memory"] = vocab_loss_memory(ctx)
    out["dtensor"] = dtensor_blocks(ctx, dtype)
    out["memory"] = block_activations(ctx)
    return out


def logits_and_targets(dtype):
    """One process's (B, T, V) logits and (B, T) targets, the first ``IGNORED`` ignored."""
    torch.manual_seed(0)
    logits = 3 * torch.randn(BATCH, SEQ, CFG.vocab_size, dtype=dtype)        # (B, T, V)
    targets = tokens()[:, 1:].clone()                                        # (B, T)
    targets[0, :IGNORED] = -100
    return logits, targets


def vocab_loss(ctx, dtype) -> dict:
    """``vocab_parallel_cross_entropy`` on this rank's V/N columns of the logits: the loss and
    the gradient of its shard, and the bytes it sent."""
    logits, targets = logits_and_targets(dtype)
    comm = CommCounter(ctx.group)
    mine = logits.chunk(ctx.world_size, dim=-1)[ctx.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine * 1, targets, comm)   # a copy: it works in place
    loss.backward()
    return dict(loss=loss.detach(), grad=mine.grad, sent=dict(comm.sent))


def vocab_loss_memory(ctx) -> dict:
    """fp32 bytes around the vocabulary-parallel loss of a column-parallel head's logits, beyond
    what is alive before it: the forward pass's peak and what it keeps, and the backward
    pass's peak through the loss and the head's matmul (its weight's and input's gradients)."""
    torch.manual_seed(0)
    targets = tokens()[:, 1:]                                                # (B, T)
    comm = CommCounter(ctx.group)
    with MemoryTracker() as mt:
        hidden = torch.randn(BATCH, SEQ, CFG.hidden, requires_grad=True)     # (B, T, h)
        weight = torch.randn(CFG.vocab_size // ctx.world_size, CFG.hidden,
                             requires_grad=True)                             # (V/N, h)
        before = mt.current
        loss = vocab_parallel_cross_entropy(F.linear(hidden, weight), targets, comm)
        forward, kept = mt.peak - before, mt.current - before
        mt.reset_peak()
        loss.backward()
        backward = mt.peak - before
    return dict(forward=forward, kept=kept, backward=backward)


def block_activations(ctx) -> dict:
    """{(precision, sp): {block: bytes it keeps for backward on this rank}}, batch 1; fp32
    weights, and "bf16-mixed" under autocast."""
    kept = {}
    for precision, sp in itertools.product(("fp32", "bf16-mixed"), (False, True)):
        model = fresh_model(torch.float32)
        parallelize(model, ctx, sp)
        rows = tokens(MEMORY_SEQ, batch=1)
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            kept[precision, sp] = activations_per_module(
                model, rows[:, :-1], rows[:, 1:],
                {f"block {i}": b for i, b in enumerate(model.blocks)})
    return kept


def dtensor_blocks(ctx, dtype) -> dict:
    """The same block through PyTorch's DTensor tensor parallelism (torchtitan's plan for a
    LLaMA block): {sp: this rank's output}. Colwise q, k, v leave local tensors, so the
    attention's head counts are set to this rank's, as torchtitan does."""
    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    outs = {}
    for sp in (False, True):
        block, x, _ = part("block", dtype)
        block.attn.heads //= ctx.world_size
        block.attn.kv_heads //= ctx.world_size
        plan = {f"attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan |= {f"mlp.{w}": ColwiseParallel() for w in ("w_gate", "w_up")}
        rowwise = dict(output_layouts=Shard(1)) if sp else {}
        plan |= {"attn.wo": RowwiseParallel(**rowwise), "mlp.w_down": RowwiseParallel(**rowwise)}
        if sp:      # norms on this rank's tokens; all-gather the tokens into attention and MLP
            plan |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                     "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                     "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),))}
        parallelize_module(block, mesh, plan)
        if sp:
            x = my_tokens(x, CommCounter(ctx.group))
        with torch.no_grad():
            y = block(x, rope())
        outs[sp] = y                    # RowwiseParallel leaves a plain tensor
    return outs


def lora_model(dtype, r: int = 4):
    """``fresh_model`` under rank-r LoRA, its B's random (from zero, A's gradient would be 0)."""
    model = fresh_model(dtype)
    apply_lora(model, r)
    torch.manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.B.normal_(std=0.1)
    return model


def lora(ctx) -> dict:
    """LoRA split with the model, without and with sp: one step's loss and adapter gradients in
    fp64, and ``small``'s tracked training step."""
    torch.set_num_threads(1)
    out = {}
    for sp in (False, True):
        model = lora_model(torch.float64)
        parallelize(model, ctx, sp)
        out["model", sp] = run_model(model)
        for precision in ("fp32", "bf16-mixed"):
            out["small", sp, precision] = tensor_parallel_step(
                ctx, "small", 1, SMALL_SEQ, sp, precision, STEPS, lora_rank=LORA_RANK)
    return out
