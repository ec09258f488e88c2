"""Expert parallelism for labkit's MoE block: each of ``ep`` ranks holds routed_experts / ep of
the routed experts, and every (token, expert) pair travels to the rank holding its expert and
back. GShard (Lepikhin et al., 2020), Switch Transformer (Fedus et al., 2021); DeepSeek-V3
(DeepSeek-AI, 2024) trains with 64-way expert parallelism over 8 nodes.

Each rank trains the whole model on its own rows (data parallel, as expert parallelism usually
runs); the router, the shared experts and every other weight are replicated. ``MoE.forward``
(labkit.transformer.model) is unchanged: it routes, sorts its N*k (token, expert) rows by expert and
hands them to ``moe.experts``, which ``expert_parallel`` replaces by an ``ExpertShard``:

    x_sorted (N*k, h), sorted by expert, so by the rank that holds it
      --all_to_all of the counts-->   (ep, E/ep): the rows each rank will send me, per expert
      --all_to_all of the rows-->     (M, h): every rank's rows for my experts (dispatch)
      --regroup by expert, grouped matmuls of my experts-->  (M, h)
      --all_to_all back-->            (N*k, h), in the order they left (combine)

and ``MoE.forward`` then weights each row by its gate and sums the rows of each token, as one
process does. The backward pass runs the two all_to_alls in reverse (``AllToAll``).

Memory on a rank: parameters are the replicated weights plus 1/ep of the routed experts
(``labkit.predict.layers.Weight.local(ep=...)``). Activations depend on M, the rows routed to the
rank's experts: N*k on average when routing is balanced, up to ep*N*k when every token picks
this rank's experts (``routing_imbalance`` measures it); the shard also keeps two int64
permutations of its M rows. ``labkit.estimate(..., layout=Layout(dp=..., ep=...))`` gives a rank
under balanced routing.

Gradients: an expert's gradient on its rank already sums the rows of every rank in its ep
group; with each rank's loss the mean over its own rows, it is divided by ep to give the
gradient of the mean over all rows. The replicated weights are all-reduced and divided by ep,
as DDP does (``average_gradients``), but in place after the backward pass: no flat buckets
beside them. With more data-parallel ranks than ep (``ep_dp_step``: world = ep x dp,
DeepSeek-V3's layout, its groups in ``labkit.parallel.expert.compose``) each expert's gradient is
also all-reduced over the dp copies of its shard, and every gradient is divided by the world.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from labkit.core.config import ModelConfig, preset
from labkit.core.recipe import Layout, state_bytes
from labkit.core.units import check_positive
from labkit.parallel.cluster import RankContext, run
from labkit.parallel.comm import AllToAll, CommCounter
from labkit.parallel.data.zero_step import ZeroOptimizer
from labkit.parallel.expert.compose import (capacity_drops, dp_degree,  # noqa: F401
                                            experts_per_rank, new_groups, permutation_bytes,
                                            rank_params, shard_kept_bytes)
from labkit.parallel.steps import RankStep, measure_rank, rank_tokens
from labkit.quantisation.lora import apply_lora
from labkit.training.step import make_optimizer, param_dtype, train_step
from labkit.training.track import MemoryTracker, activations_per_module
from labkit.transformer.model import MoE, RoutedExperts, build_model


# ---- the messages ------------------------------------------------------------------------------
class ExpertComm(CommCounter):
    """The group, the bytes this rank sent since ``reset`` by message (rows that stay on this
    rank are not counted), and the rows each MoE layer's experts received (``received``)."""

    def __init__(self, group, world: int, rank: int):
        super().__init__(group, world, rank)
        self.received: list[int] = []
        self.expert_rows: list[list[int]] = []    # per MoE layer, rows of each of my experts

    def reset(self):
        super().reset()
        self.received = []
        self.expert_rows = []


