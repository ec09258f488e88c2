"""ZeRO stages 1, 2 and 3 (labkit.parallel.data.zero_step) on a real gloo cluster equal one
process."""
import pytest
import torch

import labkit as lk
from labkit.parallel import cluster
from labkit.parallel.data.zero import shard
from labkit.parallel.data.zero_step import ZeroOptimizer, paper_bytes, zero_steps
from zero_targets import fresh_model, train_reference, train_zero

STAGES = (1, 2, 3)
# One cluster run per N (N = 4 starts in seconds: share it). fp32 for every N; fp64 at N = 4,
# where gloo sums 4 gradients in another order than rank order (see test_parameters_...).
RUNS = {1: [(s, "fp32") for s in STAGES],
        2: [(s, "fp32") for s in STAGES] + [(2, "bf16-master"), (3, "bf16-master")],
        4: [(s, p) for p in ("fp32", "fp64") for s in STAGES]}
# The same sums (N = 1, 2: exactly the same; N = 4 fp64: in another order): a few ulps.
TOL = {"fp32": dict(rtol=1e-5, atol=1e-6), "fp64": dict(rtol=1e-10, atol=1e-12)}


@pytest.fixture(scope="module", params=sorted(RUNS))
def ranks(request):
    n = request.param
    return n, cluster.run(train_zero, n, RUNS[n], timeout_s=180)


@pytest.fixture(scope="module")
def reference():
    """One process: torch's AdamW on the mean of the N slices' gradients (n = 1: whole batch)."""
    cache = {}

    def get(precision, n):
        if (precision, n) not in cache:
            cache[precision, n] = train_reference(precision, n)
        return cache[precision, n]
    return get


def losses_of(results, key):
    """The global batch's loss per step: the mean of the ranks' losses on equal slices."""
    return torch.tensor([r[key]["losses"] for r in results]).mean(0)


@pytest.mark.parametrize("stage", STAGES)
def test_losses_equal_one_process(ranks, reference, stage):
    n, results = ranks
    ref_losses, _ = reference("fp32", n)
    torch.testing.assert_close(losses_of(results, (stage, "fp32")), torch.tensor(ref_losses),
                               **TOL["fp32"])
    # and one backward over the whole batch: equal at step 0; after that, AdamW's g / sqrt(v)
    # turns round-off in near-zero gradients into updates of O(lr): ~1e-5 relative in the loss
    whole, _ = reference("fp32", 1)
    torch.testing.assert_close(losses_of(results, (stage, "fp32")), torch.tensor(whole),
                               rtol=1e-4, atol=0)


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_equal_one_process(ranks, reference, stage):
    """Every rank ends with the same all-gathered parameters as one process. In fp32 at N = 4
    the sum order differs and AdamW amplifies that (a near-zero gradient's update can flip
    sign: up to lr apart), so N = 4 is compared in fp64, where the same code is exact enough."""
    n, results = ranks
    precision = "fp64" if n == 4 else "fp32"
    _, ref_params = reference(precision, n)
    for r in results:
        for p, q in zip(r[stage, precision]["params"], ref_params):
            torch.testing.assert_close(p, q, **TOL[precision])


@pytest.mark.parametrize("stage", STAGES)
def test_state_and_communication_bytes(ranks, stage):
    n, results = ranks
    for r in results:
        got = r[stage, "fp32"]
        k = got["shard_numel"]         # this rank's elements: Ψ/N rounded up, per unit at stage 3
        if stage == 1:
            assert k == shard(got["numel"], n)
        else:                          # stages 2, 3: each unit padded to a multiple of N on its own
            assert shard(got["numel"], n) <= k <= shard(got["numel"], n) + got["units"]
        assert got["state_bytes"] == k * 8                      # exp_avg + exp_avg_sq, fp32
        assert got["master_bytes"] == 0                         # fp32: no copy of the shard
        # after the step: full parameters unless stage 3; no full gradients
        assert got["param_bytes"] == (0 if stage == 3 else k * n * 4)
        assert got["grad_bytes"] == 0
        # after a backward: the whole gradient at stage 1, only the shards from stage 2 on
        assert got["grads_after_backward"] == (k * n * 4 if stage == 1 else k * 4)
        gathers = 2 if stage == 3 else 1                        # stage 3: before fwd and bwd
        for sent in got["sent"]:                                # per step
            assert sent.get("reduce_scatter", 0) == (n - 1) * k * 4
            assert sent.get("all_gather", 0) == gathers * (n - 1) * k * 4
            # a ring sends (N - 1) / N of the paper's 2Ψ / 3Ψ (Ψ padded), exactly
            assert sum(sent.values()) * n == paper_bytes(k * n, stage, 4) * (n - 1)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_master(ranks, reference, stage):
    """bf16 weights and gradients on the wire, fp32 master and AdamW state per shard."""
    n, results = ranks
    if n != 2:
        pytest.skip("bf16-master runs in the N = 2 cluster run")
    ref_losses, _ = reference("bf16-master", 2)
    gathers = 2 if stage == 3 else 1
    for r in results:
        got = r[stage, "bf16-master"]
        k = got["shard_numel"]
        assert got["state_bytes"] == k * 8 and got["master_bytes"] == k * 4
        assert all(sum(s.values()) == (1 + gathers) * (n - 1) * k * 2 for s in got["sent"])
        assert all(p.dtype == torch.bfloat16 for p in got["params"])
    # bf16 gradients summed over the wire round once more than one process's: 2e-2 relative
    torch.testing.assert_close(losses_of(results, (stage, "bf16-master")),
                               torch.tensor(ref_losses), rtol=2e-2, atol=0)


