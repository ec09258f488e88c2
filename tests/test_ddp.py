"""DDP (labkit.parallel.data.ddp) on a real 2-rank gloo cluster: every rank holds all the
states plus gradient buckets of exactly the gradients' bytes, and trains like one process on
all the rows."""
import pytest
import torch

import labkit as lk
from labkit.parallel import cluster
from labkit.parallel.cluster import RankContext
from labkit.parallel.data.ddp import (bucket_bytes, ddp_step, ddp_steps, extra_bytes, grads_held,
                                      labkit_ddp_step, one_process_step)
from labkit.predict.layers import lora_weights

N = 2
TINY_GRAD_BYTES = 125_248 * 4            # tiny's parameters, fp32
# one cluster run for the file: tiny (seq 32, one row per rank) in both modes, tiny with
# buckets capped at 0.2 MiB (several buckets), the MoE preset once, and LoRA on tiny
SETTINGS = {
    "off": dict(gradient_as_bucket_view=False, keep_params=True),
    "view": dict(gradient_as_bucket_view=True, keep_params=True),
    "capped": dict(gradient_as_bucket_view=False, bucket_cap_mb=0.2),
    "moe": dict(model_name="tiny-moe", gradient_as_bucket_view=True),
    "lora": dict(trainable="lora", gradient_as_bucket_view=False),   # replicas of a frozen model
}
VIEW = {name: s["gradient_as_bucket_view"] for name, s in SETTINGS.items()}


@pytest.fixture(scope="module")
def ranks():
    """name -> [rank 0's DDPStep, rank 1's]."""
    per_rank = cluster.run(ddp_steps, N, list(SETTINGS.values()), timeout_s=180)
    return {name: [steps[i] for steps in per_rank] for i, name in enumerate(SETTINGS)}


