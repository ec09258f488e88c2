"""Expert parallelism (labkit.parallel.expert.expert_parallel) on 2 and 4 local gloo ranks,
tiny-moe (8 routed experts, top 2, 2 MoE layers): each rank holds E/ep experts and exactly the
bytes labkit.predict.layers gives it, trains like one process on all the rows, and a skewed
router loads one rank."""
import pytest
import torch

import labkit as lk
from labkit.parallel import cluster
from labkit.parallel.cluster import RankContext
from labkit.parallel.expert.expert_parallel import (ep_memory, expert_parallel, experts_per_rank,
                                                    fake_ep_peak, loads, one_process, rank_params,
                                                    routing_imbalance, shard_kept_bytes)
from labkit.transformer.model import build_model

from expert_targets import CASES, HOT, HOTS, SEQ, STEP_SEQ, everything

CFG = lk.preset("tiny-moe")
BIASED = lk.preset("tiny-moe", router_bias=True)     # what ep_step builds for a given ``hot``
WORLDS = (2, 4)
ROWS = STEP_SEQ * CFG.top_k     # (token, expert) rows each rank dispatches per MoE layer
ROW_BYTES = CFG.hidden * 4      # one fp32 row of the residual stream
# fp32 round-off: sums over rows in another order and grouping (fp64 shows it is only that)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def ranks():
    """N -> [rank 0's figures, rank 1's, ...] (``expert_targets.everything``), one start-up each."""
    return {n: cluster.run(everything, n, timeout_s=240) for n in WORLDS}


def steps(ranks, n, hot) -> list:
    """Each rank's EPStep under the router bias ``hot``."""
    return [rank["steps"][HOTS.index(hot)] for rank in ranks[n]]


@pytest.fixture(scope="module")
def one():
    """(N, case) -> the whole model in this process on all N ranks' rows."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # tiny matmuls: a second thread only waits
    try:
        return {(n, name): one_process(n, seq=SEQ, dtype=dtype, hot=hot)
                for n in WORLDS for name, dtype, hot in CASES}
    finally:
        torch.set_num_threads(threads)


def _close(a, b, dtype) -> bool:
    """Largest difference within TOLERANCE[dtype] of b's largest magnitude (zeros: equal)."""
    return (a - b).abs().max().item() <= TOLERANCE[dtype] * b.abs().max().item()


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("case, dtype, hot", CASES)
def test_output_and_every_gradient_equal_one_process(ranks, one, n, case, dtype, hot):
    """Each rank's logits are the one-process logits of its rows; after averaging, each
    replicated gradient is the one-process gradient and each rank's expert gradients are its
    slice of it. "skewed": every token picks rank 0's experts, the other ranks' receive none."""
    ref, per = one[(n, case)], CFG.routed_experts // n
    for r, got in enumerate(rank[case] for rank in ranks[n]):
        assert _close(got["logits"][0], ref["logits"][r], dtype)
        assert len(got["grads"]) == len(ref["grads"])
        for name, grad in got["grads"].items():
            if ".experts.local." in name:       # (E/ep, out, in): experts r*E/ep .. (r+1)*E/ep
                assert grad.shape[0] == per
                want = ref["grads"][name.replace(".experts.local.", ".experts.")][r * per:
                                                                                  (r + 1) * per]
            else:
                want = ref["grads"][name]
            assert _close(grad, want, dtype), name
    mean_loss = sum(rank[case]["loss"] for rank in ranks[n]) / n
    assert mean_loss == pytest.approx(ref["loss"], rel=TOLERANCE[dtype])