@pytest.mark.parametrize("stage", [0, 4, "1"])
def test_bad_stage(stage):
    with pytest.raises(ValueError, match="stage"):
        ZeroOptimizer(fresh_model(), None, stage)


def test_bad_group_precision_dtype():
    with pytest.raises(ValueError, match="ctx.group"):
        ZeroOptimizer(fresh_model(), None, 1)
    with pytest.raises(ValueError, match="precision"):
        ZeroOptimizer(fresh_model(), None, 1, precision="fp16")
    with pytest.raises(ValueError, match="dtype=torch.bfloat16"):
        ZeroOptimizer(fresh_model(), None, 1, precision="bf16-master")
    with pytest.raises(ValueError, match="blocks"):
        ZeroOptimizer(torch.nn.Linear(2, 2), None, 3)
    model = fresh_model()
    model.recompute[0] = True
    with pytest.raises(ValueError, match="recompute"):
        ZeroOptimizer(model, None, 3)


# ---- the estimate predicts each rank's peak ------------------------------------------------
# model states set the peak (small at 1 x 32: the buckets, gathers and gloo's copies), and an
# MoE model where activations do; every stage, fp32 and master weights
PER_RANK = [(s, "small", 1, 32, p, False) for p in ("fp32", "bf16-master") for s in STAGES] + [
    (s, "tiny-moe", 2, 64, "fp32", False) for s in STAGES]
OFFLOADED = [(s, "small", 1, 32, p, True) for p in ("fp32", "bf16-master") for s in STAGES]


def _estimate(n, stage, model, batch, seq, precision, offload):
    return lk.estimate(model, batch, seq, precision=precision, device="cpu",
                       layout=lk.Layout(dp=n, zero_stage=stage, offload=offload))


def _predicted_within_3_percent(n):
    """Every rank within 3%, but now and then (more often on a busy machine) gloo's worker
    thread lets go of a finished collective's buffer a moment late, and one rank's peak holds
    it too: the ranks' lowest peak within 3%, every rank's within 3% + the largest buffer."""
    ranks = cluster.run(zero_steps, n, PER_RANK, timeout_s=600)
    for i, setting in enumerate(PER_RANK):
        est = _estimate(n, *setting)
        peaks = [steps[i].peak for steps in ranks]
        assert all(sum(steps[i].sent.values()) == est.details["bytes sent per step"]
                   for steps in ranks), setting
        assert min(peaks) == pytest.approx(est.total, rel=0.03), setting
        assert max(peaks) <= 1.03 * est.total + _largest_bucket(est), setting


def _largest_bucket(est):
    """The largest buffer a collective of this step sends (fp32 at most): a unit's bucket or
    its gathered parameters, or gloo's copy of either."""
    return 4 * est.details.get("largest unit (elements)", 0)


def test_estimate_gives_each_ranks_peak_within_3_percent_n2():
    _predicted_within_3_percent(2)


@pytest.mark.slow
def test_estimate_gives_each_ranks_peak_within_3_percent_n4():
    _predicted_within_3_percent(4)


def test_offload_moves_the_shards_to_the_host_and_trains_the_same():
    """ZeRO-Offload: the optimizer state, master shards and gradient shards (and from stage 3
    the parameter shards) counted as host memory, as the estimate says to the byte, with the
    bytes copied each way per step; the losses are those of the same run kept on the device."""
    kept_on_device = [(*setting[:-1], False) for setting in OFFLOADED]
    ranks = cluster.run(zero_steps, 2, OFFLOADED + kept_on_device, timeout_s=600)
    for i, setting in enumerate(OFFLOADED):
        est, kept = _estimate(2, *setting), _estimate(2, *setting[:-1], False)
        for steps in ranks:
            got, on_device = steps[i], steps[i + len(OFFLOADED)]
            assert got.peak == pytest.approx(est.total, rel=0.03), setting
            assert got.peak < on_device.peak and est.total < kept.total
            assert got.host_peak == est.details["host memory"]
            assert got.sent["host <-> device"] == est.details["host <-> device bytes per step"]
            assert got.losses == on_device.losses


