"""labkit's ShardedOptimizer (labkit.parallel.data.sharded_optimizer: ZeRO stage 1 over any
element-wise torch optimizer) on real gloo clusters, on models that are not labkit's: it trains as
torch's ZeroRedundancyOptimizer with the same optimizer class and as one process on every rank's
rows, and each rank keeps 1/N of the optimizer state.

fp64 throughout (but the "mixed" model's fp32 head). Against ZeroRedundancyOptimizer on 2 ranks
the sums are the same - DDP halves each gradient before its all-reduce, labkit halves the sum
after its reduce-scatter, both exact - and the inner optimizers do the same element-wise
arithmetic on slices laid out differently: equal to the last bit in practice; 1e-12 allowed.
One process on the concatenated rows computes the gradient of the mean in another order:
there the parameters agree to 1e-12, round-off of values O(1) in fp64 after 3 steps, ten
orders below what a step without the averaging leaves (O(lr) = 1e-2).
"""
import pytest
import torch
from torch import nn

import sharded_optimizer_targets as targets
from labkit.parallel import cluster
from labkit.parallel.data.sharded_optimizer import ShardedOptimizer
from labkit.parallel.data.zero import bytes_sent, padded, shard

N = 2
CLOSE = dict(rtol=0, atol=1e-12)
# (model, optimizer) compared with ZeroRedundancyOptimizer and with one process
CASES = [("mlp", "adamw"), ("mlp", "sgd"), ("mlp", "adam"), ("mlp", "adagrad"),
         ("frozen", "adamw"), ("frozen", "sgd"), ("groups", "adamw"), ("groups", "sgd")]


def _settings() -> dict:
    """(wrapper, model, optimizer[, "StepLR"]) -> train() keywords."""
    runs = {}
    for wrapper in ("labkit", "torch"):
        for model, optimizer in CASES:
            runs[wrapper, model, optimizer] = dict(model_name=model, optimizer=optimizer,
                                                   wrapper=wrapper)
        runs[wrapper, "groups", "adamw", "StepLR"] = dict(model_name="groups", optimizer="adamw",
                                                          wrapper=wrapper, scheduler=True)
    runs["labkit", "mixed", "sgd"] = dict(model_name="mixed", optimizer="sgd")  # torch's refuses it
    return runs


SETTINGS = _settings()


@pytest.fixture(scope="module")
def per_rank():
    """One cluster run for the file: each rank's Trained per setting, then what misuse() said."""
    return cluster.run(targets.train_all, N, list(SETTINGS.values()), misused=True, timeout_s=180)


@pytest.fixture(scope="module")
def ranks(per_rank):
    """key of SETTINGS -> [rank 0's Trained, rank 1's]."""
    return {key: [runs[i] for runs in per_rank] for i, key in enumerate(SETTINGS)}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def losses(run) -> torch.Tensor:
    return torch.tensor(run.losses, dtype=torch.float64)


# ---- equal to torch's ZeroRedundancyOptimizer and to one process --------------------------
@pytest.mark.parametrize("model, optimizer", CASES)
def test_trains_as_torch_zero_redundancy_optimizer(ranks, model, optimizer):
    for ours, torchs in zip(ranks["labkit", model, optimizer], ranks["torch", model, optimizer]):
        assert max_diff(ours.final, torchs.final) <= CLOSE["atol"]
        torch.testing.assert_close(losses(ours), losses(torchs), **CLOSE)
    a, b = ranks["labkit", model, optimizer]
    assert max_diff(a.final, b.final) == 0                    # every rank holds the same model
    assert a.losses != b.losses                               # ... trained on different rows


@pytest.mark.parametrize("model, optimizer", CASES)
def test_trains_as_one_process_on_every_ranks_rows(ranks, model, optimizer):
    one = targets.one_process(model, optimizer, world_size=N)
    a, b = ranks["labkit", model, optimizer]
    torch.testing.assert_close((losses(a) + losses(b)) / 2, losses(one), **CLOSE)
    assert max_diff(a.final, one.final) <= CLOSE["atol"]
    assert max_diff(a.final, a.initial) > 1e-3                # it trained


