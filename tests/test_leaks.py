"""Everyday leaks (labkit.training.leaks): each habit's growth per step is the bytes of what it
keeps, exactly, plus the graph it keeps on the host; its fix grows by nothing."""
import pytest
import torch

import labkit as lk
from labkit.training.leaks import (LEAKS, graph_nodes, host_growth, kept_per_step, nodes_per_step,
                                   run_leak)

B, T = 2, 64


@pytest.fixture(scope="module")
def tiny():
    return lk.preset("tiny")


def pair(leak):
    return run_leak(leak, False, steps=3), run_leak(leak, True, steps=3)


def test_every_habit_keeps_what_its_formula_says_a_step_and_its_fix_nothing():
    for leak in LEAKS:
        leaking, fixed = pair(leak)
        assert leaking.per_step == kept_per_step(leak, "tiny", B, T), leak
        assert fixed.per_step == 0 and fixed.nodes == [0, 0, 0], leak


def test_kept_logits_grow_by_one_fp32_batch_of_logits_and_detach_drops_only_the_graph(tiny):
    kept, detached = (run_leak(k, steps=3) for k in ("outputs kept", "outputs kept, detached"))
    assert kept.per_step == detached.per_step == B * T * tiny.vocab_size * 4
    assert kept.nodes_per_step > 100 and detached.nodes == [0, 0, 0]


def test_removing_a_hook_frees_nothing_clearing_what_it_kept_does(tiny):
    model = lk.build_model(tiny)
    x = torch.randint(0, tiny.vocab_size, (B, T))
    outs = []
    with lk.MemoryTracker(model, timeline=False) as mt:
        start = mt.current
        handle = model.blocks[-1].register_forward_hook(lambda m, i, out: outs.append(out))
        with torch.no_grad():
            for _ in range(3):
                model(x)
        handle.remove()
        assert mt.current - start == 3 * B * T * tiny.hidden * 4
        outs.clear()
        assert mt.current - start == 0


def test_an_eval_loop_keeps_the_estimates_saved_activations_but_the_token_batch(tiny):
    # the estimate counts the (B, T + 1) int64 token batch, made once before this loop; the loop
    # keeps the (B x T) int64 targets cross-entropy copies from the shifted slice: 8 x B fewer
    leaking = run_leak("eval loss as a tensor", steps=3)
    saved = lk.estimate(tiny, B, T, precision="fp32").saved_activations
    assert leaking.per_step == saved - 8 * B
    steps = [b - a for a, b in zip([4] + leaking.after_step, leaking.after_step)]
    assert steps == [leaking.per_step] * 3          # the sum itself is one 4-byte tensor


def test_autocast_entered_per_batch_keeps_a_bf16_copy_of_every_matmul_weight_a_batch(tiny):
    per_batch, around = (run_leak(k, steps=3) for k in ("eval, autocast per batch",
                                                         "eval, autocast around loop"))
    pc = lk.count_params(tiny)
    matmul_weights = pc.total - pc.by_component["embedding"] - pc.by_component["norms"]
    assert per_batch.per_step - around.per_step == 2 * matmul_weights
    est = lk.estimate(tiny, B, T, precision="bf16-mixed")
    assert est.saved_weight_cache == 2 * matmul_weights
    assert around.per_step == est.saved_activations - 8 * B


def test_the_faqs_train_loss_as_a_tensor_keeps_no_tensor_bytes_but_every_steps_graph(tiny):
    leaking, fixed = pair("train loss as a tensor")
    assert leaking.per_step == 0       # backward freed the saved tensors; the nodes stay
    assert leaking.nodes_per_step == nodes_per_step(tiny) > 100
    assert fixed.nodes == [0, 0, 0]


def test_a_steps_nodes_grow_with_the_layers(tiny):
    two, four = nodes_per_step(tiny), nodes_per_step(tiny.replace(layers=4))
    assert four - two == (two - nodes_per_step(tiny.replace(layers=1))) * 2 > 0


def test_graph_nodes_counts_each_node_once():
    w = torch.ones(3, requires_grad=True)
    a = w * 2
    b = a + a                            # MulBackward, AddBackward, one AccumulateGrad
    assert graph_nodes([a, b, 1.0]) == 3 and graph_nodes(w.detach()) == 0


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="Linux only")
def test_the_kept_graph_grows_host_memory_and_its_fix_does_not():
    leaking, fixed = (host_growth(fixed=f, steps=50) for f in (False, True))
    if leaking.malloc is None:
        pytest.skip("no glibc mallinfo2 here")
    assert leaking.malloc > 100 * nodes_per_step("tiny")       # bytes a node, at least
    assert fixed.malloc < leaking.malloc / 20


def test_an_unknown_leak_names_the_known_ones():
    with pytest.raises(ValueError, match="outputs kept"):
        run_leak("tensors everywhere")
    with pytest.raises(ValueError, match="steps=4"):
        run_leak(LEAKS[0], steps=1)
    with pytest.raises(ValueError, match="outputs kept"):
        kept_per_step("tensors everywhere", "tiny", B, T)
