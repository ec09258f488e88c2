"""Expert tensor parallelism (labkit.parallel.expert.expert_tensor) on 2 and 4 local gloo ranks,
tiny-moe: each expert's SwiGLU split over etp = 2 ranks, inside ep = 1 or 2. It trains as one
process on all the rows, and each rank's parameters, bytes sent and peak are what
``labkit.estimate(..., layout=Layout(dp=world, ep=world // 2, etp=2))`` says."""
from functools import partial

import pytest
import torch

import labkit as lk
from labkit.parallel import cluster
from labkit.parallel.expert import expert_tensor as et
from labkit.parallel.expert.expert_parallel import build, ep_dp_step, one_process

CFG = lk.preset("tiny-moe")
SEQ, STEP_SEQ, HOT = 32, 64, 1.0
PRECISIONS = ("fp32", "bf16-mixed")
FP64 = 1e-12               # fp64 round-off: sums over rows in another order and grouping


def figures(ctx) -> dict:
    """One rank under ep = world / 2 x etp = 2: fp64 forward-backward (unbiased and skewed
    routers) and one steady step per precision; on 4 ranks also a skewed step, and ep 4's."""
    out = {"fp64": et.etp_forward_backward(ctx, 2, seq=SEQ, dtype=torch.float64),
           "skewed": et.etp_forward_backward(ctx, 2, seq=SEQ, dtype=torch.float64, hot=HOT),
           **{p: et.etp_step(ctx, 2, seq=STEP_SEQ, precision=p) for p in PRECISIONS}}
    if ctx.world_size == 4:               # every token to experts 0-1, then to experts 0-3
        for hot_ep in (4, 2):
            out[f"hot etp {hot_ep}"] = et.etp_step(ctx, 2, hot_ep, batch=2, seq=STEP_SEQ, hot=HOT)
            out[f"hot ep 4 {hot_ep}"] = ep_dp_step(ctx, 4, batch=2, seq=STEP_SEQ, hot=HOT,
                                                   builder=partial(build, hot_ep=hot_ep))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["ep1-etp2", "ep2-etp2"])
def world(request):
    return request.param, cluster.run(figures, request.param, timeout_s=240)


