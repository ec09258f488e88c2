"""labkit's DataParallel (labkit.parallel.data.data_parallel) on real gloo clusters, on models that
are not labkit's: it trains exactly as torch's DistributedDataParallel and as one process on all the
rows, sends each trainable parameter once (a tied one too, a frozen one never), and launches its
all-reduces while the backward pass is still running.

fp64 throughout. On 2 ranks the comparison with torch's DDP is exact (torch.equal): an all-reduce
of two addends is the same sum in either order, and / 2 is exact whether done before the sum
(DDP) or after (labkit). One process on the concatenated rows computes the gradient of the mean
in another order: there the parameters agree to 1e-12, round-off of values O(1) in fp64 after 3
steps, ten orders below what a missing all-reduce leaves (O(lr) = 1e-2).
"""
import pytest
import torch
from torch import nn

import data_parallel_targets as targets
from labkit.parallel import cluster
from labkit.parallel.data.data_parallel import DataParallel, make_buckets

N = 2
BUCKET_MB = 0.002          # 2097 bytes: the fp64 MLP's 6 gradients in 3 buckets
CLOSE = dict(rtol=0, atol=1e-12)
# (model, optimizer) of the comparisons; each in both modes: one all-reduce per parameter, buckets
MODELS = [("mlp", "sgd"), ("tied", "adamw"), ("frozen", "adamw")]
MODES = {"per parameter": None, "bucketed": BUCKET_MB}


def _settings() -> dict:
    """(wrapper, model, mode) -> train() keywords; each rank starts from its own seed (differ)."""
    runs = {}
    for wrapper in ("labkit", "torch"):
        for mode, bucket_mb in MODES.items():
            common = dict(wrapper=wrapper, bucket_mb=bucket_mb, differ=True)
            for model, optimizer in MODELS:
                runs[wrapper, model, mode] = dict(model_name=model, optimizer=optimizer, **common)
            runs[wrapper, "branchy", mode] = dict(model_name="branchy", optimizer="adamw",
                                                  find_unused=True, **common)
            runs[wrapper, "accumulate", mode] = dict(model_name="mlp", optimizer="adamw",
                                                     accumulate=2, **common)
    for mode, bucket_mb in MODES.items():     # finish() from the optimizer's step pre-hook
        runs["labkit", "hooked", mode] = dict(model_name="tied", optimizer="adamw", hooked=True,
                                              wrapper="labkit", bucket_mb=bucket_mb, differ=True)
    return runs


SETTINGS = _settings()


@pytest.fixture(scope="module")
def ranks():
    """(wrapper, model, mode) -> [rank 0's Trained, rank 1's]: one cluster run for the file."""
    per_rank = cluster.run(targets.train_all, N, list(SETTINGS.values()), timeout_s=180)
    return {key: [runs[i] for runs in per_rank] for i, key in enumerate(SETTINGS)}


def losses(run) -> torch.Tensor:
    return torch.tensor(run.losses, dtype=torch.float64)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


# ---- the bucket plan, in this process --------------------------------------------------------
def test_buckets_follow_reverse_registration_order_up_to_bucket_mb():
    mlp = targets.MLP().double()
    named = list(mlp.named_parameters())[::-1]
    buckets = make_buckets(named, BUCKET_MB)
    assert [b.names for b in buckets] == [["net.4.bias", "net.4.weight", "net.2.bias"],
                                          ["net.2.weight"], ["net.0.bias", "net.0.weight"]]
    for b in buckets:           # at most bucket_mb, unless one parameter alone is larger
        assert b.flat.nbytes <= BUCKET_MB * 2 ** 20 or len(b.params) == 1
        assert b.flat.nbytes == sum(p.nbytes for p in b.params)      # no padding
    assert [len(b.params) for b in make_buckets(named, None)] == [1] * 6
    assert all(b.flat is None for b in make_buckets(named, None))     # in place in .grad


def test_a_bucket_holds_one_dtype():
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    buckets = make_buckets(list(mixed.named_parameters())[::-1], bucket_mb=1)
    assert [b.names for b in buckets] == [["1.bias", "1.weight"], ["0.bias", "0.weight"]]
    assert [b.flat.dtype for b in buckets] == [torch.float64, torch.float32]


@pytest.mark.parametrize("bucket_mb", [0, -1, True, "25"])
def test_bad_bucket_mb_raises_before_any_message(bucket_mb):
    with pytest.raises(ValueError, match="bucket_mb must be a positive number"):
        DataParallel(targets.MLP(), group=None, bucket_mb=bucket_mb)     # no group: nothing sent


# ---- on 2 ranks --------------------------------------------------------------------------------
def test_the_wrap_gives_every_rank_rank_0s_weights_and_buffers(ranks):
    a, b = ranks["labkit", "frozen", "per parameter"]
    assert max_diff(a.built, b.built) > 0.01                  # each rank initialised its own
    assert max_diff(b.initial, a.built) == 0                  # ... and took rank 0's at the wrap
    assert max_diff(b.buffers, a.buffers) == 0                # the buffer too
    assert max_diff(b.initial, ranks["torch", "frozen", "per parameter"][1].initial) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", [m for m, _ in MODELS] + ["branchy", "accumulate"])
