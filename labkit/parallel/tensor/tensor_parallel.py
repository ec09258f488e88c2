"""Tensor parallelism (Megatron-LM: Shoeybi et al., 2019) and sequence parallelism
(Korthikanti et al., 2022) for labkit's dense transformer.

Each of N ranks holds 1/N of every block's matmul weights and computes 1/N of its heads and of
its MLP width; two messages per sub-layer put the pieces together (``comm``: f and g):

    x (B, T, h) --f--> q, k, v = x [Wq_i Wk_i Wv_i]  heads H/N, kv heads Hkv/N
                       y_i = attention(q, k, v) Wo_i  --g (all-reduce)--> y (B, T, h)
    x (B, T, h) --f--> silu(x Wgate_i) * (x Wup_i) Wdown_i  --g--> (B, T, h)

Which weight gets which split (``STYLES``, as ``labkit.predict.layers`` counts them for the
estimate):

    attn.wq, attn.wk, attn.wv     column   outputs split: heads (and kv heads) over the ranks
    attn.wo                       row      inputs split: each rank's heads, partial sums
    mlp.w_gate, mlp.w_up          column   ffn / N outputs each
    mlp.w_down                    row      ffn / N inputs, partial sums
    attn_norm, mlp_norm           replicated  (each rank normalises its T/N tokens under sp)
    attn_post_norm, mlp_post_norm replicated  Gemma's, OLMo 2's: as the norms above
    attn.q_norm, attn.k_norm      replicated  one weight for every head: gradients summed
    embed                         vocab    rows split: each rank looks up the tokens it holds
    norm                          replicated  (on each rank's T/N tokens under sp)
    lm_head                       vocab    rows split: each rank computes vocab / N logits

Without sequence parallelism every rank holds the norms, the residual stream and the inputs of
the column-parallel projections whole: N copies of the same bytes. With ``sp=True`` each rank
keeps only its T/N tokens of them; g becomes an all-gather of the tokens before the column
projections and ḡ a reduce-scatter after the row projection. The all-gathered input is not
kept for the backward pass: only this rank's tokens, gathered again there (``GatheredLinears``,
Korthikanti et al., section 4.2.2), so every saved tensor is 1/N of one process's.

``parallelize(model, ctx, sp)`` turns a ``labkit.transformer.model.Transformer`` whose weights are
the same on every rank into this rank's part, slicing the one-process weights, so the results can be
compared with one process. GQA attention and dense SwiGLU blocks only (no MLA, no MoE). The
split linear layers (and LoRA's adapters on them) are in ``linears``.

The LM head is column-parallel over the vocabulary, as Megatron's: rank i holds rows
[i V/N, (i + 1) V/N) and computes only those (B, T, V/N) logits (under sp from the tokens
all-gathered just before it, keeping only its own T/N for the backward pass). No rank ever holds
the whole softmax: ``vocab_parallel_cross_entropy`` all-reduces each token's max, sum of exps and
target logit, three (B*T,) messages, and works in place in the logits, as Megatron's
``vocab_parallel_cross_entropy`` does: 4 bytes per logit from the head's matmul to the end of
its backward pass. A vocabulary that N does not divide is refused (Megatron pads it with unused
rows instead: ``make_vocab_size_divisible_by``); every preset's vocabulary divides by 8.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from labkit.core.config import ModelConfig, preset
from labkit.parallel.comm import CommCounter
from labkit.parallel.steps import RankStep, measure_rank, rank_tokens
from labkit.parallel.tensor.comm import (all_gather_tokens, copy_to_parallel, reduce_from_parallel,
                                         reduce_scatter_to_sequence, reduce_scatter_tokens,
                                         sum_grad_over_ranks)
from labkit.parallel.tensor.linears import (ColumnParallelLinear, ColumnParallelLoRA, rank_slice,
                                            split_column, split_row)
from labkit.quantisation.lora import apply_lora
from labkit.quantisation.quant import LoRALinear
from labkit.training.step import make_optimizer, param_dtype, train_step
from labkit.transformer.model import (Block, GroupedQueryAttention, RMSNorm, SwiGLU, Transformer,
                                      attention_core, build_model)

# weight -> how tensor parallelism splits it (the table in the docstring)
STYLES = {"attn_norm": "replicated", "attn.wq": "column", "attn.wk": "column",
          "attn.wv": "column", "attn.wo": "row", "mlp_norm": "replicated",
          "mlp.w_gate": "column", "mlp.w_up": "column", "mlp.w_down": "row",
          "embed": "vocab", "norm": "replicated", "lm_head": "vocab"}


def check_tp(cfg: ModelConfig, tp: int):
    """ValueError unless this module can split ``cfg``'s blocks over ``tp`` ranks."""
    if cfg.attention != "gqa" or cfg.dense_layers < cfg.layers:
        raise ValueError(f"{cfg.name}: tensor parallelism here splits GQA attention and dense "
                         "SwiGLU blocks; MLA and MoE blocks are not supported (use a dense GQA "
                         "model such as 'small')")
    if cfg.qk_norm and cfg.qk_norm_width == "all":
        raise ValueError(f"{cfg.name} normalises q and k over all heads at once (OLMo 2): split "
                         "over ranks, each norm would need every rank's heads (an all-reduce of "
                         "the statistics, which this module does not send); train it without "
                         "tensor parallelism (Transformer as built)")
    if cfg.tie_embeddings:
        raise ValueError(f"{cfg.name} ties its embedding to the LM head: one weight that the "
                         "embedding's lookup and the head's matmul would split and send "
                         "separately; use tie_embeddings=False")
    sizes = (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("ffn", cfg.ffn),
             ("vocab_size", cfg.vocab_size))
    for what, n in sizes:
        if n % tp:
            fits = [t for t in range(1, cfg.kv_heads + 1) if all(n % t == 0 for _, n in sizes)]
            pad = (f", or pad the vocabulary to a multiple of {tp} (as Megatron-LM does)"
                   if what == "vocab_size" else "")
            raise ValueError(f"tp={tp} does not divide {what}={n} of {cfg.name}: each rank takes "
                             f"an equal share; choose tp among {fits}{pad}")


