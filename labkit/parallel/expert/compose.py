"""A composed layout: expert parallelism inside data parallelism, as DeepSeek-V3 trains
(DeepSeek-AI, 2024: 64-way expert parallelism inside its data-parallel ranks).

``world = ep x dp`` ranks, each training on its own rows (``labkit.Layout(dp=world, ep=ep)``:
there dp counts every data-parallel rank, Megatron-LM's convention; here dp is world / ep, the
copies of each expert shard, Megatron's expert-data-parallel size). Rank r holds expert shard
r % ep (the
routed experts [s * E/ep, (s + 1) * E/ep)) and belongs to three groups:

    ep group r // ep   ranks [g * ep, (g + 1) * ep)   the all_to_alls: one copy of every expert
    dp group r % ep    ranks {s, s + ep, s + 2 ep ...} the dp copies of shard s: its gradients
    the world          every rank                      the replicated weights' gradients

    ep 2 x dp 2:  ep groups {0, 1} {2, 3};  dp groups {0, 2} {1, 3};  world {0, 1, 2, 3}

An expert's gradient on a rank sums the rows of its ep group (the all_to_alls' backward); the
all-reduce over its dp group adds the other ep groups' rows, and dividing by the world gives the
gradient of the mean loss over every row. ``labkit.parallel.expert.expert_parallel`` runs the layer
and the step; this module holds the groups and the byte rules ``labkit.estimate`` uses, so it loads
no model, tracker or training step.

The rules assume balanced routing: each rank's experts receive the batch * seq * top_k rows a
rank dispatches per MoE layer. A skewed router moves rows, bytes and activations to the busiest
rank (``labkit.parallel.expert.expert_parallel.routing_imbalance`` measures it).
"""
from __future__ import annotations

import math

from labkit.core.config import ModelConfig
from labkit.core.recipe import state_bytes
from labkit.predict.layers import block_weights, embedding_weights, head_weights, mlp_weights


def dp_degree(world: int, ep: int) -> int:
    """world / ep, the copies of each expert shard, or ValueError naming the fix."""
    if not isinstance(ep, int) or ep < 1 or world % ep:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"ep={ep!r} must divide the {world} ranks (world = ep x dp); choose ep "
                         f"among {divisors}")
    return world // ep


def experts_per_rank(cfg: ModelConfig, ep: int) -> int:
    """routed_experts / ep, or ValueError naming the fix when ep does not divide them."""
    if not cfg.is_moe:
        raise ValueError(f"{cfg.name} has no routed experts: expert parallelism needs an MoE "
                         f"model (tiny-moe, deepseek-v2-lite, deepseek-v3)")
    if not isinstance(ep, int) or ep < 1 or cfg.routed_experts % ep:
        divisors = [d for d in range(1, cfg.routed_experts + 1) if cfg.routed_experts % d == 0]
        raise ValueError(f"ep={ep!r} must divide routed_experts={cfg.routed_experts}; choose ep "
                         f"among {divisors}")
    return cfg.routed_experts // ep


def group_ranks(world: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the ep groups, the dp groups): ep group g is ranks [g * ep, (g + 1) * ep), the dp group
    of shard s is ranks {s, s + ep, ...}."""
    dp = dp_degree(world, ep)
    return ([list(range(g * ep, (g + 1) * ep)) for g in range(dp)],
            [list(range(s, world, ep)) for s in range(ep)])


def new_groups(ctx, ep: int) -> tuple:
    """(this rank's ep group, its dp group) as process groups: the ep group is ``ctx.group``
    when dp = 1; either is None where there is nothing to send (ep = 1: every rank holds every
    expert, dp = 1: one copy of each). Every rank calls ``dist.new_group`` for every group, in
    the same order (torch.distributed asks it), when ep and dp are both > 1."""
    import torch.distributed as dist

    dp = dp_degree(ctx.world_size, ep)
    if dp == 1 or ep == 1:        # one group of every rank, or nothing to shard
        return (ctx.group if dp == 1 else None), None
    ep_groups, dp_groups = group_ranks(ctx.world_size, ep)
    made = [dist.new_group(ranks) for ranks in ep_groups + dp_groups]
    return made[ctx.rank // ep], made[dp + ctx.rank % ep]


# ---- byte rules (labkit.estimate) ---------------------------------------------------------------
def rank_params(cfg: ModelConfig, ep: int) -> tuple[int, int]:
    """(routed-expert parameters, all the others) on one of ``ep`` ranks (predict.layers)."""
    experts_per_rank(cfg, ep)
    routed = cfg.moe_layers * sum(w.local(ep=ep) for w in mlp_weights(cfg, True) if w.copies > 1)
    blocks = [w for i in range(cfg.layers) for w in block_weights(cfg, i >= cfg.dense_layers)]
    everything = sum(w.local(ep=ep) for w in embedding_weights(cfg) + head_weights(cfg) + blocks)
    return routed, everything - routed


def routed_rows(cfg: ModelConfig, batch: int, seq: int) -> int:
    """(token, expert) rows a rank dispatches per MoE layer, and under balanced routing the rows
    its experts receive: batch * seq * top_k."""
    return batch * seq * cfg.top_k


def capacity_drops(rows_per_expert: list[int], capacity_factor: float) -> int:
    """Rows a capacity factor drops in one MoE layer with one buffer per expert over the whole
    group: each expert takes at most ceil(factor x rows / experts), the rest of its rows are
    dropped (their tokens skip the expert; with top-k > 1 their other experts still count).
    GShard, Switch Transformer and DeepSpeed apply the buffer per group of tokens (per rank),
    which drops at least as many. labkit's MoE, like DeepSeek-V3, drops none."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (1.0: each expert takes its balanced "
                         f"share; 1.25-2.0 are common), got {capacity_factor!r}")
    capacity = math.ceil(capacity_factor * sum(rows_per_expert) / len(rows_per_expert))
    return sum(max(0, n - capacity) for n in rows_per_expert)