@pytest.mark.parametrize("n", WORLDS)
def test_parameter_bytes_per_rank_are_what_layers_give(ranks, n):
    """Routed experts: Weight.local(ep=N) of each, exactly; every parameter: the estimate's."""
    routed, replicated = rank_params(BIASED, n)
    assert routed == CFG.moe_layers * 3 * (CFG.routed_experts // n) * CFG.hidden * CFG.moe_ffn
    est = lk.estimate(BIASED, 1, SEQ, precision="fp32", device="cpu", layout=lk.Layout(dp=n, ep=n))
    for step in steps(ranks, n, 0.0):
        assert step.expert_bytes == 4 * routed
        assert step.param_bytes == 4 * (routed + replicated) == est.params
        assert est.details["parameters on this device"] == routed + replicated


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("hot", HOTS)
def test_every_row_reaches_exactly_one_rank(ranks, n, hot):
    ranks = steps(ranks, n, hot)
    for layer in range(CFG.moe_layers):
        assert sum(s.received[layer] for s in ranks) == n * ROWS == sum(s.dispatched for s in ranks)


@pytest.mark.parametrize("n", WORLDS)
def test_bytes_each_all_to_all_sends(ranks, n):
    """Skewed: rank 0 keeps its own rows and receives everyone's; each other rank sends all its
    rows out and gets them back. Counts: E/ep int64 to each other rank, per MoE layer. The
    backward pass sends the same bytes the other way."""
    layers, per = CFG.moe_layers, CFG.routed_experts // n
    for r, step in enumerate(steps(ranks, n, HOT)):
        mine = layers * ROWS * ROW_BYTES
        dispatch, combine = (0, (n - 1) * mine) if r == 0 else (mine, 0)
        assert step.sent["dispatch"] == step.sent["combine (backward)"] == dispatch
        assert step.sent["combine"] == step.sent["dispatch (backward)"] == combine
        assert step.sent["counts"] == layers * (n - 1) * per * 8
        assert step.received == ([n * ROWS] * layers if r == 0 else [0] * layers)
        # the replicated gradients are all-reduced (a ring: 2 (N - 1) / N of them), the
        # experts' not (the router bias has no gradient: tiny-moe's replicated weights remain)
        assert step.sent["all_reduce"] == 2 * (n - 1) * 4 * rank_params(CFG, n)[1] // n


@pytest.mark.parametrize("n", WORLDS)
def test_busiest_rank_activations_grow_with_its_share(ranks, n):
    """Rank 0's share of the routed rows grows with the router bias towards its experts (about
    1/N unbiased, then most, then all of them), and so do its activations at the peak and its
    peak; with every row on rank 0, the idle ranks hold the least."""
    table = loads(HOTS, [rank["steps"] for rank in ranks[n]])
    rank0 = [row for row in table if row.rank == 0]
    assert [row.hot for row in rank0] == list(HOTS)
    assert rank0[0].share < 0.75 and rank0[-1].share == 1.0
    for a, b in zip(rank0, rank0[1:]):
        assert a.share < b.share and a.activations < b.activations and a.peak < b.peak
    unbiased = [row.activations for row in table if row.hot == 0.0]
    idle = [row.activations for row in table if row.hot == HOT and row.rank > 0]
    assert max(idle) < min(unbiased)
    assert all(row.peak_phase == "backward" for row in table)


@pytest.mark.parametrize("n", WORLDS)
def test_a_shard_keeps_what_the_rule_says_for_its_rows(ranks, n):
    """Per routed row: input + gate, up, silu, product (h + 4 moe_ffn floats) and two int64
    indices; plus the combined output. Exact, for whatever rows each rank received."""
    for rank in ranks[n]:
        for rows, kept in rank["kept"]:
            assert kept == shard_kept_bytes(CFG, rows, SEQ)


@pytest.mark.parametrize("ep", [2, 4])
def test_one_rank_on_fake_tensors_is_the_estimate(ep):
    """Balanced routing (fake tensors): the estimate's peak to the byte, the two int64
    permutations an ExpertShard keeps per routed row included (but for 4 bytes the estimate
    misses without EP too)."""
    seq = 64
    out = fake_ep_peak(CFG, ep, seq=seq, precision="fp32")
    est = lk.estimate(CFG, 1, seq, precision="fp32", device="cuda", layout=lk.Layout(dp=ep, ep=ep))
    assert out["param_bytes"] == est.params and out["expert_bytes"] == 4 * rank_params(CFG, ep)[0]
    assert out["peak_phase"] == est.peak_phase == "backward"
    indices = next(t for t in est.tensors if t.name.startswith("expert-parallel permutations"))
    assert indices.nbytes == CFG.moe_layers * seq * CFG.top_k * 2 * 8
    assert out["by_category"]["activations"] == est.activations
    assert out["peak"] == est.total + 4


def test_deepseek_v3_routed_experts_per_rank_halve_with_each_doubling_of_ep():
    rows = ep_memory("deepseek-v3", eps=(8, 16, 32, 64))
    v3 = lk.preset("deepseek-v3")
    per_expert = 3 * v3.hidden * v3.moe_ffn                 # 44,040,192
    for row in rows:
        assert row["experts_per_rank"] == 256 // row["ep"]
        assert row["routed_params"] == v3.moe_layers * row["experts_per_rank"] * per_expert
        assert row["estimate_params"] == 2 * (row["routed_params"] + row["replicated_params"])
    assert len({row["replicated_params"] for row in rows}) == 1     # router, shared, attention...
    assert rows[0]["routed_params"] == 81_738_596_352                # 58 layers x 32 experts


@pytest.mark.parametrize("ep", [3, 0, 16])
def test_an_ep_that_does_not_divide_the_experts_raises(ep):
    with pytest.raises(ValueError, match="choose ep among"):
        experts_per_rank(CFG, ep)
    model = build_model(CFG)
    with pytest.raises(ValueError, match="routed_experts=8"):   # before any message
        expert_parallel(model, RankContext(0, ep, None, torch.device("cpu")))
    with pytest.raises(ValueError):
        routing_imbalance(ep)                                    # before any process starts
    with pytest.raises(ValueError):
        fake_ep_peak(CFG, ep)


def test_a_dense_model_has_no_experts_to_split():
    with pytest.raises(ValueError, match="MoE model"):
        experts_per_rank(lk.preset("tiny"), 2)


def test_a_capacity_factor_drops_the_rows_past_each_experts_buffer():
    """GShard's capacity: ceil(factor x rows / experts) per expert, the rest dropped."""
    from labkit.parallel.expert.compose import capacity_drops
    assert capacity_drops([10, 0, 2, 4], 1.0) == 6             # capacity 4: 10 -> 4
    assert capacity_drops([10, 0, 2, 4], 2.0) == 2             # capacity 8
    assert capacity_drops([4, 4, 4, 4], 1.0) == 0
    with pytest.raises(ValueError, match="capacity_factor"):
        capacity_drops([1, 2], 0)


def test_dropped_share_reads_every_ranks_experts_in_rank_order():
    from labkit.parallel.expert.expert_parallel import Load, dropped_share
    one = [Load(0.0, 1, 4, 0.2, 0, 0, "", expert_rows=[[2, 2], [0, 4]]),      # rank 1
           Load(0.0, 0, 16, 0.8, 0, 0, "", expert_rows=[[12, 0], [4, 4]])]    # rank 0
    # layer 1: [12, 0, 2, 2], capacity 4, 8 dropped; layer 2: [4, 4, 0, 4], capacity 3, 3 dropped
    assert dropped_share(one, 1.0) == (8 + 3) / (16 + 12)