class VocabParallelEmbedding(nn.Module):
    """The embedding's rows split over the ranks: rank i holds tokens [i V/N, (i + 1) V/N).
    Each rank looks up the tokens it holds (zeros for the others) and g adds the N lookups
    up - or, under sequence parallelism, ḡ adds them and leaves each rank its T/N tokens."""

    def __init__(self, embed: nn.Embedding, comm: CommCounter, sp: bool = False):
        super().__init__()
        self.weight = rank_slice(embed.weight, 0, comm.rank, comm.world)           # (V/N, h)
        self.first = comm.rank * self.weight.shape[0]           # the first token this rank holds
        self.comm, self.sp = comm, sp

    def forward(self, tokens):                                                # (B, T) int64
        local = tokens - self.first
        elsewhere = (local < 0) | (local >= self.weight.shape[0])             # (B, T)
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)      # (B, T, h)
        rows = rows.masked_fill(elsewhere.unsqueeze(-1), 0.0)                 # partial sums
        if self.sp:
            return reduce_scatter_to_sequence(rows, self.comm)                # (B, T/N, h)
        return reduce_from_parallel(rows, self.comm)                          # (B, T, h)


# ---- entering the parallel region -------------------------------------------------------------
class GatheredLinears(torch.autograd.Function):
    """g then column-parallel matmuls, keeping only this rank's T/N tokens of X for backward:
    the backward pass all-gathers X again for the weight gradients (Korthikanti et al., 4.2.2)
    and reduce-scatters X's gradient, a partial sum over the ranks' outputs.
    (``gather_from_sequence`` followed by the linears would keep all T tokens of X.) Under
    autocast X is cast first: sent and kept once in 16 bits, as the matmuls read it."""

    @staticmethod
    def forward(ctx, x, comm, *weights_and_biases):                           # x (B, T/N, in)
        n = len(weights_and_biases) // 2
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        ctx.autocast = _autocast_state(x.device.type)
        if ctx.autocast["enabled"]:
            x = x.to(ctx.autocast["dtype"])
        full = all_gather_tokens(x, comm)                                     # (B, T, in)
        # X only for the weights' gradients: none kept when every weight is frozen (LoRA's head)
        ctx.keep = any(ctx.needs_input_grad[2:2 + n])
        ctx.save_for_backward(x if ctx.keep else None, *weights)
        ctx.comm, ctx.n, ctx.device = comm, n, x.device.type
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))   # (B, T, out/N) each

    @staticmethod
    def backward(ctx, *grads):                                                # (B, T, out/N) each
        x, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad             # LoRA: A's gradient, not the frozen base's
        with torch.autocast(ctx.device, **ctx.autocast):   # the forward's precision
            full = all_gather_tokens(x, ctx.comm).flatten(0, 1) if ctx.keep else None  # again
            grad_x = sum(g @ w for g, w in zip(grads, weights)) if needs[0] else None  # (B, T, in)
            grad_w = [g.flatten(0, 1).T @ full if needs[2 + i] else None      # (out/N, in) each
                      for i, g in enumerate(grads)]
        grad_b = [g.flatten(0, 1).sum(0) if needs[2 + ctx.n + i] else None
                  for i, g in enumerate(grads)]
        grad_x = None if grad_x is None else reduce_scatter_tokens(grad_x, ctx.comm)
        return grad_x, None, *grad_w, *grad_b


