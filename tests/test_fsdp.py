"""PyTorch's ZeRO (ZeroRedundancyOptimizer, FSDP2) beside labkit's on a gloo cluster, and FSDP2
at full scale on a fake process group (labkit.parallel.data.fsdp)."""
import math

import pytest
import torch
import torch.distributed as dist

import labkit as lk
from labkit.course.plot import scaling_figure
from labkit.parallel import cluster
from labkit.parallel.cluster import RankContext
from labkit.parallel.data import fsdp

# Same model, rows and AdamW; at N = 2 every sum has two terms, so the order cannot differ:
# the losses agree to fp32 round-off (they come out bit-equal; the tolerance allows 1 ulp-ish).
TOL = dict(rtol=1e-6, atol=0)
N_TENSORS = 21                       # parameters of "tiny": one AdamW step counter (fp32) each


def tiny_params():
    return list(lk.build_model(lk.preset("tiny")).parameters())


def losses(results, name):
    return torch.tensor([r[name].losses for r in results])               # (ranks, steps)


@pytest.fixture(scope="module")
def two_ranks():
    """Every wrapper on the same 2-rank cluster (one start): [{name: ShardStep}] per rank."""
    return cluster.run(fsdp.side_by_side, 2, timeout_s=180)


# ---- the same training -------------------------------------------------------------------
def test_zero_redundancy_optimizer_trains_as_labkit_zero1(two_ranks):
    torch.testing.assert_close(losses(two_ranks, "ZeroRedundancyOptimizer"),
                               losses(two_ranks, "labkit ZeRO-1"), **TOL)


def test_fsdp2_trains_as_labkit_zero3(two_ranks):
    torch.testing.assert_close(losses(two_ranks, "FSDP2"), losses(two_ranks, "labkit ZeRO-3"),
                               **TOL)


def test_labkits_fsdp_for_any_module_trains_exactly_as_fsdp2(two_ranks):
    """The same chunks gathered and reduce-scattered in the same sums: equal, not only close."""
    assert torch.equal(losses(two_ranks, "labkit FSDP"), losses(two_ranks, "FSDP2"))
    for ranks in two_ranks:
        assert ranks["labkit FSDP"].param_bytes == ranks["FSDP2"].param_bytes


def test_labkits_sharded_optimizer_trains_as_zero_redundancy_optimizer_in_equal_slices(two_ranks):
    """ZeRO-1 over torch's AdamW in flat slices: the same training, and each rank the moments
    of half the (padded) elements, where torch's greedy split of whole tensors is uneven."""
    torch.testing.assert_close(losses(two_ranks, "labkit ShardedOptimizer"),
                               losses(two_ranks, "ZeroRedundancyOptimizer"), **TOL)
    full = sum(p.numel() for p in tiny_params())
    for ranks in two_ranks:
        assert ranks["labkit ShardedOptimizer"].state_bytes == 2 * 4 * math.ceil(full / 2)


def test_ranks_see_different_rows(two_ranks):
    """The comparison above would hold trivially if both ranks trained on the same rows."""
    first, second = losses(two_ranks, "FSDP2")
    assert not torch.equal(first, second)


# ---- what each rank holds ----------------------------------------------------------------
def test_fsdp2_rank_holds_its_dim0_chunk_of_each_parameter(two_ranks):
    """FSDP2 pads dim 0 to a multiple of N: each rank stores ceil(rows / N) rows of each."""
    shard = sum(math.ceil(p.shape[0] / 2) * p[0].numel() * 4 for p in tiny_params())
    for ranks in two_ranks:
        assert ranks["FSDP2"].param_bytes == shard
        assert ranks["FSDP2"].state_bytes == 2 * shard              # exp_avg, exp_avg_sq


def test_zero_redundancy_optimizer_splits_whole_parameters(two_ranks):
    """Stage 1 keeps every parameter on every rank; the moments of each parameter live on one
    rank, chosen greedily by size, so the ranks' shares differ (Ψ/N is never exact)."""
    full = sum(p.nbytes for p in tiny_params())
    steps = [ranks["ZeroRedundancyOptimizer"] for ranks in two_ranks]
    assert all(s.param_bytes == full for s in steps)
    assert sum(s.state_bytes for s in steps) == 2 * full
    assert steps[0].state_bytes != steps[1].state_bytes
    sizes = {p.numel() * 8 for p in tiny_params()}                  # one parameter's moments
    assert abs(steps[0].state_bytes - steps[1].state_bytes) <= max(sizes)