def test_trains_exactly_as_torch_ddp(ranks, model, mode):
    for ours, torchs in zip(ranks["labkit", model, mode], ranks["torch", model, mode]):
        assert ours.losses == torchs.losses
        assert max_diff(ours.final, torchs.final) == 0
    a, b = ranks["labkit", model, mode]
    assert max_diff(a.final, b.final) == 0                    # the copies stayed equal
    assert a.losses != b.losses                               # ... on different rows


@pytest.mark.parametrize("mode", MODES)
def test_finish_before_steps_on_the_mean_from_the_optimizers_step(ranks, mode):
    """A loop that never calls finish(): the optimizer's step pre-hook does, with the same result."""
    for hooked, called in zip(ranks["labkit", "hooked", mode], ranks["labkit", "tied", mode]):
        assert hooked.losses == called.losses
        assert max_diff(hooked.final, called.final) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model, optimizer", MODELS)
def test_trains_as_one_process_on_both_ranks_rows(ranks, model, optimizer, mode):
    one = targets.one_process(model, optimizer, world_size=N)
    a, b = ranks["labkit", model, mode]
    torch.testing.assert_close((losses(a) + losses(b)) / 2, losses(one), **CLOSE)
    assert max_diff(a.final, one.final) < CLOSE["atol"]
    assert max_diff(a.final, a.initial) > 0.01                # it trained


@pytest.mark.parametrize("mode", MODES)
def test_each_trainable_parameter_is_all_reduced_once_per_step(ranks, mode):
    for model, trainable in [("mlp", 6), ("tied", 3), ("frozen", 6)]:
        sent = [name for bucket in ranks["labkit", model, mode][0].launches for name in bucket]
        assert len(sent) == len(set(sent)) == trainable, (model, sent)
    tied = [n for bucket in ranks["labkit", "tied", mode][0].launches for n in bucket]
    assert "embed.weight" in tied and "head.weight" not in tied     # one weight, sent once


@pytest.mark.parametrize("mode", MODES)
def test_a_frozen_part_is_never_sent_and_never_changes(ranks, mode):
    a, b = ranks["labkit", "frozen", mode]
    assert not any(name.startswith("backbone") for bucket in a.launches for name in bucket)
    for name in ("backbone.weight", "backbone.bias"):
        assert torch.equal(a.final[name], a.initial[name])
        assert torch.equal(b.final[name], a.final[name])


@pytest.mark.parametrize("mode", MODES)
def test_all_reduces_are_launched_while_backward_still_computes_gradients(ranks, mode):
    """The overlap: the first all-reduce leaves before the last gradient is made."""
    timeline = ranks["labkit", "mlp", mode][0].timeline
    kinds = [e.kind for e in timeline]
    first_launch = kinds.index("launch")
    last_ready = len(kinds) - 1 - kinds[::-1].index("ready")
    assert first_launch < last_ready
    assert timeline[first_launch].seconds < timeline[last_ready].seconds
    assert timeline[first_launch].names[0] == "net.4.bias"   # the last layer's, first made
    launched = [e.names for e in timeline if e.kind == "launch"]
    assert sorted(e.names for e in timeline if e.kind == "done") == sorted(launched)
    assert (kinds[0], kinds[-1]) == ("forward", "finish")     # finish() waits for every done


def test_unused_parameters_take_the_others_mean_or_keep_no_gradient(ranks):
    """branchy: each rank uses one of two heads (the other one's gradient is the other rank's
    / N) and never the layer ``never``: no gradient anywhere, so AdamW leaves it (weight decay
    too), as in one process."""
    for mode in MODES:
        a, b = ranks["labkit", "branchy", mode]
        for name in ("never.weight", "never.bias"):
            assert torch.equal(a.final[name], a.initial[name])
        for name in ("heads.0.weight", "heads.1.weight"):
            assert max_diff({name: a.final[name]}, {name: a.initial[name]}) > 0.01


def test_misuse_is_named_on_every_rank():
    said = cluster.run(targets.misuse, N, timeout_s=60)
    assert said[0] == said[1]
    missing, twice = said[0]
    assert missing.startswith("no gradient reached never.bias, never.weight, heads.1.bias, "
                              "heads.1.weight in this step")
    assert "find_unused_parameters=True" in missing
    assert twice.startswith("net.4.bias's gradient arrived twice before finish()")


# ---- on 4 ranks --------------------------------------------------------------------------------
# 7-11 s on 2 busy cores: each of the 4 ranks imports torch._dynamo at its first optimizer
@pytest.mark.slow
def test_four_ranks_train_as_torch_ddp_and_one_process():
    """Four addends: gloo sums them in an order that depends on where an element sits in the
    message, and torch's buckets are not ours: equal to round-off (1e-12), not bit for bit."""
    runs = [dict(model_name="mlp", optimizer="adamw", bucket_mb=BUCKET_MB, differ=True,
                 wrapper=w) for w in ("labkit", "torch")]
    per_rank = cluster.run(targets.train_all, 4, runs, timeout_s=120)
    one = targets.one_process("mlp", "adamw", world_size=4)
    ours, torchs = per_rank[0]
    assert max_diff(ours.final, torchs.final) < CLOSE["atol"]
    assert max_diff(ours.final, one.final) < CLOSE["atol"]
    assert all(max_diff(r[0].final, ours.final) == 0 for r in per_rank)
    mean_loss = sum(losses(r[0]) for r in per_rank) / 4
    torch.testing.assert_close(mean_loss, losses(one), **CLOSE)