def test_a_frozen_part_stays_out_of_the_shards_and_never_changes(ranks):
    a, _ = ranks["labkit", "frozen", "adamw"]
    for name in ("backbone.weight", "backbone.bias"):
        assert torch.equal(a.final[name], a.initial[name])
    trainable = sum(t.numel() for name, t in a.initial.items() if name.startswith("head"))
    assert a.shard["numel"] == trainable                      # the backbone has no share


def test_each_parameter_group_steps_with_its_own_options(ranks):
    """Weights and biases are two groups (two flat buffers, padded apart); the inner optimizer
    has a group for each, with the caller's lr (and weight decay, momentum: equal to torch's)."""
    a, _ = ranks["labkit", "groups", "adamw"]
    weights, biases = targets.GROUP_OPTIONS["adamw"]
    assert a.lrs == [[weights["lr"], biases["lr"]]] * targets.STEPS
    assert len(a.shard["unit_numels"]) == 2
    assert a.shard["shard_numel"] == sum(shard(n, N) for n in a.shard["unit_numels"])


def test_an_lr_scheduler_changes_the_inner_optimizers_lr(ranks):
    """StepLR halves each group's lr every step: the inner optimizer steps with it, and the
    parameters stay equal to ZeroRedundancyOptimizer's and one process's under the same StepLR."""
    key = ("groups", "adamw", "StepLR")
    ours, torchs = ranks["labkit", *key][0], ranks["torch", *key][0]
    one = targets.one_process("groups", "adamw", world_size=N, scheduler=True)
    weights, biases = targets.GROUP_OPTIONS["adamw"]
    halved = [[weights["lr"] / 2 ** s, biases["lr"] / 2 ** s] for s in range(targets.STEPS)]
    assert ours.lrs == torchs.lrs == one.lrs == halved
    assert max_diff(ours.final, torchs.final) <= CLOSE["atol"]
    assert max_diff(ours.final, one.final) <= CLOSE["atol"]
    assert max_diff(ours.final, ranks["labkit", "groups", "adamw"][0].final) > 1e-4


def test_one_flat_buffer_per_dtype(ranks):
    """An fp64 body under an fp32 head, one group: two buffers. Against one process in fp32 the
    head's round-off (~1e-7 relative) is what is left."""
    a, b = ranks["labkit", "mixed", "sgd"]
    assert a.shard["unit_dtypes"] == [torch.float64, torch.float32]
    one = targets.one_process("mixed", "sgd", world_size=N)
    assert max_diff(a.final, one.final) < 1e-6
    assert max_diff(a.final, b.final) == 0


# ---- what each rank holds and sends ---------------------------------------------------------
@pytest.mark.parametrize("model, optimizer, per_element, scalars, padding",
                         [("mlp", "adamw", 16, 4, 1),          # 151 elements in one buffer
                          ("groups", "adamw", 16, 4, 1),       # 133 (weights) and 18 (biases)
                          ("frozen", "sgd", 8, 0, 0)])         # the head's 144
def test_each_rank_holds_1_over_n_of_the_optimizer_state(ranks, model, optimizer, per_element,
                                                         scalars, padding):
    """AdamW keeps exp_avg and exp_avg_sq (16 bytes per fp64 element) and a 4-byte step per
    tensor it steps (one per flat buffer here); SGD a momentum buffer (8 bytes per element). A
    rank's tensors are its shard of each buffer, Ψ/N rounded up: N ranks hold the full state's
    elements and ``padding`` zeros more (< N per buffer)."""
    one = targets.one_process(model, optimizer, world_size=N)
    full_tensors = sum(1 for name in one.initial if not name.startswith("backbone"))
    full = one.state_bytes - scalars * full_tensors               # the elements' state, Ψ of them
    assert full == per_element * ranks["labkit", model, optimizer][0].shard["numel"]
    for r in ranks["labkit", model, optimizer]:
        units, k = len(r.shard["unit_numels"]), r.shard["shard_numel"]
        assert r.state_bytes == per_element * k + scalars * units
        assert r.tracked_state == r.state_bytes                   # as labkit.MemoryTracker counts
        assert r.shard["padding"] == padding == sum(padded(n, N) - n
                                                    for n in r.shard["unit_numels"])
        assert N * (r.state_bytes - scalars * units) == full + per_element * r.shard["padding"]
        assert set(r.shard["saved_shapes"]) == {(shard(n, N),) for n in r.shard["unit_numels"]}


