"""A step as a Recipe and a Layout: the keyword form and the dataclass form agree, every
layout splits the model into real stages, and the estimate explains itself tensor by tensor."""
import inspect

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import labkit as lk
from labkit.core.recipe import PRECISIONS, state_bytes
from labkit.parallel.data import zero
from labkit.parallel.pipeline import pipeline_parallel as pipeline


@given(layers=st.integers(1, 200), data=st.data())
def test_every_pipeline_split_gives_non_empty_balanced_contiguous_stages(layers, data):
    pp = data.draw(st.integers(1, layers))
    stages = pipeline.stage_layers(layers, pp)
    sizes = [len(s) for s in stages]
    assert len(stages) == pp and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert [i for s in stages for i in s] == list(range(layers))


def test_the_reviewed_splits():
    assert [len(s) for s in pipeline.stage_layers(5, 4)] == [2, 1, 1, 1]         # was 2,2,1,0
    assert [len(s) for s in pipeline.stage_layers(32, 6)] == [6, 6, 5, 5, 5, 5]   # was ...,2


def test_1f1b_keeps_at_most_pp_minus_stage_micro_batches_and_gpipe_all():
    assert [pipeline.in_flight(s, 4, 8, "1f1b") for s in range(4)] == [4, 3, 2, 1]
    assert [pipeline.in_flight(s, 4, 2, "1f1b") for s in range(4)] == [2, 2, 2, 1]
    assert [pipeline.in_flight(s, 4, 8, "gpipe") for s in range(4)] == [8] * 4


def test_gpipe_holds_more_activations_than_1f1b_on_the_first_stage():
    one_f = lk.estimate("llama-2-7b", seq=4096, layout=lk.Layout(pp=4, micro_batches=8))
    gpipe = lk.estimate("llama-2-7b", seq=4096, layout=lk.Layout(pp=4, micro_batches=8,
                                                                 schedule="gpipe"))
    assert gpipe.saved_activations > 1.9 * one_f.saved_activations


def test_a_zero_shard_rounds_up_so_every_rank_holds_its_share():
    assert zero.shard(10, 3) == 4 and zero.shard(12, 3) == 4
    assert zero.per_rank(10, "optimizer", 1, 3) == 4 and zero.per_rank(10, "grads", 1, 3) == 10


def test_keywords_and_recipe_with_layout_give_the_same_estimate():
    by_keywords = lk.estimate("deepseek-v2-lite", batch=2, seq=1024, precision="bf16-master",
                              recompute="full", zero_stage=2, dp=8, tp=2, pp=3)
    by_objects = lk.estimate("deepseek-v2-lite", batch=2, seq=1024,
                             recipe=lk.Recipe("bf16-master", recompute="full"),
                             layout=lk.Layout(dp=8, zero_stage=2, tp=2, pp=3))
    assert by_keywords == by_objects


def test_estimate_and_measure_step_take_the_same_arguments():
    est = inspect.signature(lk.estimate).parameters
    measured = inspect.signature(lk.measure_step).parameters
    only_measured = {"fake", "warmup", "seed", "loss_fn", "events", "then"}   # how it runs
    assert set(measured) - set(est) == only_measured and set(est) <= set(measured)
    assert all(est[name].default == measured[name].default for name in est
               if name not in ("device", "cfg"))           # measure_step: the machine's device


def test_a_keyword_that_agrees_with_the_recipe_or_keeps_its_default_is_accepted():
    recipe = lk.Recipe("bf16", recompute="full", trainable="lora")
    assert lk.estimate("tiny", seq=64, recipe=recipe) == lk.estimate(
        "tiny", seq=64, precision="bf16", recompute="full", recipe=recipe) == lk.estimate(
        "tiny", seq=64, precision="bf16", recompute="full", trainable="lora")


def test_devices_and_numpy_integers_are_taken_as_users_write_them():
    base = lk.estimate("small", batch=2, seq=128, layout=lk.Layout(dp=2, zero_stage=1))
    assert lk.estimate("small", batch=np.int64(2), seq=np.int32(128), device="cuda:1",
                       layout=lk.Layout(dp=np.int64(2), zero_stage=1)) == base
    assert lk.estimate("small", batch=2, seq=128, device=torch.device("cuda", 0),
                       layout=lk.Layout(dp=2, zero_stage=1)) == base
    assert type(lk.Layout(dp=np.int64(4)).dp) is int and type(lk.Recipe(every=np.int8(3)).every) is int
    one = lk.measure_step("tiny", seq=32, fake=False, device="cpu")
    assert lk.measure_step("tiny", seq=np.int64(32), fake=False, device=torch.device("cpu"),
                           layout=lk.Layout()).total == one.total


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_tensors_alive_at_the_peak_add_up_to_every_category(precision):
    e = lk.estimate("tiny-moe", batch=2, seq=256, precision=precision)
    for category in lk.CATEGORIES:
        assert sum(t.nbytes for t in e.tensors if t.category == category) == getattr(e, category)
    assert e.explain().count("\n") + 1 == len(e.tensors)