def _autocast_state(device_type: str) -> dict:
    return dict(enabled=torch.is_autocast_enabled(device_type),
                dtype=torch.get_autocast_dtype(device_type))


def column_parallel(x, linears, comm: CommCounter, sp: bool = False) -> list:
    """Enter the parallel region once, then every column-parallel projection that reads x:
    f (identity; all-reduce backward), or under sp the all-gather of the tokens. Under sp a
    LoRA adapter's A reads the gathered tokens beside the weights (``GatheredLinears``: only
    this rank's kept), then its B makes the update from x A^T."""
    if not sp:
        x = copy_to_parallel(x, comm)                                         # (B, T, in)
        return [linear(x) for linear in linears]
    bases = [getattr(lin, "base", lin) for lin in linears]
    adapters = [lin for lin in linears if isinstance(lin, ColumnParallelLoRA)]
    weights = [b.weight for b in bases] + [a.A for a in adapters]
    biases = [b.bias for b in bases] + [None] * len(adapters)
    outs = list(GatheredLinears.apply(x, comm, *weights, *biases))          # (B, T, out/N) each
    x_a = dict(zip(map(id, adapters), outs[len(bases):]))                   # (B, T, r) each
    for i, lin in enumerate(linears):
        if id(lin) in x_a:              # as LoRALinear's forward: the update, then the sum
            outs[i] = lin.added(outs[i], x_a[id(lin)] @ lin.B.T)             # (B, T, out/N)
    return outs[:len(bases)]