def test_a_step_sends_a_reduce_scatter_and_an_all_gather_of_each_buffer(ranks):
    """(N - 1) shards of gradients out and (N - 1) shards of weights: DDP's all-reduce volume."""
    for key in [("mlp", "adamw"), ("groups", "sgd"), ("frozen", "adamw")]:
        r = ranks["labkit", *key][0]
        sent = r.shard["sent"]
        assert sent["reduce_scatter"] == sent["all_gather"] == (N - 1) * r.shard["shard_numel"] * 8
        assert sum(sent.values()) == bytes_sent(r.shard["unit_numels"], 1, N, 8, 8)


# ---- misuse -----------------------------------------------------------------------------------
@pytest.mark.parametrize("params, optimizer_class, match", [
    ([], torch.optim.AdamW, "params is empty"),
    (iter([]), torch.optim.AdamW, "params is empty"),
    (nn.Parameter(torch.ones(3)), torch.optim.AdamW, "params is one tensor"),
    ([nn.Parameter(torch.ones(3))], "adamw", "is not a torch.optim.Optimizer subclass"),
    ([nn.Parameter(torch.ones(3))], nn.Linear, "is not a torch.optim.Optimizer subclass"),
    ([nn.Parameter(torch.ones(3))], torch.optim.AdamW(
        [nn.Parameter(torch.ones(1))]), "pass the class itself"),
    ([nn.Parameter(torch.ones(3))], torch.optim.LBFGS, "LBFGS updates an element from others"),
    ([nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, device="meta"))],
     torch.optim.AdamW, "the parameters are on cpu, meta"),
    ([nn.Parameter(torch.ones(3), requires_grad=False)], torch.optim.AdamW, "every parameter is"),
    ([nn.Parameter(torch.ones(3))], torch.optim.AdamW, "group=None is not a torch.distributed"),
])
def test_bad_input_raises_a_clear_value_error_before_any_message(params, optimizer_class, match):
    with pytest.raises(ValueError, match=match):
        ShardedOptimizer(params, optimizer_class, None, lr=1e-2)     # no group: nothing sent


def test_misuse_is_named_on_every_rank_and_a_ranks_state_loads_back(per_rank):
    said = [runs[-1] for runs in per_rank]
    for r, other in [(0, 1), (1, 0)]:
        assert said[r].pop("other rank") == (f"this state is rank {other} of 2's shard; this is "
                                             f"rank {r} of 2")
    assert said[0] == said[1]
    assert said[0]["no gradient"].startswith("group 0, net.2.weight (7, 7) has no gradient")
    assert "pass every group to the constructor" in said[0]["add group"]
    assert said[0]["reloaded lr"] == 1e-2 and said[0]["reloaded equal"]


# ---- on 4 ranks ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_four_ranks_train_as_torch_zero_redundancy_optimizer_and_one_process():
    """Four addends: gloo sums them in an order that depends on where an element sits in the
    message (DDP's bucket is not our buffer): equal to round-off (1e-12), not bit for bit."""
    runs = [dict(model_name="mlp", optimizer="adamw", wrapper=w) for w in ("labkit", "torch")]
    four = cluster.run(targets.train_all, 4, runs, timeout_s=120)
    one = targets.one_process("mlp", "adamw", world_size=4)
    ours, torchs = four[0]
    assert max_diff(ours.final, torchs.final) <= CLOSE["atol"]
    assert max_diff(ours.final, one.final) <= CLOSE["atol"]
    assert all(max_diff(r[0].final, ours.final) == 0 for r in four)
    # flat shards: 38 of the 151 elements each (1 of padding); torch's whole tensors (greedy,
    # largest first) cannot split 56, 49, 28, 7, 7, 4 evenly four ways: 900, 788, 452, 300 bytes
    assert ours.shard["shard_numel"] == shard(ours.shard["numel"], 4) == 38
    assert [r[0].state_bytes for r in four] == [16 * 38 + 4] * 4
    assert max(r[1].state_bytes for r in four) > 1.4 * ours.state_bytes