def test_offload_needs_zero():
    with pytest.raises(ValueError, match="zero_stage 1, 2 or 3"):
        lk.Layout(dp=8, offload=True)


def test_a_parameter_without_gradient_is_named_not_silently_skipped():
    from zero_targets import step_with_a_missing_gradient
    for message in cluster.run(step_with_a_missing_gradient, 1, 2):
        assert message and "got no gradient" in message and "requires_grad=False" in message


# ---- LoRA: ZeRO shards what trains, the adapters; the frozen base stays whole -----------------
LORA = [(s, "small", 1, 32, p, off, 8) for p in ("fp32", "bf16-master")
        for s, off in ((0, False), (1, False), (2, False), (1, True), (2, True))]


def test_lora_under_zero_1_and_2_is_the_estimate_and_trains_as_zero_1():
    """Measured within 0.01% of the estimate on both ranks (the adapters' states are ~2% of
    the step), bytes sent and host memory to the byte; ZeRO-2 and the offloaded runs train as
    ZeRO-1 does (DDP's AdamW has other hyperparameters)."""
    ranks = cluster.run(zero_steps, 2, LORA, timeout_s=600)
    for i, (stage, model, batch, seq, precision, offload, r) in enumerate(LORA):
        est = lk.estimate(model, batch, seq, precision=precision, device="cpu",
                          trainable="lora", lora_rank=r,
                          layout=lk.Layout(dp=2, zero_stage=stage, offload=offload))
        zero1 = LORA.index((1, model, batch, seq, precision, False, r))
        # as above: a rank's peak may hold a finished bucket gloo let go of late
        peaks = [steps[i].peak for steps in ranks]
        assert min(peaks) == pytest.approx(est.total, rel=1e-3), LORA[i]
        assert max(peaks) <= 1.001 * est.total + _largest_bucket(est), LORA[i]
        for steps in ranks:
            got = steps[i]
            sent = {k: v for k, v in got.sent.items() if k != "host <-> device"}
            assert sum(sent.values()) == est.details["bytes sent per step"], LORA[i]
            if offload:
                assert got.host_peak == est.details["host memory"]
                assert got.sent["host <-> device"] == est.details["host <-> device bytes per step"]
            if stage and i != zero1:
                assert got.losses == pytest.approx(steps[zero1].losses, rel=1e-6), LORA[i]


def test_zero_3_of_a_frozen_base_points_to_fsdp2():
    from labkit.quantisation.lora import apply_lora
    model = fresh_model()
    apply_lora(model, 4, 8)
    with pytest.raises(ValueError, match="shard it with FSDP2"):
        ZeroOptimizer(model, None, 3)


# ---- HSDP: ZeRO inside a node, replicated across ---------------------------------------------
@pytest.mark.slow
def test_hsdp_on_2_x_2_ranks_trains_as_zero_over_4_and_is_the_estimate():
    """Two nodes of two ranks: each stage trains as ZeRO over all four (the same sums in another
    order), each rank holds what ZeRO over two holds, and sends what the estimate with
    ``replicas=2`` says to the byte: the reduce-scatters and all-gathers inside the node, then
    each gradient shard all-reduced across (2 (R - 1) / R of it)."""
    cases = [(s, "small", 1, 32, "fp32", False, 0, nodes) for s in STAGES for nodes in (1, 2)]
    ranks = cluster.run(zero_steps, 4, cases, timeout_s=600)
    for i in range(0, len(cases), 2):
        stage = cases[i][0]
        for steps in ranks:
            torch.testing.assert_close(steps[i + 1].losses, steps[i].losses, **TOL["fp32"])
        est = lk.estimate("small", 1, 32, precision="fp32", device="cpu",
                          layout=lk.Layout(dp=4, zero_stage=stage, replicas=2))
        assert est.total == _estimate(2, stage, "small", 1, 32, "fp32", False).total
        for steps in ranks:
            hsdp = steps[i + 1]
            assert hsdp.sent["all_reduce"] > 0 and sum(hsdp.sent.values()) == \
                est.details["bytes sent per step"], stage
            assert hsdp.peak == pytest.approx(est.total, rel=0.03), stage


def test_replicas_are_named_when_they_cannot_be_modelled():
    for layout, match in ((dict(dp=4, replicas=2), "zero_stage=3 \\(or 1, 2\\)"),
                          (dict(dp=4, zero_stage=3, replicas=3), "divide dp x cp"),
                          (dict(dp=4, zero_stage=3, replicas=4), "2 or more ranks"),
                          (dict(dp=8, zero_stage=3, ep=2, replicas=2), "expert parallelism")):
        with pytest.raises(ValueError, match=match):
            lk.Layout(**layout)
    with pytest.raises(ValueError, match="full fine-tuning"):
        lk.estimate("small", layout=lk.Layout(dp=4, zero_stage=3, replicas=2), trainable="lora")