def test_zero_redundancy_optimizer_under_ddp_holds_the_buckets_more(two_ranks):
    """Under torch's DDP (its normal use) the same training, and each rank holds DDP's buckets,
    a copy of the gradients (G), beside the ``.grad`` the bare setup holds: G more as the
    optimizer steps, so at least G more at the peak.

    Not "exactly G more at the peak": the tracker counts a free when gloo's worker thread lets
    go of a storage, at its own time. On a loaded machine (3 busy processes beside the 2
    ranks) 1 rank in 24 peaked in the backward instead, 599,812 B (1.20 G) above the bare
    peak; CI met the same (the flaky assertion this replaces)."""
    torch.testing.assert_close(losses(two_ranks, "ZeroRedundancyOptimizer under DDP"),
                               losses(two_ranks, "ZeroRedundancyOptimizer"), **TOL)
    grads = sum(p.nbytes for p in tiny_params())
    for ranks in two_ranks:
        bare, ddp = ranks["ZeroRedundancyOptimizer"], ranks["ZeroRedundancyOptimizer under DDP"]
        assert bare.grads_at_step == grads
        assert ddp.grads_at_step == bare.grads_at_step + grads
        assert ddp.peak >= bare.peak + grads


def test_tracker_counts_fsdp2_local_shards(two_ranks):
    """The tracker sees a DTensor's local shard, not its global size: AdamW's state at the peak
    is this rank's moments and step counters; the parameters are the shards plus at most the
    root's gathered weights (embedding, norm, head) and one gathered block."""
    model = lk.build_model(lk.preset("tiny"))
    root = sum(p.nbytes for name, p in model.named_parameters() if not name.startswith("blocks"))
    block = max(sum(p.nbytes for p in b.parameters()) for b in model.blocks)
    for ranks in two_ranks:
        step = ranks["FSDP2"]
        assert step.peak_by_category["optimizer"] == step.state_bytes + 4 * N_TENSORS
        assert step.param_bytes <= step.peak_by_category["params"]
        assert step.peak_by_category["params"] <= step.param_bytes + root + block


@pytest.mark.slow
def test_four_ranks_train_alike():
    """N = 4: gloo sums four gradients in its own order, labkit's reduce-scatter in another:
    the losses agree to fp32 round-off amplified by AdamW over 3 steps."""
    results = cluster.run(fsdp.side_by_side, 4, timeout_s=300)
    for a, b in (("ZeroRedundancyOptimizer", "labkit ZeRO-1"), ("FSDP2", "labkit ZeRO-3")):
        torch.testing.assert_close(losses(results, a), losses(results, b), rtol=1e-5, atol=0)


# ---- full scale on a fake process group --------------------------------------------------
def test_fake_fsdp2_shards_shrink_as_one_over_n():
    small, large = (fsdp.fake_fsdp2_peak("tiny", n, seq=64) for n in (2, 4))
    assert not dist.is_initialized()                   # the fake group did not leak
    bf16_shard = sum(math.ceil(p.shape[0] / 2) * p[0].numel() * 2 for p in tiny_params())
    assert small["param_bytes"] == bf16_shard
    assert large["param_bytes"] * 2 == small["param_bytes"]
    # fp32 master + two moments per shard element, and one step counter per tensor
    for out, n in ((small, 2), (large, 4)):
        assert out["by_category"]["optimizer"] == 12 * 125248 // n + 4 * N_TENSORS