def permutation_bytes(rows: int) -> int:
    """What an expert shard keeps per MoE layer to regroup the rows it received by expert and
    back: two int64 permutations of them (argsort and its inverse), 16 B a row."""
    return 2 * 8 * rows


def all_to_all_bytes(cfg: ModelConfig, batch: int, seq: int, ep: int, row_bytes: int,
                     back_bytes: int | None = None, moe_layers: int | None = None,
                     etp: int = 1) -> dict[str, int]:
    """Bytes one rank sends per step in its ep group's all_to_alls, by message, under balanced
    routing: (ep - 1) / ep of its rows leave in the dispatch (``row_bytes``: one number of a
    row) and come back in the combine (``back_bytes``, the experts' outputs; None: the same),
    each again in the backward pass, the other way. The counts: E/ep int64 to each other rank
    per MoE layer (``moe_layers``; None: the model's), in the forward pass only. With ``etp``
    > 1 (``expert_tensor``) the rows received are also gathered over the etp group and the
    partial outputs reduce-scattered: each rank's rows to each of the etp - 1 others. labkit
    gathers the rows as they were dispatched (``row_bytes``: fp32 under autocast); Megatron-LM
    gathers the bf16 rows, half that."""
    layers = cfg.moe_layers if moe_layers is None else moe_layers
    back_bytes = row_bytes if back_bytes is None else back_bytes
    rows = layers * routed_rows(cfg, batch, seq) * (ep - 1) // ep
    out_bytes = rows * cfg.hidden * row_bytes
    back = rows * cfg.hidden * back_bytes
    counts = layers * (ep - 1) * (cfg.routed_experts // ep) * 8 if ep > 1 else 0
    out = {"dispatch": out_bytes, "combine": back, "dispatch (backward)": out_bytes,
           "combine (backward)": back, "counts": counts}
    if etp > 1:
        held = (etp - 1) * layers * routed_rows(cfg, batch, seq) * cfg.hidden
        out |= {"counts (etp)": layers * (etp - 1) * cfg.routed_experts * 8,
                "gather (etp)": held * row_bytes, "gather (etp, backward)": held * row_bytes,
                "reduce-scatter (etp)": held * back_bytes,
                "reduce-scatter (etp, backward)": held * back_bytes}
    return out


def gradient_bytes_sent(replicated: int, experts: int, ep: int, dp: int) -> dict[str, int]:
    """Bytes one rank sends averaging its gradients over a ring (2 (N - 1) / N of a buffer):
    the ``replicated`` gradient bytes over all ep x dp ranks, its ``experts``' over the dp
    copies of its shard (``dp`` here is world / ep: ``labkit.Layout``'s dp / ep)."""
    world = ep * dp
    out = {"all_reduce": 2 * (world - 1) * replicated // world}
    if dp > 1:
        out["all_reduce (experts, dp group)"] = 2 * (dp - 1) * experts // dp
    return out


def shard_kept_bytes(cfg: ModelConfig, rows: int, tokens: int, precision: str = "fp32") -> int:
    """Bytes an ``ExpertShard`` keeps from its forward pass, with its output: for each of the
    ``rows`` routed to its experts, the regrouped input (h) and gate, up, silu(gate) and their
    product (4 moe_ffn) in the weights' dtype, and two int64 permutation indices; plus the
    combined output, (tokens * top_k, h). Not under autocast, which keeps copies of its own."""
    if precision not in ("fp32", "bf16", "bf16-master"):
        raise ValueError(f"the rule covers fp32, bf16 and bf16-master, got {precision!r}; "
                         f"autocast (-mixed) keeps bf16 copies of the inputs it does not count")
    b = state_bytes(precision, "adamw").weights
    return (rows * (cfg.hidden + 4 * cfg.moe_ffn) * b + permutation_bytes(rows)
            + tokens * cfg.top_k * cfg.hidden * b)