def estimate(world: int, precision: str, **layout):
    return lk.estimate(CFG, 1, STEP_SEQ, precision=precision, device="cpu",
                       layout=lk.Layout(dp=world, ep=world // 2, etp=2, **layout))


def _close(a, b) -> bool:
    return (a - b).abs().max().item() <= FP64 * b.abs().max().item()


@pytest.mark.parametrize("case, hot", [("fp64", None), ("skewed", HOT)])
def test_output_and_every_gradient_equal_one_process(world, case, hot):
    """Rank r = (shard s, slice t): its logits are the one-process logits of its rows, its
    replicated gradients the one-process ones, its experts' those of experts [s E/ep, (s + 1)
    E/ep) cut to ffn slice t (rows of w_gate and w_up, columns of w_down). "skewed": every
    token picks experts among the first E / (ep x etp) (2 of 8 at ep 2, 4 at ep 1)."""
    n, ranks = world
    ep, f = n // 2, CFG.moe_ffn // 2
    ref, per = one_process(n, seq=SEQ, dtype=torch.float64, hot=hot, ep=n), CFG.routed_experts // ep
    for r, got in enumerate(rank[case] for rank in ranks):
        s, t = divmod(r, 2)
        assert _close(got["logits"][0], ref["logits"][r])
        assert len(got["grads"]) == len(ref["grads"])
        for name, grad in got["grads"].items():
            want = ref["grads"][name.replace(".experts.local.", ".experts.")]
            if ".experts.local." in name:
                want = want[s * per:(s + 1) * per]
                want = want[:, :, t * f:(t + 1) * f] if name.endswith("w_down") else want[:, t * f:(t + 1) * f]
            assert grad.shape == want.shape and _close(grad, want), name
    assert sum(rank[case]["loss"] for rank in ranks) / n == pytest.approx(ref["loss"], rel=FP64)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_parameters_are_those_of_ep_x_etp_way_expert_parallelism(world, precision):
    """Each rank holds 1/(ep x etp) of every expert, as ep x etp-way expert parallelism does:
    the weights and optimizer state exactly the estimate's, and the estimate's parameters are
    Layout(ep=ep x etp)'s."""
    n, ranks = world
    est = estimate(n, precision)
    plain = lk.estimate(CFG, 1, STEP_SEQ, precision=precision, device="cpu",
                        layout=lk.Layout(dp=n, ep=n))
    assert est.params == plain.params and est.optimizer == plain.optimizer
    for step in (rank[precision] for rank in ranks):
        assert step.param_bytes == step.peak_by_category["params"] == est.params
        assert step.peak_by_category["optimizer"] == est.optimizer
        assert step.expert_bytes == 4 * CFG.moe_layers * 3 * CFG.routed_experts // n * \
            CFG.hidden * CFG.moe_ffn


@pytest.mark.parametrize("precision", PRECISIONS)
def test_bytes_sent_are_the_estimates_where_routing_is_balanced(world, precision):
    """ep 1: each rank's rows are the gathered half, so every message is the estimate's to the
    byte. ep 2 (rows routed as the router likes): the all-reduce and the counts exactly; over
    each etp group, the rows gathered are the rows whose partial outputs come back, and over
    all ranks the gathers send (etp - 1) x the rows the estimate assumes."""
    n, ranks = world
    want = estimate(n, precision).details["bytes sent per step, by message"]
    steps = [rank[precision] for rank in ranks]
    for step in steps:
        assert {k: step.sent[k] for k in ("all_reduce", "counts", "counts (etp)")} == \
            {k: want[k] for k in ("all_reduce", "counts", "counts (etp)")}
        if n == 2:
            assert step.sent == {k: v for k, v in want.items() if k in step.sent}
    for group in (steps[0:2], steps[2:4]) if n == 4 else (steps,):
        got = {k: sum(s.sent[k] for s in group) for k in want}
        ratio = want["reduce-scatter (etp)"] / want["gather (etp)"]
        assert got["reduce-scatter (etp)"] == ratio * got["gather (etp, backward)"]
        assert got["reduce-scatter (etp, backward)"] == ratio * got["gather (etp)"]
    assert sum(s.sent["gather (etp)"] for s in steps) == n * want["gather (etp)"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_rank_peak_is_the_estimate(world, precision):
    """ep 1 (the two ranks gather the same rows): within 1% (measured 0.04% in bf16-mixed, in
    the backward pass as the estimate says; in fp32 0.5% above, in the forward pass: a transient
    of the last MoE layer's forward the estimate does not count). ep 2: within 3%, the routing
    of these rows not quite balanced (measured within 2.8%)."""
    n, ranks = world
    est = estimate(n, precision)
    for step in (rank[precision] for rank in ranks):
        assert abs(step.peak - est.total) <= (0.01 if n == 2 else 0.03) * est.total, (step, est)
        if precision == "bf16-mixed" and n == 2:
            assert step.peak_phase == est.peak_phase == "backward"


def test_skew_on_one_ep4_ranks_experts_is_spread_and_on_one_shard_is_not(world):
    """Every token to experts 0-1 (one ep-4 rank's): under ep 2 x etp 2 two ranks each run half
    of their SwiGLU, the busiest rank holds less (6.20 against 6.28 MiB in fp32). To experts
    0-3 (one etp group's shard): both of its ranks run them all and gather every row, the
    busiest holds more (6.20 against 5.30 MiB)."""
    n, ranks = world
    if n != 4:
        pytest.skip("ep 4 needs 4 ranks")
    busiest = {key: max(r[key].peak for r in ranks)
               for key in ("hot etp 4", "hot ep 4 4", "hot etp 2", "hot ep 4 2")}
    assert busiest["hot etp 4"] < busiest["hot ep 4 4"]
    assert busiest["hot etp 2"] >= busiest["hot ep 4 2"]


def test_the_activations_at_the_peak_are_the_estimates(world):
    """ep 1 x etp 2 in bf16-mixed (each rank gathers both ranks' rows, the peak in the backward
    pass): the activations measured at the peak, gathered rows included, within 1% of the
    estimate's."""
    n, ranks = world
    if n != 2:
        pytest.skip("the 2-rank run gathers balanced rows")
    est = estimate(2, "bf16-mixed")
    for step in (rank["bf16-mixed"] for rank in ranks):
        got = step.peak_by_category["activations"]
        assert abs(got - est.activations) <= 0.01 * est.activations, (got, est.activations)


def test_the_gathered_rows_are_what_etp_adds_to_the_activations():
    """Against ep x etp-way expert parallelism, etp 2 keeps each MoE layer's rows twice: the
    sorted input (h numbers) and the permutations (16 B) per extra row; the SwiGLU (4 f) stays."""
    for precision in PRECISIONS:
        etp = estimate(4, precision, ddp_buckets=False)
        plain = lk.estimate(CFG, 1, STEP_SEQ, precision=precision, device="cpu",
                            layout=lk.Layout(dp=4, ep=4))
        rows = CFG.moe_layers * STEP_SEQ * CFG.top_k
        width = 4      # fp32: the rows; autocast: their bf16 copies for w_gate's and w_up's matmuls
        assert etp.saved_activations - plain.saved_activations == rows * (CFG.hidden * width + 16)


@pytest.mark.parametrize("layout, match", [
    (dict(dp=4, ep=2, etp=2, tp=2), "with tp 1 only.*use etp=1, or tp=1"),
    (dict(dp=6, ep=2, etp=2), "must divide dp=6"),
    (dict(dp=4, ep=2, etp=2, zero_stage=1), "use zero_stage=0"),
    (dict(dp=8, ep=2, etp=2, pp=2), "pp=1"),
    (dict(dp=4, etp=0), "etp"),
])
def test_bad_layouts_name_the_fix(layout, match):
    with pytest.raises(ValueError, match=match):
        lk.Layout(**layout)


@pytest.mark.parametrize("model, kwargs, match", [
    ("tiny", {}, "dense model with no routed experts"),
    ("tiny-moe", dict(recompute="selective"), "recompute 'none'"),
    ("tiny-moe", dict(trainable="lora"), "full fine-tuning"),
])
def test_bad_steps_name_the_fix(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        lk.estimate(model, 1, 64, layout=lk.Layout(dp=2, etp=2), **kwargs)


def test_the_mechanism_refuses_what_it_does_not_run():
    with pytest.raises(ValueError, match="must be the 4 ranks"):
        et.check_etp(CFG, 4, 1, 2)
    with pytest.raises(ValueError, match="divide the experts' ffn width"):
        et.check_etp(CFG, 6, 2, 3)