# ---- the layer ---------------------------------------------------------------------------------
class ExpertShard(nn.Module):
    """Stands in for ``MoE.experts`` on one rank: holds experts [first, first + E/ep) in
    ``local`` (a ``RoutedExperts``), and sends every row to the rank holding its expert."""

    def __init__(self, experts: RoutedExperts, comm: ExpertComm):
        super().__init__()
        E, f, h = experts.w_gate.shape
        self.ep, self.rank, self.comm = comm.world, comm.rank, comm
        self.per_rank = E // self.ep
        first = self.rank * self.per_rank
        with torch.device("meta"):                 # shapes only: the weights are copied in below
            self.local = RoutedExperts(self.per_rank, h, f)
        for name in ("w_gate", "w_up", "w_down"):  # (E/ep, out, in) slices of (E, out, in)
            whole = getattr(experts, name).detach()
            setattr(self.local, name, nn.Parameter(whole[first:first + self.per_rank].clone()))

    def incoming(self, counts: list[int], x) -> list[list[int]]:
        """(ep, E/ep) rows each rank sends to each of my experts, from my ``counts`` (E,)."""
        L, mine = self.per_rank, slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        if isinstance(x, FakeTensor):              # no data: every rank routes as evenly as I do
            return [counts[mine]] * self.ep
        outgoing = torch.tensor(counts, device=x.device)                      # (E,)
        incoming = self.comm.all_to_all(outgoing, [L] * self.ep, [L] * self.ep, "counts")
        return incoming.view(self.ep, L).tolist()

    def forward(self, x_sorted, counts: list[int]):
        """x_sorted (N*k, h): rows sorted by expert, counts[e] of them for expert e (all E)."""
        L = self.per_rank
        incoming = self.incoming(counts, x_sorted)                            # (ep, L) ints
        send = [sum(counts[r * L:(r + 1) * L]) for r in range(self.ep)]       # rows to rank r
        recv = [sum(row) for row in incoming]                                 # rows from rank r
        self.comm.received.append(sum(recv))
        x = AllToAll.apply(x_sorted, send, recv, self.comm, "dispatch")       # (M, h)
        # rows arrive by source rank, then expert; the grouped matmuls want them by expert
        flat = [n for row in incoming for n in row]                           # (ep * L,)
        expert_of_row = torch.arange(L, device=x.device).repeat(self.ep).repeat_interleave(
            torch.tensor(flat, device=x.device), output_size=sum(recv))       # (M,)
        by_expert = expert_of_row.argsort(stable=True)                        # (M,)
        per_expert = [sum(row[j] for row in incoming) for j in range(L)]      # (L,) ints
        self.comm.expert_rows.append(per_expert)
        y = self.local(x[by_expert], per_expert)                              # (M, h) by expert
        y = y[by_expert.argsort()]                                            # (M, h) by source
        return AllToAll.apply(y, recv, send, self.comm, "combine")            # (N*k, h)


@dataclass
class EPGroups:
    """This rank's groups (``labkit.parallel.expert.compose``), each counting the bytes it sends:
    ``experts`` its ep group (the all_to_alls), ``replicas`` its dp group (the other copies of
    its experts; None when dp = 1 or ep = 1), ``world`` every rank (the replicated weights, and
    at ep = 1 every expert too)."""

    experts: ExpertComm
    replicas: CommCounter | None
    world: CommCounter

    def reset(self):
        for comm in (self.experts, self.replicas, self.world):
            if comm is not None:
                comm.reset()

    def sent(self) -> dict[str, int]:
        """Bytes sent since ``reset`` by message: the all_to_alls by name, "all_reduce" (the
        replicated weights, every rank) and "all_reduce (experts, dp group)"."""
        out = dict(self.experts.sent) | {"all_reduce": self.world.sent["all_reduce"]}
        if self.replicas is not None:
            out["all_reduce (experts, dp group)"] = self.replicas.sent["all_reduce"]
        return out

    def sent_by_group(self) -> dict[str, int]:
        """Bytes sent since ``reset`` in each group: "ep", "dp" and "world"."""
        return {"ep": self.experts.total, "world": self.world.total,
                "dp": self.replicas.total if self.replicas is not None else 0}


