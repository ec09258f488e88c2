"""labkit's FullyShardedDataParallel (labkit.parallel.data.fully_sharded) on real gloo clusters, on
models that are not labkit's: it trains exactly as torch's FSDP2 (``fully_shard``), bf16 compute
over fp32 shards included, and as one process on all the rows; each rank keeps 1/N of every
parameter, steps it with a plain torch optimizer and drops each whole weight after its unit's
forward.

fp64 unless said. Against FSDP2 the comparison is exact (both gather the same chunks, and a
reduce-scatter of two addends divided by 2 is the same either way). One process on the
concatenated rows computes the mean's gradient in another order: there the weights agree to
1e-12, round-off of O(1) values in fp64 after 3 steps, ten orders below what a missing
reduce-scatter leaves (O(lr) = 1e-2).
"""
import pytest
import torch
from torch import nn

import data_parallel_targets as dp_targets
import fully_sharded_targets as targets
from labkit.parallel import cluster
from labkit.parallel.data.fully_sharded import FullyShardedDataParallel

N = 2
CLOSE = dict(rtol=0, atol=1e-12)
BF16 = dict(compute_dtype=torch.bfloat16, dtype=torch.float32)
SETTINGS = {
    **{(w, m): dict(model_name=m, wrapper=w) for w in ("labkit", "torch") for m in ("mlp", "frozen")},
    **{(w, "bf16"): dict(model_name="mlp", wrapper=w, **BF16) for w in ("labkit", "torch")},
    **{(w, "bf16 replicated"): dict(model_name="mlp", wrapper=w, replicate_biases=w == "labkit",
                                     **BF16) for w in ("labkit", "torch")},
    **{(w, "accumulate"): dict(model_name="mlp", wrapper=w, accumulate=2)
       for w in ("labkit", "torch")},
    **{(w, "no_sync"): dict(model_name="mlp", wrapper=w, accumulate=2, no_sync=True)
       for w in ("labkit", "torch")},
    **{(w, "bf16 no_sync"): dict(model_name="mlp", wrapper=w, accumulate=3, no_sync=True, **BF16)
       for w in ("labkit", "torch")},
    ("labkit", "after a failure"): dict(model_name="mlp", fail_once=True),
    ("labkit", "tied"): dict(model_name="tied"),
    ("labkit", "tied no_sync"): dict(model_name="tied", accumulate=2, no_sync=True),
    ("labkit", "replicated"): dict(model_name="mlp", replicate_biases=True),
    ("labkit", "root only"): dict(model_name="mlp", units=None),
}


@pytest.fixture(scope="module")
def ranks():
    """(wrapper, case) -> [rank 0's Sharded, rank 1's]: one cluster run for the file."""
    per_rank = cluster.run(targets.train_all, N, list(SETTINGS.values()), timeout_s=180)
    return {key: [runs[i] for runs in per_rank] for i, key in enumerate(SETTINGS)}