def test_fake_fsdp2_even_placement_spreads_experts():
    """tiny-moe has 8 experts: over 32 ranks FSDP2's dim-0 split gives rank 0 a whole expert of
    each stacked weight (1/8, not 1/32); the even placement splits another dimension of the
    tensors with fewer rows than ranks (experts, router)."""
    dim0, even = (fsdp.fake_fsdp2_peak("tiny-moe", 32, seq=64, placement=p)
                  for p in ("dim0", "even"))
    few_rows = [p for p in lk.build_model(lk.preset("tiny-moe")).parameters()
                if p.shape[0] < 32]                         # the experts and the router
    extra = sum(p[0].numel() - p.numel() // 32 for p in few_rows) * 2      # bf16 bytes
    assert dim0["param_bytes"] - even["param_bytes"] == extra


def test_fake_llama_7b_matches_fsdp_mem_tracker():
    """LLaMA-2-7B's shapes (4 of its 32 identical layers) over 8 ranks: the tracker's peak is
    torch's FSDPMemTracker's plus the fp32 master shards (labkit's MasterWeights holds them
    outside the module and the optimizer state, where FSDPMemTracker does not look)."""
    cfg = lk.preset("llama-2-7b", layers=4)
    out = fsdp.fake_fsdp2_peak(cfg, 8, seq=4096, cross_check=True)
    n_params = lk.count_params(cfg).total
    masters = 4 * n_params // 8
    theirs = out["fsdp_mem_tracker"]
    assert out["peak"] == theirs["Total"] + masters
    assert out["param_bytes"] == theirs["Sharded Param"] == 2 * n_params // 8
    assert out["by_category"]["params"] == theirs["Sharded Param"] + theirs["Unsharded Param"]


def test_fake_fsdp2_autocast_cache_holds_whole_bf16_copies():
    """FSDP2 gathers fp32 leaves: under autocast with full recompute the cache holds every
    matmul weight's whole bf16 copy at the end of the forward pass, not 1/N of it (12 of
    LLaMA-2-7B's blocks are enough for the peak to fall there, as for lab 02's 32);
    cache_enabled=False drops it; FSDP2's bf16 policy gathers bf16, so nothing is cast."""
    cfg = lk.preset("llama-2-7b", layers=12)
    on = fsdp.fake_fsdp2_peak(cfg, 8, seq=4096, precision="bf16-mixed", recompute="full")
    pc = lk.count_params(cfg)
    matmul = pc.total - pc.by_component["norms"] - pc.by_component["embedding"]
    assert on["by_category"]["weight_cache"] == 2 * matmul and on["peak_phase"] == "forward"
    assert on["param_bytes"] == 4 * pc.total // 8                       # fp32 shards
    # the estimate less the last block's fp32 all-gather output, which FSDP2 frees only after
    # the root's forward (where the loss is), and a few hundred bytes of small tensors
    estimated = lk.estimate(cfg, 1, 4096, layout=lk.Layout(dp=8, zero_stage=3),
                            recipe=lk.Recipe("bf16-mixed", recompute="full")).total
    block = (pc.total - pc.by_component["embedding"] - pc.by_component["lm head"]) // cfg.layers
    assert abs(on["peak"] - estimated - 4 * block) < 1024
    few = lk.preset("llama-2-7b", layers=2)
    off, policy = (fsdp.fake_fsdp2_peak(few, 8, seq=256, precision="bf16-mixed",
                                        recompute="full", **options)
                   for options in ({"autocast_cache": False}, {"param_dtype": "bf16"}))
    assert policy["by_category"]["weight_cache"] == 0 and policy["peak"] < off["peak"]
    assert off["param_bytes"] == policy["param_bytes"] == 4 * lk.count_params(few).total // 8


def test_fake_scaling_rows_and_figure():
    rows = fsdp.fake_fsdp2_scaling("tiny", worlds=(2, 4), seq=64)
    assert [r["world_size"] for r in rows] == [2, 4]
    for r in rows:
        assert r["estimate"] == lk.estimate("tiny", 1, 64, precision="bf16-master",
                                            zero_stage=3, dp=r["world_size"]).total
    assert rows[1]["peak"] < rows[0]["peak"]
    fig = scaling_figure({"tiny": rows})
    measured, estimated = fig.axes[0].lines[:2]
    assert list(measured.get_xdata()) == [2, 4]
    assert estimated.get_ydata()[1] < estimated.get_ydata()[0]


# ---- bad input ---------------------------------------------------------------------------
def test_fake_group_refuses_a_second_group():
    with fsdp.fake_group(2):
        with pytest.raises(ValueError, match="already has a default process group"):
            fsdp.fake_fsdp2_peak("tiny", 2, seq=64)
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, match", [
    (dict(precision="fp16-mixed"), "unknown precision"),
    (dict(placement="dim1"), "unknown placement"),
    (dict(seq=4096), "max_seq"),
    (dict(rank=2), "rank"),
])
def test_fake_fsdp2_peak_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fsdp.fake_fsdp2_peak("tiny", 2, **{"seq": 64, **kwargs})


@pytest.mark.parametrize("nodes", [0, 3])
def test_nodes_that_do_not_divide_the_ranks_are_named(nodes):
    """Checked before any process group is made (so no cluster is needed to see it)."""
    ctx = RankContext(0, 4, None, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"nodes={nodes} must divide the 4 ranks"):
        fsdp.node_groups(ctx, nodes)


def _policy(name: str, world: int, seq: int, recompute: str = "none", placement: str = "dim0"):
    """(FSDP2's peak under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on fake
    tensors, the estimate of Layout(zero_stage=3, param_dtype="bf16")): 4 of the model's
    layers, 1 sequence."""
    cfg = lk.preset(name, layers=4)
    own = fsdp.fake_fsdp2_peak(cfg, world, seq=seq, recompute=recompute, placement=placement,
                               precision="fp32", param_dtype="bf16")
    est = lk.estimate(cfg, 1, seq, precision="bf16-master", recompute=recompute, device="cuda",
                      layout=lk.Layout(dp=world, zero_stage=3, param_dtype="bf16"))
    return own, est