def expert_parallel(model: nn.Module, ctx: RankContext, ep: int | None = None) -> EPGroups:
    """Turn this rank's copy of a labkit model into its expert-parallel part, in place: each MoE
    block keeps the E/ep experts of shard ctx.rank % ep of the one-process weights. ``ep``: ranks
    per ep group (None: every rank, dp = 1). Makes the groups (every rank must call it)."""
    ep = ctx.world_size if ep is None else ep
    experts_per_rank(model.cfg, ep)                             # ValueError before any message
    dp = dp_degree(ctx.world_size, ep)
    ep_group, dp_group = new_groups(ctx, ep)
    groups = EPGroups(ExpertComm(ep_group, ep, ctx.rank % ep),
                      CommCounter(dp_group, dp, ctx.rank // ep) if dp_group is not None else None,
                      CommCounter(ctx.group, ctx.world_size, ctx.rank))
    for module in model.modules():
        if ep > 1 and isinstance(module, MoE) and not isinstance(module.experts, ExpertShard):
            module.experts = ExpertShard(module.experts, groups.experts)
    return groups


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' weights this rank holds (each held by no other rank of its ep group)."""
    return [p for m in model.modules() if isinstance(m, ExpertShard) for p in m.parameters()]


def average_gradients(model: nn.Module, groups: EPGroups):
    """Gradients of the mean loss over every rank's rows, in place: the replicated weights'
    all-reduced over the world, the experts' (already summed over the ep group by the
    all_to_alls' backward) over the dp copies of the shard; then all / world."""
    experts = {id(p) for p in expert_parameters(model)}
    for p in model.parameters():
        if p.grad is None:                         # the router bias: top-k has no gradient
            continue
        if id(p) not in experts:
            groups.world.all_reduce(p.grad)
        elif groups.replicas is not None:
            groups.replicas.all_reduce(p.grad)
        p.grad.div_(groups.world.world)


class AveragingOptimizer:
    """An optimizer that first averages the gradients over the ranks (``average_gradients``),
    as DDP's all-reduce would before it."""

    def __init__(self, optimizer, model: nn.Module, groups: EPGroups):
        self.optimizer, self.model, self.groups = optimizer, model, groups

    def step(self):
        average_gradients(self.model, self.groups)
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


# ---- one rank's steps ----------------------------------------------------------------------
def seeded_model(model_name: str | ModelConfig = "tiny-moe", ep: int = 1,
                 hot: float | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device=None):
    """The seed's one-process model (a preset's name or a config). ``hot`` (a float) adds a
    router bias of ``hot`` to the selection scores of shard 0's experts (the first E/ep):
    DeepSeek-V3's balancing bias, used here to unbalance. 0.0 routes as no bias does; 1.0
    sends every token to shard 0's experts (when top_k <= E/ep)."""
    cfg = model_name if isinstance(model_name, ModelConfig) else preset(model_name)
    cfg = cfg if hot is None else cfg.replace(router_bias=True)
    per_rank = experts_per_rank(cfg, ep)
    torch.manual_seed(seed)
    model = build_model(cfg, dtype, device)
    if hot is not None:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, MoE):
                    module.router_bias[:per_rank] = hot
    return model


def build(ctx: RankContext, model_name: str = "tiny-moe", hot: float | None = None,
          seed: int = 0, dtype: torch.dtype = torch.float32, ep: int | None = None,
          hot_ep: int | None = None):
    """This rank's part of ``seeded_model`` under ``ep`` (None: every rank) x dp, and its
    ``EPGroups``. ``hot`` biases the first E / hot_ep experts (None: E / ep, one rank's)."""
    ep = ctx.world_size if ep is None else ep
    dp_degree(ctx.world_size, ep)                               # ValueError before building
    model = seeded_model(model_name, hot_ep or ep, hot, seed, dtype, ctx.device)
    return model, expert_parallel(model, ctx, ep)


def averaging_adamw(model: nn.Module, groups: EPGroups, precision: str):
    """(for-loop AdamW, the same behind ``average_gradients``): what the steps train with."""
    inner = make_optimizer([p for p in model.parameters() if p.requires_grad], "adamw",
                           impl="for-loop", master_weights=precision == "bf16-master")
    return inner, AveragingOptimizer(inner, model, groups)


@dataclass
class EPStep(RankStep):
    """A rank's ``RankStep`` and its routing in the last step: rows each MoE layer received
    (its experts' load), the rows it dispatched per layer, its parameters' bytes, the layout
    and the bytes it sent in each group ("ep", "dp", "world")."""

    received: list = field(default_factory=list)
    expert_rows: list = field(default_factory=list)     # per MoE layer, rows of each expert
    dispatched: int = 0
    expert_bytes: int = 0
    param_bytes: int = 0
    ep: int = 1
    dp: int = 1
    sent_by_group: dict = field(default_factory=dict)