# ---- the sub-layers ---------------------------------------------------------------------------
class ParallelAttention(nn.Module):
    """Grouped-query attention with heads and kv heads split over the ranks: q, k, v
    column-parallel (H/N and Hkv/N heads each), wo row-parallel; heads never talk to each other,
    so attention itself needs no message."""

    def __init__(self, attn: GroupedQueryAttention, comm: CommCounter, sp: bool = False):
        super().__init__()
        world = comm.world
        self.heads, self.kv_heads = attn.heads // world, attn.kv_heads // world
        self.head_dim, self.comm, self.sp, self.window = attn.head_dim, comm, sp, attn.window
        self.wq, self.wk, self.wv = (split_column(w, comm) for w in (attn.wq, attn.wk, attn.wv))
        self.wo = split_row(attn.wo, comm, sp)
        # Qwen3's and Gemma 3's q and k norms: one weight for every head, replicated; each
        # rank's heads add a part of its gradient
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        for norm in (self.q_norm, self.k_norm):
            if isinstance(norm, RMSNorm):
                sum_grad_over_ranks(norm.weight, comm)

    def forward(self, x, rope, mask=None):                      # x (B, T, h), (B, T/N, h) if sp
        q, k, v = column_parallel(x, (self.wq, self.wk, self.wv), self.comm, self.sp)
        B, T, _ = q.shape                                                     # all T tokens
        q = self.q_norm(q.view(B, T, self.heads, self.head_dim)).transpose(1, 2)    # (B, H/N, T, d)
        k = self.k_norm(k.view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        # k (B, Hkv/N, T, d); per-head norms only (check_tp refuses OLMo's whole-projection ones)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)        # (B, Hkv/N, T, d)
        y = attention_core(rope(q), rope(k), v, mask, window=self.window)     # (B, H/N, T, d)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))         # (B, T, h), (B, T/N, h) if sp


class ParallelSwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (or the model's GeGLU) with gate and up column-parallel (ffn/N each) and down
    row-parallel: the elementwise product needs no message (Megatron's MLP, figure 3a)."""

    def __init__(self, mlp: SwiGLU, comm: CommCounter, sp: bool = False):
        super().__init__()
        self.w_gate, self.w_up = (split_column(w, comm) for w in (mlp.w_gate, mlp.w_up))
        self.w_down = split_row(mlp.w_down, comm, sp)
        self.comm, self.sp, self.act = comm, sp, mlp.act

    def forward(self, x):                                       # x (B, T, h), (B, T/N, h) if sp
        gate, up = column_parallel(x, (self.w_gate, self.w_up), self.comm, self.sp)
        return self.w_down(self.act(gate) * up)                 # (B, T, h), (B, T/N, h) if sp


# ---- the LM head and the loss -----------------------------------------------------------------
class VocabParallelHead(ColumnParallelLinear):
    """The LM head with its rows (the vocabulary) split: rank i computes the logits of the
    vocabulary entries [i V/N, (i + 1) V/N) only. Its input enters the parallel region as q, k,
    v's does: f, or under sp the all-gather of the tokens, keeping this rank's T/N for backward."""

    def __init__(self, lm_head: nn.Linear, comm: CommCounter, sp: bool = False):
        super().__init__(lm_head, comm.rank, comm.world)                     # weight (V/N, h)
        self.comm, self.sp = comm, sp

    def forward(self, x):                                       # x (B, T, h), (B, T/N, h) if sp
        if self.sp:
            return GatheredLinears.apply(x, self.comm, self.weight, self.bias)[0]  # (B, T, V/N)
        return super().forward(copy_to_parallel(x, self.comm))                 # (B, T, V/N)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean over the tokens of -log softmax(z)[target], the logits z split over the ranks by
    vocabulary (Megatron-LM's ``vocab_parallel_cross_entropy``). For each token,
    -log softmax(z)[t] = log sum_v exp(z_v - m) - (z_t - m) with m = max_v z_v: the max, the sum
    of exps and z_t (held by one rank) are each all-reduced, one number per token apiece.

    In place, as Megatron: the logits become z - m, then exp(z - m), then the softmax, which is
    all it saves; backward turns that into the logits' gradient, (softmax - one_hot) / count.
    4 bytes per logit from the head's matmul to the end of the loss's backward pass. (Autograd
    is not told: the matmul that made the logits does not keep them.)
    """

    @staticmethod
    def forward(ctx, logits, targets, comm, ignore_index):     # logits (BT, V/N), targets (BT,)
        width = logits.shape[1]
        counted = targets != ignore_index                                     # (BT,)
        column = targets - comm.rank * width                                  # (BT,)
        elsewhere = (column < 0) | (column >= width) | ~counted               # not on this rank
        column = column.masked_fill(elsewhere, 0)
        top = comm.all_reduce(logits.amax(dim=1), op=dist.ReduceOp.MAX)      # (BT,) m
        shifted = logits.sub_(top[:, None])                                   # (BT, V/N) z - m
        target_logit = shifted.gather(1, column[:, None])[:, 0].masked_fill(elsewhere, 0.0)
        target_logit = comm.all_reduce(target_logit)                          # (BT,) z_t - m
        exps = shifted.exp_()                                                 # (BT, V/N)
        total = comm.all_reduce(exps.sum(dim=1))                              # (BT,)
        count = counted.sum()
        loss = torch.where(counted, total.log() - target_logit, 0.0).sum() / count
        softmax = exps.div_(total[:, None])                                   # (BT, V/N)
        ctx.save_for_backward(softmax, column, elsewhere, counted, count)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        softmax, column, elsewhere, counted, count = ctx.saved_tensors
        grad = softmax                                # (BT, V/N): the gradient, in place
        rows = torch.arange(len(column), device=grad.device)
        grad[rows, column] -= (~elsewhere).to(grad.dtype)                     # - one_hot(target)
        grad.mul_(torch.where(counted, grad_loss / count, 0.0)[:, None])
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits, targets, comm: CommCounter, ignore_index: int = -100):
    """``F.cross_entropy`` of (B, T, V) logits held V/N columns per rank: ``logits`` is this
    rank's (B, T, V/N) shard, ``targets`` (B, T) the same on every rank (mean over the targets
    not equal to ``ignore_index``). 16-bit logits are copied to fp32 first, as the model's loss
    does; fp32 and fp64 logits are overwritten (with the softmax)."""
    if logits.dim() != 3 or logits.shape[:2] != targets.shape:
        raise ValueError(f"logits must be this rank's (B, T, V/N) and targets (B, T), got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    logits = logits.flatten(0, 1)                                             # (B*T, V/N)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()           # the softmax in fp32 whatever the matmuls' dtype
    return VocabParallelCrossEntropy.apply(logits, targets.flatten(), comm, ignore_index)


class VocabParallelTransformer(Transformer):
    """A ``Transformer`` with a vocabulary-parallel LM head: its own forward gives this rank's
    (B, T, V/N) logits and the loss is ``vocab_parallel_cross_entropy``'s. ``parallelize``
    turns a model into one by swapping its class (as FSDP2's ``fully_shard`` does)."""

    def forward(self, tokens, targets=None, **packing):
        if self.loss_chunk:
            raise ValueError("the chunked loss (loss_chunk) multiplies by the whole LM head; "
                             "with a vocabulary-parallel head set model.loss_chunk = None")
        logits = super().forward(tokens, None, **packing)                     # (B, T, V/N)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, self.tp_comm)


# ---- a whole block, a whole model -------------------------------------------------------------
def parallelize_block(block: Block, comm: CommCounter, sp: bool = False) -> Block:
    """Make ``block`` this rank's tensor-parallel part, in place. Its forward is unchanged: under
    sp it takes and returns this rank's T/N tokens, and the norms and the residual additions
    act on them alone; each norm's weight gradient is then summed over the ranks."""
    block.attn = ParallelAttention(block.attn, comm, sp)
    block.mlp = ParallelSwiGLU(block.mlp, comm, sp)
    if sp:
        for norm in (block.attn_norm, block.attn_post_norm, block.mlp_norm, block.mlp_post_norm):
            if isinstance(norm, RMSNorm):          # Identity where a placement has no norm
                sum_grad_over_ranks(norm.weight, comm)
    return block


def parallelize(model: Transformer, ctx, sp: bool = False) -> CommCounter:
    """Turn ``model`` (the same weights on every rank) into rank ``ctx.rank``'s tensor-parallel
    part, in place; returns the ``CommCounter`` that counts what its messages send.

    Every rank must be given the same tokens. The embedding's and the LM head's rows are split
    (``model(tokens)`` then returns this rank's (B, T, V/N) logits, ``model(tokens, targets)``
    the vocabulary-parallel loss); under sp the embedding leaves each rank its T/N tokens, which
    the final norm normalises before the head all-gathers them. On one rank the head and the
    loss stay the model's own (``F.cross_entropy``), as ``labkit.estimate`` counts them at tp=1.
    """
    if type(model) is not Transformer:
        raise ValueError(f"parallelize splits a labkit.transformer.model.Transformer "
                         f"(build_model), got {type(model).__name__}")
    check_tp(model.cfg, ctx.world_size)
    comm = CommCounter(ctx.group, world=ctx.world_size, rank=ctx.rank)
    model.embed = VocabParallelEmbedding(model.embed, comm, sp)
    for block in model.blocks:
        parallelize_block(block, comm, sp)
    if sp:                                  # the final norm, like the blocks', on T/N tokens
        sum_grad_over_ranks(model.norm.weight, comm)
    if ctx.world_size > 1:    # one rank keeps the model's own head and loss, as one process does
        model.lm_head = VocabParallelHead(model.lm_head, comm, sp)
        model.__class__, model.tp_comm = VocabParallelTransformer, comm
    return comm


# ---- one rank's training steps ----------------------------------------------------------------
@dataclass
class TensorParallelStep(RankStep):
    """A ``RankStep`` and the seconds of each untracked step after the measured ones."""

    seconds: list = field(default_factory=list)


def tensor_parallel_step(ctx, cfg: ModelConfig | str = "small", batch: int = 1, seq: int = 256,
                         sp: bool = False, precision: str = "fp32", steps: int = 3,
                         timed: int = 0, lora_rank: int = 0) -> TensorParallelStep:
    """Train ``cfg`` (a preset's name or a config) split over the ranks, AdamW; the tracker
    measures the last of ``steps`` (and the bytes it sent), then ``timed`` more steps run
    untracked, timed. One thread per rank: each rank stands for one device. ``lora_rank`` > 0:
    rank-r LoRA adapters train on the frozen model, split with it."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    model = build_model(cfg, dtype=param_dtype(precision), device=ctx.device)
    if lora_rank:
        apply_lora(model, lora_rank)
    comm = parallelize(model, ctx, sp)
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], "adamw",
                               impl="for-loop", master_weights=precision == "bf16-master")

    def forward(tokens, targets):
        comm.reset()                    # then ``comm.sent`` holds the last step's bytes
        return model(tokens, targets)

    # a tensor-parallel group splits the model, not the batch: every rank takes the same rows
    one_group = dataclasses.replace(ctx, rank=0, world_size=1)
    rows = rank_tokens(one_group, model.cfg.vocab_size, batch, seq, steps + timed)
    step = measure_rank(ctx, model, forward, optimizer, rows[:steps], precision,
                        sent=lambda: comm.sent)
    seconds = []
    for tokens in rows[steps:]:
        start = time.perf_counter()
        train_step(forward, optimizer, tokens[:, :-1], tokens[:, 1:], precision)
        seconds.append(time.perf_counter() - start)
    return TensorParallelStep(**vars(step), seconds=seconds)