@pytest.mark.parametrize("name, world, seq, placement, moment", [
    ("llama-2-7b", 8, 4096, "dim0", "backward: start"),
    ("qwen3-8b", 8, 4096, "dim0", "backward: start"),
    ("deepseek-v2-lite", 8, 4096, "even", "backward: start"),
    ("qwen3-8b", 64, 1024, "dim0", "backward: reduce-scatter of the embedding"),
    ("gemma-3-1b", 8, 256, "dim0", "backward: embedding")])
def test_the_policys_estimate_is_fsdp2s_peak_at_these_moments(name, world, seq, placement, moment):
    """fp32 shards as the masters, bf16 gathers, the next block prefetched, a step counter per
    parameter; at the end of the backward the root's bf16 gradients and their fp32 copy (the
    reduce-scatter's input); a tied weight's head share held once (Gemma 3, whose peak is in
    the embedding's backward). Every category to the byte at the start of the backward pass and
    at the root's reduce-scatter, the peak but for the 4 bytes the estimate misses without
    FSDP2 too (test_compose); Gemma's a bound within 0.1% (to N 64; past it FSDP2 pads its
    256-row tensors, which "assumes" says)."""
    own, est = _policy(name, world, seq, placement=placement)
    assert est.details["peak moment"].startswith(moment)
    assert own["peak_phase"] == est.peak_phase
    if name == "gemma-3-1b":
        assert 0 <= est.total - own["peak"] <= 1e-3 * est.total          # measured 0.02%
        return
    assert own["peak"] - est.total == 4
    assert {k: getattr(est, k) for k in ("params", "grads", "optimizer", "activations")} == \
        {k: own["by_category"][k] for k in ("params", "grads", "optimizer", "activations")}


def test_at_the_start_of_the_backward_the_policy_holds_2_bytes_per_parameter_less():
    own, est = _policy("llama-2-7b", 8, 4096)
    cfg = lk.preset("llama-2-7b", layers=4)
    labkit = lk.estimate(cfg, 1, 4096, precision="bf16-master", device="cuda",
                         layout=lk.Layout(dp=8, zero_stage=3))
    assert labkit.params + labkit.optimizer - est.params - est.optimizer == pytest.approx(
        2 * lk.count_params(cfg).total / 8, rel=1e-3)


@pytest.mark.parametrize("name, world, seq, recompute, placement", [
    ("llama-2-7b", 64, 512, "none", "dim0"), ("deepseek-v2-lite", 64, 1024, "none", "even"),
    ("llama-2-7b", 8, 4096, "full", "dim0"), ("llama-2-7b", 64, 1024, "full", "dim0")])
def test_inside_a_blocks_backward_the_policys_estimate_is_a_bound_within_7_percent(
        name, world, seq, recompute, placement):
    """Short sequences or recompute put the peak inside a block's backward, where the estimate
    counts the block's bf16 gradients as one bucket that FSDP2 makes one gradient at a time:
    never below FSDP2's peak, at most 7% above (measured 0.935-0.981 on these 4-layer models,
    0.94-1.00 on whole LLaMA-2-7B, Qwen3-8B, DeepSeek-V2-Lite), and "assumes" says so."""
    own, est = _policy(name, world, seq, recompute, placement)
    assert 0.93 <= own["peak"] / est.total <= 1
    assert any("MixedPrecisionPolicy" in line for line in est.details["assumes"])


@pytest.mark.parametrize("layout, recipe, match", [
    (dict(dp=8, zero_stage=3, param_dtype="fp16"), {}, "\"bf16\""),
    (dict(dp=8, zero_stage=2, param_dtype="bf16"), {}, "set zero_stage=3"),
    (dict(dp=8, zero_stage=3, param_dtype="bf16", offload=True), {}, "offload=False"),
    (dict(dp=8, zero_stage=3, param_dtype="bf16", pp=2), {}, "use pp=1"),
    (dict(dp=8, zero_stage=3, param_dtype="bf16", replicas=2, micro_batches=2), {},
     "use micro_batches=1 or replicas=1"),
    (dict(dp=8, zero_stage=3, param_dtype="bf16"), dict(precision="bf16-master", recompute="sqrt"),
     "use 'full', 'selective' or 'every-k'"),
    (dict(dp=8, zero_stage=3, param_dtype="bf16"), dict(precision="bf16-mixed"),
     "precision='bf16-master'"),
    (dict(dp=8, zero_stage=3, param_dtype="bf16"), dict(precision="bf16-master",
                                                        trainable="lora"), "trainable='all'"),
])
def test_a_policy_the_estimate_does_not_model_names_the_fix(layout, recipe, match):
    with pytest.raises(ValueError, match=match):
        lk.estimate("llama-2-7b", 1, 4096, layout=lk.Layout(**layout), **recipe)