def ep_optimizer(model: nn.Module, groups: EPGroups, precision: str, zero_stage: int = 0):
    """(what holds the optimizer state, what steps): for-loop AdamW behind ``average_gradients``,
    or labkit's ZeRO ``zero_stage`` with each expert shard's units sharded over its dp copies
    and the rest over every rank (Megatron's distributed optimizer, DeepSeek-V3's ZeRO-1)."""
    if not zero_stage:
        return averaging_adamw(model, groups, precision)
    replicas = groups.replicas.group if groups.replicas is not None else None
    opt = ZeroOptimizer(model, groups.world.group, zero_stage, precision,
                        experts=expert_parameters(model), expert_group=replicas)
    return opt, opt


def ep_dp_step(ctx, ep: int | None = None, model_name: str = "tiny-moe", batch: int = 1,
               seq: int = 32, steps: int = 2, precision: str = "fp32", hot: float | None = None,
               seed: int = 0, zero_stage: int = 0, lora_rank: int = 0, builder=None) -> EPStep:
    """Train under ``ep`` (None: every rank) x dp = world / ep on this rank's rows (``batch`` of
    them, for-loop AdamW; ``ep_optimizer`` for ``zero_stage``); the tracker measures the last
    (steady) step. ``hot``: see ``seeded_model``. ``lora_rank`` > 0: LoRA (rank r) on it.
    ``builder``: what makes the rank's model and groups (``build``'s arguments; None: ``build``)."""
    for name, value in (("batch", batch), ("seq", seq), ("steps", steps)):
        check_positive(name, value)
    if steps < 2:
        raise ValueError(f"steps={steps}: use steps >= 2; the first step creates the optimizer "
                         "state, the second is the first steady one")
    model, groups = (builder or build)(ctx, model_name, hot, seed, param_dtype(precision), ep)
    if lora_rank:
        apply_lora(model, lora_rank)
    states, optimizer = ep_optimizer(model, groups, precision, zero_stage)

    def forward(tokens, targets):                              # (batch, seq) each
        groups.reset()                                         # count the last step only
        return model(tokens, targets)

    def sent() -> dict[str, int]:
        return dict(groups.experts.sent) | optimizer.last_step if zero_stage else groups.sent()

    batches = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps, seed)
    step = measure_rank(ctx, model, forward, optimizer, batches, precision, states=states,
                        sent=sent)
    by_group = groups.sent_by_group() | (optimizer.last_step_by_group if zero_stage else {})
    return EPStep(**vars(step), received=list(groups.experts.received),
                  expert_rows=[list(rows) for rows in groups.experts.expert_rows],
                  dispatched=model.cfg.top_k * batch * seq,
                  expert_bytes=sum(p.nbytes for p in expert_parameters(model)),
                  param_bytes=sum(p.nbytes for p in model.parameters()),
                  ep=groups.experts.world, dp=ctx.world_size // groups.experts.world,
                  sent_by_group=by_group)


def ep_step(ctx, **settings) -> EPStep:
    """``ep_dp_step`` with one ep group of every rank (dp = 1): the ranks are the expert- and
    the data-parallel group at once."""
    return ep_dp_step(ctx, None, **settings)


def ep_steps(ctx, settings: list[dict]) -> list[EPStep]:
    """``ep_dp_step(ctx, **s)`` for each of ``settings`` in one process group (one start-up)."""
    return [ep_dp_step(ctx, **s) for s in settings]


def time_ep_steps(ctx, model_name: str = "tiny-moe", batch: int = 1, seq: int = 32,
                  steps: int = 5, precision: str = "fp32", hot: float | None = None,
                  seed: int = 0, ep: int | None = None) -> list[float]:
    """Seconds of each of ``steps`` training steps on this rank, no tracker; the ranks start
    each step together (a barrier), so the slowest rank's load shows in every rank's time."""
    model, groups = build(ctx, model_name, hot, seed, param_dtype(precision), ep)
    _, optimizer = averaging_adamw(model, groups, precision)
    seconds = []
    for tokens in rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps, seed):
        dist.barrier(group=ctx.group)
        start = time.perf_counter()
        train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], precision)
        seconds.append(time.perf_counter() - start)
    return seconds