@pytest.fixture(scope="module")
def one_process():
    """tiny trained in this process on both ranks' rows (batch N): what DDP must equal."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # tiny matmuls: a second thread only waits
    try:
        return one_process_step("tiny", batch=N, keep_params=True)
    finally:
        torch.set_num_threads(threads)


def test_the_rule():
    g = 1000
    assert bucket_bytes(g) == g
    assert grads_held(g, False) == {"forward": g, "backward": 2 * g, "optimizer": 2 * g}
    assert grads_held(g, True) == {"forward": g, "backward": g, "optimizer": g}
    assert extra_bytes(g, False) == {"forward": g, "backward": g, "optimizer": g}
    assert extra_bytes(g, True) == {"forward": g, "backward": 0, "optimizer": 0}


@pytest.mark.parametrize("name", SETTINGS)
def test_buckets_hold_exactly_the_gradient_bytes(ranks, name):
    for step in ranks[name]:
        assert sum(step.buckets) == bucket_bytes(step.grad_bytes)
    if name not in ("moe", "lora"):
        assert ranks[name][0].grad_bytes == TINY_GRAD_BYTES
    if name == "lora":                  # the adapters alone: rank 16 on tiny's block linears
        cfg = lk.preset("tiny")
        adapters = sum(w.numel for m in (False,) * cfg.layers
                       for w in lora_weights(cfg, m, 16))
        assert ranks[name][0].grad_bytes == 4 * adapters


def test_bucket_cap_sets_how_many_buckets_not_their_bytes(ranks):
    whole, capped = ranks["off"][0].buckets, ranks["capped"][0].buckets
    assert len(whole) == 1 and len(capped) == 3            # 0.5 MB of gradients, 0.2 MiB buckets
    assert sum(capped) == sum(whole) == TINY_GRAD_BYTES     # no padding


@pytest.mark.parametrize("name", SETTINGS)
def test_gradients_held_before_forward_and_at_the_optimizer_step(ranks, name):
    """The buckets outlive zero_grad: the forward pass holds them too. Bucket views off: the
    optimizer steps with param.grad and the buckets (2G); on: param.grad are the buckets (G)."""
    for step in ranks[name]:
        rule = grads_held(step.grad_bytes, VIEW[name])
        assert step.held == {"forward": rule["forward"], "optimizer": rule["optimizer"]}


def test_the_peak_holds_the_gradients_twice_unless_they_are_bucket_views(ranks):
    off, view = ranks["off"][0], ranks["view"][0]
    assert off.peak_phase == "optimizer"
    assert off.peak_by_category["grads"] == 2 * TINY_GRAD_BYTES
    assert view.peak_by_category["grads"] == TINY_GRAD_BYTES
    assert view.peak < off.peak
    for a, b in (ranks["off"], ranks["view"]):
        assert (a.peak, a.peak_by_category) == (b.peak, b.peak_by_category)   # ranks alike


@pytest.mark.parametrize("name", SETTINGS)
def test_the_estimate_gives_each_ranks_peak_within_3_percent(ranks, name):
    setting = SETTINGS[name]
    layout = lk.Layout(dp=N, gradient_as_bucket_view=setting["gradient_as_bucket_view"])
    est = lk.estimate(setting.get("model_name", "tiny"), 1, 32, precision="fp32", device="cpu",
                      layout=layout, trainable=setting.get("trainable", "all"))
    for step in ranks[name]:
        assert step.peak == pytest.approx(est.total, rel=0.03)
        assert step.sent["all_reduce"] == est.details["bytes sent per step"]


@pytest.mark.parametrize("name", ["off", "view"])
def test_every_rank_ends_with_the_same_parameters(ranks, name):
    a, b = ranks[name]
    assert torch.equal(a.params, b.params)


@pytest.mark.parametrize("name", ["off", "view"])
def test_ddp_trains_like_one_process_on_both_ranks_rows(ranks, one_process, name):
    """The mean of the ranks' losses is the loss of both rows; the parameters agree to fp32
    round-off, which AdamW's g / sqrt(v) raises to ~1e-6 on near-zero gradients (lr 1e-3).
    A missing all-reduce would leave the ranks O(lr) apart."""
    a, b = ranks[name]
    mean_loss = (torch.tensor(a.losses) + torch.tensor(b.losses)) / 2
    torch.testing.assert_close(mean_loss, torch.tensor(one_process.losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(a.params, one_process.params, rtol=1e-5, atol=1e-5)


def test_moe_needs_no_find_unused_parameters(ranks):
    """labkit stacks the routed experts into one weight per projection: an expert a rank never
    routes to still gets a (zero) gradient slice, so every parameter reaches its bucket."""
    a, b = ranks["moe"]
    assert a.grad_bytes == sum(a.buckets) > TINY_GRAD_BYTES
    assert len(a.losses) == 3 and a.losses != b.losses     # each rank trained its own rows


@pytest.mark.parametrize("bad", [dict(bucket_cap_mb=0), dict(bucket_cap_mb=-1),
                                 dict(bucket_cap_mb=True), dict(model_name="no-such-model"),
                                 dict(steps=2), dict(precision="fp16-mixed"), dict(batch=0)])
def test_bad_input_raises_before_any_message(bad):
    ctx = RankContext(0, N, None, torch.device("cpu"))      # no group: nothing is sent
    with pytest.raises(ValueError):
        ddp_step(ctx, **bad)


def test_labkits_own_ddp_trains_and_holds_exactly_as_torch_ddp(ranks):
    """labkit's DataParallel (buckets of 0.2 MiB, as the "capped" run): the same losses and the
    same peak per rank as torch's DDP, and all but the last bucket launched while backward runs."""
    ours = cluster.run(labkit_ddp_step, N, bucket_mb=0.2, timeout_s=120)
    for o, t in zip(ours, ranks["capped"]):
        assert o.losses == t.losses and o.peak == t.peak
        ready = max(e.seconds for e in o.timeline if e.kind == "ready")
        launches = [e.seconds for e in o.timeline if e.kind == "launch"]
        assert len(launches) > 1 and sum(s < ready for s in launches) == len(launches) - 1
