"""Every technique composes with every other in the estimate (issue 28). Over the cross product of
what it models, ``lk.estimate`` answers with bytes that add up and move the right way, or it
refuses with one of the few ValueErrors listed here, each saying why."""
import itertools
import re

import pytest

import labkit as lk
from labkit.core.units import HOST

CFG = lk.preset("tiny-moe")      # an MoE, so every axis applies: 4 heads, 3 layers, 8 experts
SEQ = 64

# what the estimate refuses, and the gist of its ValueError: two meaningless combinations.
# Keep this list short; CONTRIBUTING.md lists it for users.
REFUSED = {
    "offload without ZeRO (meaningless: nothing is sharded)": r"offload=True keeps ZeRO's shards",
    "sp without tp (meaningless: sp splits over the tp group)": r"sequence parallelism \(sp=True\)",
}
TRAINABLE = {"full": {}, "lora": dict(trainable="lora"),
             "qlora": dict(trainable="lora", weight_format="nf4")}
AXES = dict(
    trainable=list(TRAINABLE),
    precision=["bf16-master"],       # autocast's copies: test_lora, test_tensor, test_estimate
    optimizer=["adamw", "adamw-8bit", "sgd"],
    recompute=["none", "selective", "full"],
    zero=[(0, False), (1, False), (2, False), (3, False), (0, True), (1, True), (3, True)],
    tp_sp=[(1, False), (1, True), (2, False), (2, True)],
    pp=[1, 2],
    ep=[1, 2],
    cp=[1, 2],
)
CATEGORIES = ("params", "grads", "optimizer", "activations", "weight_cache", "other")


def run(case: dict):
    """The estimate of one combination (dp 2, CUDA's defaults), or the ValueError it raised."""
    (zero, offload), (tp, sp) = case["zero"], case["tp_sp"]
    try:
        recipe = lk.Recipe(case["precision"], optimizer=case["optimizer"],
                           recompute=case["recompute"], **TRAINABLE[case["trainable"]])
        layout = lk.Layout(dp=2, zero_stage=zero, offload=offload, tp=tp, sp=sp, pp=case["pp"],
                           ep=case["ep"], cp=case["cp"])
        return lk.estimate(CFG, 1, SEQ, recipe=recipe, layout=layout, device="cuda")
    except ValueError as error:
        return error


@pytest.fixture(scope="module")
def results() -> dict:
    """tuple of axis values -> Estimate or ValueError, over the whole cross product."""
    return {values: run(dict(zip(AXES, values))) for values in itertools.product(*AXES.values())}


def refusal(error: ValueError) -> str | None:
    return next((name for name, gist in REFUSED.items() if re.search(gist, str(error))), None)


def test_every_combination_is_estimated_or_refused_for_a_listed_reason(results):
    unlisted = {k: str(v) for k, v in results.items()
                if isinstance(v, ValueError) and refusal(v) is None}
    assert not unlisted, list(unlisted.items())[:3]
    hit = {refusal(v) for v in results.values() if isinstance(v, ValueError)}
    assert hit == set(REFUSED)                       # no reason on the list that never applies
    # full fine-tuning composes with everything
    full = {refusal(v) for k, v in results.items() if k[0] == "full" and isinstance(v, ValueError)}
    assert full == {name for name in REFUSED if "meaningless" in name}


def test_every_estimate_adds_up(results):
    """Whole non-negative bytes per category that sum to the total, as do the named tensors on
    the device (offload's are in host memory), the peak in a named phase."""
    for key, est in results.items():
        if isinstance(est, ValueError):
            continue
        parts = [getattr(est, c) for c in CATEGORIES]
        assert all(type(p) is int and p >= 0 for p in parts), (key, parts)
        assert sum(parts) == est.total > 0, key
        assert est.peak_phase in ("forward", "backward", "optimizer"), key
        assert sum(t.nbytes for t in est.tensors if t.category != HOST) == est.total, key


def _pairs(results, axis: str, lower, higher):
    """(estimate with ``lower``, estimate with ``higher`` on ``axis``), everything else equal,
    where both answered."""
    i = list(AXES).index(axis)
    for key, est in results.items():
        if key[i] != lower or isinstance(est, ValueError):
            continue
        other = results[key[:i] + (higher,) + key[i + 1:]]
        if not isinstance(other, ValueError):
            yield key, est, other


def _states(est) -> int:
    return sum(est.details["model states"].values())


@pytest.mark.parametrize("lower, higher", [((0, False), (1, False)), ((1, False), (2, False)),
                                           ((2, False), (3, False))])
def test_each_zero_stage_holds_no_more_model_states_than_the_one_before(results, lower, higher):
    pairs = list(_pairs(results, "zero", lower, higher))
    assert pairs
    for key, a, b in pairs:
        assert _states(b) <= _states(a), key


@pytest.mark.parametrize("lower, higher", [("none", "selective"), ("selective", "full")])
def test_more_recomputation_saves_no_more_activations(results, lower, higher):
    """On this model. Not a law under LoRA: labkit's selective policy keeps every matmul's
    output, which a frozen linear's backward never needs, so on LLaMA-2-7B at 2048 tokens it
    keeps more than no recompute does (11.67 GiB against 10.70)."""
    pairs = list(_pairs(results, "recompute", lower, higher))
    assert pairs
    for key, a, b in pairs:
        assert b.saved_activations <= a.saved_activations, key


@pytest.mark.parametrize("axis", ["tp_sp", "pp", "ep"])
def test_splitting_the_model_holds_no_more_parameters(results, axis):
    """tp (with or without sp), pp and ep each leave a rank no more weights than without them."""
    lower, higher = {"tp_sp": ((1, False), (2, False)), "pp": (1, 2), "ep": (1, 2)}[axis]
    pairs = list(_pairs(results, axis, lower, higher))
    assert pairs
    for key, a, b in pairs:
        assert b.details["parameters on this device"] <= a.details["parameters on this device"]