# ---- equal to one process ----------------------------------------------------------------------
def _forward_backward(model, ctx, batch: int, seq: int, seed: int):
    """Logits (batch, seq, vocab) and loss of this rank's rows; the gradients in ``.grad``."""
    tokens = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, 1, seed)[0]   # (batch, seq + 1)
    logits = model(tokens[:, :-1])                                            # (batch, seq, V)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return logits.detach(), loss.item()


def forward_backward(ctx, model_name: str = "tiny-moe", batch: int = 1, seq: int = 32,
                     dtype: torch.dtype = torch.float64, hot: float | None = None,
                     seed: int = 0, ep: int | None = None, zero_stage: int = 0,
                     builder=None) -> dict:
    """One forward and backward under ``ep`` (None: every rank) x dp on this rank's rows:
    logits, loss, every gradient by name (averaged: ``average_gradients``, or ZeRO-1's
    reduce-scatters gathered back), the bytes sent. ``builder``: as ``ep_dp_step``'s."""
    model, groups = (builder or build)(ctx, model_name, hot, seed, dtype, ep)
    if zero_stage:                 # its hooks fill the buckets during the backward pass
        _, zero = ep_optimizer(model, groups, "fp64" if dtype == torch.float64 else "fp32",
                               zero_stage)
    logits, loss = _forward_backward(model, ctx, batch, seq, seed)
    if zero_stage:
        grads = zero.averaged_gradients()
        return dict(logits=logits, loss=loss, sent={}, grads={
            n: grads[id(p)] for n, p in model.named_parameters() if id(p) in grads})
    average_gradients(model, groups)
    return dict(logits=logits, loss=loss, sent=groups.sent(),
                grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def one_process(ranks: int, model_name: str = "tiny-moe", batch: int = 1, seq: int = 32,
                dtype: torch.dtype = torch.float64, hot: float | None = None,
                seed: int = 0, ep: int | None = None) -> dict:
    """``forward_backward``'s figures for the whole model in this process, on the rows of all
    ``ranks`` ranks (batch * ranks of them; ``hot`` biases the first E/ep experts, ep None:
    ``ranks``): what the ranks must equal."""
    ctx = RankContext(0, 1, None, torch.device("cpu"))
    model = seeded_model(model_name, ranks if ep is None else ep, hot, seed, dtype)
    logits, loss = _forward_backward(model, ctx, batch * ranks, seq, seed)
    return dict(logits=logits, loss=loss,
                grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None})


# ---- unbalanced routing ------------------------------------------------------------------------
def shard_kept(ctx, model_name: str = "tiny-moe", batch: int = 1, seq: int = 32,
               hot: float | None = None, seed: int = 0) -> list[tuple[int, int]]:
    """(rows received, bytes kept) of each MoE layer's ``ExpertShard`` in one forward pass
    (``labkit.training.track.activations_per_module``)."""
    model, groups = build(ctx, model_name, hot, seed)
    shards = {name: m for name, m in model.named_modules() if isinstance(m, ExpertShard)}
    tokens = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, 1, seed)[0]    # (batch, seq + 1)
    kept = activations_per_module(model, tokens[:, :-1], tokens[:, 1:], shards)
    return list(zip(groups.experts.received, kept.values()))


@dataclass
class Load:
    """One rank under one router: rows its experts received (all MoE layers, last step), their
    share of all rows, and its measured peak."""

    hot: float
    rank: int
    rows: int
    share: float
    peak: int
    activations: int              # activation bytes at the peak
    peak_phase: str
    expert_rows: list = field(default_factory=list)   # per MoE layer, rows of each of its experts


def loads(hots, per_rank: list[list[EPStep]]) -> list[Load]:
    """``Load`` rows from ``ep_steps`` results: per_rank[r][i] is rank r's step under hots[i]."""
    rows = []
    for i, hot in enumerate(hots):
        steps = [ranks[i] for ranks in per_rank]
        total = sum(sum(s.received) for s in steps)
        rows += [Load(float(hot), s.rank, sum(s.received), sum(s.received) / total, s.peak,
                      s.peak_by_category["activations"], s.peak_phase, s.expert_rows)
                 for s in steps]
    return rows