def fp64(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.mark.parametrize("case", ["mlp", "frozen", "bf16", "bf16 replicated", "accumulate",
                                  "no_sync", "bf16 no_sync"])
def test_trains_exactly_as_torch_fsdp2(ranks, case):
    """bf16 replicated: labkit keeps the biases whole and casts them for each use; FSDP2 shards
    and gathers them in bf16; the same sums either way (two addends, / 2). no_sync: against
    set_requires_gradient_sync(False) with reduce_dtype the parameters' (bf16 no_sync: fp32 sums
    of three bf16 micro-batch gradients)."""
    for ours, torchs in zip(ranks["labkit", case], ranks["torch", case]):
        assert ours.losses == torchs.losses
        assert max_diff(ours.final, torchs.final) == 0
        if case != "bf16 replicated":
            assert ours.kept_numel == torchs.kept_numel       # the same chunks, padding included
    a, b = ranks["labkit", case]
    assert a.losses != b.losses                               # ... on different rows


@pytest.mark.parametrize("case, model", [("mlp", "mlp"), ("frozen", "frozen"), ("tied", "tied"),
                                         ("replicated", "mlp"), ("root only", "mlp"),
                                         ("after a failure", "mlp")])
def test_trains_as_one_process_on_both_ranks_rows(ranks, case, model):
    one = dp_targets.one_process(model, "adamw", world_size=N)
    a, b = ranks["labkit", case]
    mean = (fp64(a.losses) + fp64(b.losses)) / 2
    torch.testing.assert_close(mean, fp64(one.losses), **CLOSE)
    assert max_diff(a.final, one.final) < CLOSE["atol"] and max_diff(b.final, a.final) == 0
    assert max_diff(a.final, {n: p for n, p in one.initial.items()}) > 0.01      # it trained


def test_each_rank_keeps_a_chunk_of_every_parameter_and_of_its_gradient(ranks):
    """The MLP 8-16-16-4 (484 parameters): dim 0 of each cut in 2; replicated biases stay whole;
    a frozen backbone's chunks get no gradient."""
    a = ranks["labkit", "mlp"][0]
    assert a.kept_numel == 484 // N
    assert a.grad_shapes == {"module.net.0.weight": (8, 8), "module.net.0.bias": (8,),
                             "module.net.2.weight": (8, 16), "module.net.2.bias": (8,),
                             "module.net.4.weight": (2, 16), "module.net.4.bias": (2,)}
    replicated = ranks["labkit", "replicated"][0]
    assert replicated.kept_numel == (128 + 256 + 64) // N + 16 + 16 + 4
    assert replicated.grad_shapes["module.net.0.bias"] == (16,)
    frozen = ranks["labkit", "frozen"][0]
    assert not any(n.startswith("module.backbone") for n in frozen.grad_shapes)


@pytest.mark.parametrize("case", ["mlp", "bf16", "tied", "root only", "after a failure"])
def test_no_whole_weight_outlives_the_forward_autograd_keeps_notes(ranks, case):
    """Two weights are saved for an input's gradient (the MLP's second and third Linear; the tied
    model's mix and head; the first Linear's input needs none): as notes, gathered again in the
    backward pass."""
    for run in ranks["labkit", case]:
        assert run.whole_after_forward == 0
        assert run.notes == 2


@pytest.mark.parametrize("units, match", [((int,), "nn.Module classes"), ((), "nn.Module classes")])
def test_bad_units_are_named(units, match):
    with pytest.raises(ValueError, match=match):
        FullyShardedDataParallel(nn.Linear(2, 2), units=units)


def test_bad_compute_dtype_is_named():
    with pytest.raises(ValueError, match="floating torch.dtype"):
        FullyShardedDataParallel(nn.Linear(2, 2), compute_dtype=torch.int8)


def test_a_tied_weight_under_no_sync_trains_as_one_process_on_all_micro_batches(ranks):
    """Embedding and head share a weight across units: both gathers' gradients are held and
    summed, then reduce-scattered once. One process on both ranks' rows of both micro-batches."""
    a, b = ranks["labkit", "tied no_sync"]
    one = dp_targets.one_process("tied", "adamw", world_size=N, accumulate=2)
    assert max_diff(a.final, one.final) < CLOSE["atol"] and max_diff(b.final, a.final) == 0


def test_no_sync_reduce_scatters_once_per_step_instead_of_per_micro_batch(ranks):
    """Two micro-batches: every weight gathered twice a step either way; its gradient
    reduce-scattered twice, or once under no_sync (FSDP2's set_requires_gradient_sync)."""
    each, once = ranks["labkit", "accumulate"][0].sent, ranks["labkit", "no_sync"][0].sent
    assert each["all_gather"] == once["all_gather"] > 0
    assert each["reduce_scatter"] == 2 * once["reduce_scatter"] == 2 * (484 // N) * 8


# ---- labkit's transformer, a unit per block ------------------------------------------------------
@pytest.mark.slow
def test_on_labkits_transformer_it_trains_as_fsdp2_holding_no_more():
    """`small` at 128 tokens on 2 ranks: the same losses and the same chunks as FSDP2; its peak is
    no higher: it prefetches nothing, keeps no root gathered from forward to backward, and
    works in one weight's buffer at a time (FSDP2: whole-block flat buffers, one block ahead)."""
    torchs, ours = cluster.run(targets.blocks_side_by_side, N, "small", 128, timeout_s=180)[0]
    assert ours.losses == torchs.losses
    assert (ours.param_bytes, ours.state_bytes) == (torchs.param_bytes, torchs.state_bytes)
    assert ours.peak <= torchs.peak


# ---- on 4 ranks --------------------------------------------------------------------------------
@pytest.mark.slow
def test_four_ranks_train_as_torch_fsdp2_and_one_process():
    """Four addends: gloo's reduce-scatter sums them in its own order, so equal to round-off."""
    runs = [dict(model_name="mlp", wrapper=w) for w in ("labkit", "torch")]
    per_rank = cluster.run(targets.train_all, 4, runs, timeout_s=120)
    one = dp_targets.one_process("mlp", "adamw", world_size=4)
    ours, torchs = per_rank[0]
    assert max_diff(ours.final, torchs.final) < CLOSE["atol"]
    assert max_diff(ours.final, one.final) < CLOSE["atol"]
    assert ours.kept_numel == torchs.kept_numel
    assert all(r[0].whole_after_forward == 0 for r in per_rank)


@pytest.mark.slow
def test_hsdp_on_2_x_2_ranks_trains_exactly_as_fsdp2_on_a_2d_mesh():
    """Shard inside {0, 1} and {2, 3}, replicate across: each rank keeps half of every weight,
    its chunk's gradient reduce-scattered in its pair and all-reduced with its counterpart; FSDP2
    with a (replicate, shard) mesh does the same sums (two addends each)."""
    runs = [dict(model_name="mlp", wrapper=w, hsdp=True) for w in ("labkit", "torch")]
    per_rank = cluster.run(targets.train_all, 4, runs, timeout_s=120)
    one = dp_targets.one_process("mlp", "adamw", world_size=4)
    for ours, torchs in per_rank:
        assert ours.losses == torchs.losses and max_diff(ours.final, torchs.final) == 0
        assert ours.kept_numel == 484 // 2 and ours.sent["all_reduce"] > 0
    assert max_diff(per_rank[0][0].final, one.final) < CLOSE["atol"]