def test_autocast_weight_copies_are_their_own_category_not_activations():
    mixed = lk.estimate("llama-2-7b", seq=4096, batch=4, precision="bf16-mixed")
    n = lk.count_params("llama-2-7b").total
    embedding = 32000 * 4096                               # looked up, never cast
    assert mixed.weight_cache == 2 * (n - embedding - 65 * 4096)    # every matmul weight, bf16
    assert lk.estimate("llama-2-7b", seq=4096, batch=4, precision="bf16").weight_cache == 0


def test_state_bytes_follow_the_table_of_precisions():
    assert state_bytes("bf16-master").total == 16 and state_bytes("bf16-mixed").total == 16
    assert state_bytes("bf16-mixed").weight_cache == 2 and state_bytes("bf16").total == 8


@pytest.mark.parametrize("make, message", [
    (lambda: lk.Layout(ep=0), "ep must be a positive integer"),
    (lambda: lk.Layout(zero_stage=5), "zero_stage must be 0, 1, 2 or 3"),
    (lambda: lk.Layout(schedule="zb"), "unknown schedule 'zb'"),
    (lambda: lk.Layout(schedule="interleaved"), "interleaved 1F1B needs virtual_stages >= 2"),
    (lambda: lk.Layout(pp=4, virtual_stages=2), "every other schedule 1"),
    (lambda: lk.Layout(pp=4, micro_batches=6, schedule="interleaved", virtual_stages=2),
     "multiples of 4"),
    (lambda: lk.Layout(schedule="zb-v"), "it needs pp >= 2"),
    (lambda: lk.Layout(pp=4, micro_batches=6, schedule="dualpipe-v"),
     "choose micro_batches=8"),
    (lambda: lk.estimate("tiny", layout=lk.Layout(pp=4, micro_batches=8, schedule="zb-v")),
     r"pp=4 x 2 chunks \(a V\) is larger than layers"),
    (lambda: lk.Recipe(precision="fp8"), "unknown precision 'fp8'"),
    (lambda: lk.Recipe(optimizer_impl="cuda-graph"), "unknown optimizer implementation"),
    (lambda: lk.Recipe(weight_format="nf4"), "pass trainable='lora'"),
    (lambda: lk.estimate("llama-2-7b", layout=lk.Layout(dp=2, ep=2)), "ep=2 must divide the routed experts"),
    (lambda: lk.Layout(ep=2), r"choose dp among the multiples of 2 \(e.g. Layout\(dp=2, ep=2\)\)"),
    (lambda: lk.Layout(dp=6, ep=4), "choose dp among the multiples of 4"),
    (lambda: lk.estimate("llama-2-7b", zero_stage=1, layout=lk.Layout(dp=8)), "not both"),
    (lambda: lk.estimate("deepseek-v2-lite", layout=lk.Layout(dp=3, ep=3)), "ep=3 must divide"),
    (lambda: lk.estimate("llama-2-7b", seq=1000, layout=lk.Layout(cp=3)), "seq=1000 must be divisible"),
    (lambda: lk.estimate("llama-2-7b", device="tpu"), "unknown device 'tpu'"),
    (lambda: lk.estimate("tiny", precision="fp32", recipe=lk.Recipe("bf16")),
     r"not both: precision='fp32' \(the recipe has 'bf16'\)"),
    (lambda: lk.measure_step("tiny", seq=32, recompute="full", recipe=lk.Recipe("bf16")),
     r"not both: recompute='full' \(the recipe has 'none'\)"),
    (lambda: lk.measure_step("tiny", seq=32, zero_stage=1, layout=lk.Layout()), "not both"),
    (lambda: lk.measure_step("tiny", seq=32, layout=lk.Layout(dp=8, zero_stage=3)),
     "measures one device's step; dp=8 spreads it over ranks"),
    (lambda: lk.measure_step("tiny", seq=32, tp=2), "tp=2 spreads it over ranks"),
    (lambda: lk.measure_step("tiny", seq=32, device="tpu"),
     "unknown device 'tpu'"),
    (lambda: lk.estimate("tiny", batch=2.0), "batch must be a positive integer"),
    (lambda: lk.Layout(dp=np.bool_(True)), "dp must be a positive integer"),
])
def test_bad_layouts_and_recipes_name_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_expert_parallelism_splits_the_routed_experts_only():
    one = lk.estimate("deepseek-v2-lite", layout=lk.Layout(ep=1)).details["parameters on this device"]
    eight = lk.estimate("deepseek-v2-lite", layout=lk.Layout(dp=8, ep=8)).details["parameters on this device"]
    routed = lk.count_params("deepseek-v2-lite").by_component["routed experts"]
    assert one - eight == routed - routed // 8


def test_zero_2_and_3_shard_the_gradients_already_done_in_the_backward_pass():
    # ZeRO-1 holds the whole model's gradient bucket through the backward pass; ZeRO-2 keeps
    # the shards of the blocks done (1/8 over 8 ranks), the root unit's bucket and the bucket
    # of the block in flight: at the worst layer about 7/8 of 4n bytes fewer, less those two
    kw = dict(batch=1, seq=512, precision="bf16-mixed", recompute="full", dp=8)
    one, two = (max(v for k, v in lk.estimate("llama-2-7b", zero_stage=s, **kw).moments.items()
                    if k.startswith("backward: layer")) for s in (1, 2))
    n = lk.count_params("llama-2-7b").total
    assert 0.9 * (4 * n * 7 / 8) < one - two < 4 * n * 7 / 8