def dropped_share(loads_of_one_router: list[Load], capacity_factor: float) -> float:
    """The share of all (token, expert) rows a capacity factor would drop under one router:
    every rank's experts, in rank order, are the layer's experts (``compose.capacity_drops``)."""
    ranks = sorted(loads_of_one_router, key=lambda load: load.rank)
    dropped = total = 0
    for layer in zip(*(load.expert_rows for load in ranks)):
        rows = [n for experts in layer for n in experts]                    # all E experts
        dropped += capacity_drops(rows, capacity_factor)
        total += sum(rows)
    return dropped / total


def routing_imbalance(ep: int, hots=(0.0, 0.02, 0.05, 1.0), model_name: str = "tiny-moe",
                      batch: int = 1, seq: int = 64, timeout_s: float = 300) -> list[Load]:
    """Each rank's tokens and peak under a router biased towards rank 0's experts by each of
    ``hots`` (0.0: no bias; the initial router is only roughly balanced), on ``ep`` processes."""
    experts_per_rank(preset(model_name), ep)
    settings = [dict(model_name=model_name, batch=batch, seq=seq, hot=float(h)) for h in hots]
    return loads(hots, run(ep_steps, ep, settings, timeout_s=timeout_s))


# ---- full scale: per-rank parameters, and one rank on fake tensors ------------------------------
def ep_memory(cfg, eps=(8, 16, 32, 64), batch: int = 1, seq: int = 4096,
              precision: str = "bf16-master", optimizer: str = "adamw") -> list[dict]:
    """Per rank at each ep: routed-expert and replicated parameters, the experts' model-state
    bytes (weights + grads + optimizer state), and ``labkit.estimate`` with Layout(dp=ep, ep=ep)."""
    from labkit.predict import estimate

    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    per_param = state_bytes(precision, optimizer).total
    rows = []
    for ep in eps:
        routed, replicated = rank_params(cfg, ep)
        est = estimate(cfg, batch, seq, precision=precision, optimizer=optimizer,
                       device="cuda", layout=Layout(dp=ep, ep=ep))
        rows.append(dict(ep=ep, experts_per_rank=experts_per_rank(cfg, ep),
                         routed_params=routed, replicated_params=replicated,
                         routed_state_bytes=routed * per_param,
                         replicated_state_bytes=replicated * per_param,
                         estimate=est.total, estimate_params=est.params,
                         estimate_activations=est.activations, estimate_phase=est.peak_phase))
    return rows


def fake_ep_peak(cfg, ep: int, batch: int = 1, seq: int = 4096, precision: str = "bf16-master",
                 rank: int = 0) -> dict:
    """One rank of ``ep`` in one steady-state training step on fake tensors (fake process
    group, routing balanced, CUDA's defaults): peak bytes by category, parameter bytes and the
    bytes its all_to_alls sent (``sent``)."""
    from labkit.training.measure import _batch, _build, _Setup, init_optimizer_state
    from labkit.parallel.data.fsdp import fake_group

    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    experts_per_rank(cfg, ep)
    start = time.perf_counter()
    with fake_group(ep, rank) as group:
        # build on the meta device and slice there: no fake tensor for the other ranks' experts
        model = _build(_Setup(cfg, None, "cuda", torch.device("meta")), precision, "none")
        ctx = RankContext(rank, ep, group, torch.device("cpu"))
        groups = expert_parallel(model, ctx)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            inner = make_optimizer(model.parameters(), "adamw", device="cuda",
                                   master_weights=precision == "bf16-master")
            init_optimizer_state(model, inner)
            inputs, targets, step = _batch(model, batch, seq, None, torch.device("cpu"))
            # no average_gradients: its all-reduces work in place and move nothing here
            with MemoryTracker(model, inner, timeline=False) as mt:
                train_step(step, inner, inputs, targets, precision, tracker=mt)
            out = dict(ep=ep, peak=mt.peak, by_category=dict(mt.peak_by_category),
                       peak_phase=mt.peak_phase,
                       param_bytes=sum(p.nbytes for p in model.parameters()),
                       expert_bytes=sum(p.nbytes for p in expert_parameters(model)),
                       sent=dict(groups.experts.sent))
    out["seconds"] = time.perf_counter() - start
    return out
