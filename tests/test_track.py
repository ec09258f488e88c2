"""The tracker counts exact bytes of live storages and agrees with PyTorch's own MemTracker."""
import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import labkit as lk
from labkit.training import track
from labkit.training.measure import init_optimizer_state
from labkit.training.train import make_optimizer, train_step


def test_counts_each_new_storage_once_and_frees_it():
    with lk.MemoryTracker() as mt:
        a = torch.empty(1000)                  # 4000 bytes
        view = a[:10]                          # a view: no new storage
        a.add_(1)                              # in place: no new storage
        b = torch.empty(250, dtype=torch.float64)
        assert mt.current == 4000 + 2000
        del a, view
        gc.collect()
        assert mt.current == 2000
    assert mt.peak == 6000
    del b


def test_storage_resized_in_place_is_counted_and_the_patch_is_undone():
    """FSDP and ZeRO-3 free a gathered buffer with UntypedStorage.resize_, which no dispatch
    mode sees: the tracker is told of each resize while it runs, and only then."""
    weights = torch.zeros(250)                       # 1000 bytes, made before the tracker
    with lk.MemoryTracker() as outer, lk.MemoryTracker() as mt:
        mt.tag(weights, "params")
        storage = weights.untyped_storage()
        storage.resize_(0)
        assert (mt.current, mt.by_category["params"]) == (0, 0)
        storage.resize_(4000)
        assert (mt.current, mt.peak) == (4000, 4000)
        fresh = torch.empty(0).untyped_storage()
        fresh.resize_(8)                             # grown from nothing: counted once
        assert mt.current == 4008
        assert outer.current == 4008                 # both trackers are told
    assert torch.UntypedStorage.resize_ is track._RESIZE
    storage.resize_(0)                               # no tracker left to tell
    assert mt.current == 4008


def test_host_tagged_storages_leave_the_device_bytes():
    with lk.MemoryTracker() as mt:
        state = torch.zeros(100)                     # 400 bytes
        track.tag_live(state, "host")             # offloaded, as ZeRO-Offload keeps it
        assert (mt.current, mt.host) == (0, 400)
        state.untyped_storage().resize_(800)
        assert (mt.current, mt.host, mt.host_peak) == (0, 800, 800)
        del state
        assert (mt.current, mt.host, mt.peak) == (0, 0, 400)
    track.tag_live(torch.zeros(1), "grads")       # no tracker running: nothing happens
    with pytest.raises(ValueError, match="unknown category"):
        mt.tag(torch.zeros(1), "gpu")


def test_tags_weights_gradients_and_optimizer_state():
    model = torch.nn.Linear(10, 10, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with lk.MemoryTracker(model, opt) as mt:
        with mt.phase("forward"):
            loss = model(torch.ones(4, 10)).sum()
        with mt.phase("backward"):
            loss.backward()
        with mt.phase("optimizer"):
            opt.step()
        now = mt.by_category
    assert now["params"] == 400 and now["grads"] == 400 and now["optimizer"] == 400


def test_timeline_is_labelled_by_phase_and_follows_the_step():
    m = lk.measure_step("tiny", seq=64, precision="fp32", fake=False)
    spans = {p: (a, b) for p, a, b in m.timeline.phase_spans() if p != "setup"}
    assert list(spans) == ["forward", "backward", "optimizer"]
    acts, grads = m.timeline.by_category["activations"], m.timeline.by_category["grads"]
    n = lk.count_params("tiny").total
    f0, f1 = spans["forward"]
    assert max(acts[f0:f1]) == max(acts) > acts[f0]      # the forward pass piles them up
    assert grads[f1 - 1] == 0                            # no gradient before backward
    b0, b1 = spans["backward"]
    assert grads[b1 - 1] == 4 * n                        # every fp32 gradient at its end
    assert acts[b1 - 1] == 8 * 65 + 4                    # only the token batch and the loss left


# On fake tensors: LLaMA-2-7B's shapes with two of its 32 layers (every layer is the same, and
# torch's MemTracker takes ~10x our time: the whole model took 38 s of the test run).
@pytest.mark.parametrize("name, fake", [("small", False), ("tiny-moe", False), ("llama-2-7b", True)])
def test_peak_equals_torch_memtracker_on_the_same_step(name, fake):
    cfg = lk.preset(name, layers=2) if fake else lk.preset(name)
    with FakeTensorMode() if fake else torch.autocast("cpu", enabled=False):
        model = lk.build_model(cfg)
        opt = make_optimizer(model.parameters())
        init_optimizer_state(model, opt)
        tokens = torch.randint(0, cfg.vocab_size, (1, 257))
        x, y = tokens[:, :-1], tokens[:, 1:]
        with lk.MemoryTracker(model, opt) as ours:
            train_step(model, opt, x, y, "fp32", tracker=ours)
        theirs = MemTracker()
        theirs.track_external(model, opt)
        with theirs:
            train_step(model, opt, x, y, "fp32")
    peak = theirs.get_tracker_snapshot("peak")
    assert ours.peak == next(iter(peak.values()))["Total"]


def test_fake_tensors_measure_a_7b_step_without_allocating_it():
    m = lk.measure_step("llama-2-7b", seq=512, precision="fp32", fake=True)
    assert m.params == 6_738_415_616 * 4
    assert m.optimizer >= 2 * m.params and m.fake


def test_measure_step_rejects_bad_sizes():
    with pytest.raises(ValueError, match="seq must be a positive integer, got 0"):
        lk.measure_step("tiny", seq=0)
    with pytest.raises(ValueError, match="batch must be a positive integer, got True"):
        lk.measure_step("tiny", batch=True)
    with pytest.raises(ValueError, match="exceeds the model's max_seq"):
        lk.measure_step("tiny", seq=4096)
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        lk.measure_step("tiny", seq=64, precision="fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_tracker_matches_max_memory_allocated():
    m = lk.measure_step("small", seq=1024, precision="bf16-mixed", fake=False, device="cuda")
    # the caching allocator rounds each block up to 512 bytes: slightly more, never less
    assert m.total <= m.cuda_peak <= m.total * 1.02


def test_the_measured_model_is_freed_after_the_tracker_is_dropped():
    import gc
    import weakref
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("tiny"))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 33))
    with lk.MemoryTracker(model, opt) as mt:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
    peak, alive = mt.peak, weakref.ref(model)
    del model, opt, mt
    gc.collect()
    assert peak > 0 and alive() is None


def test_measure_step_leaves_no_model_behind():
    import gc
    from labkit.transformer.model import Transformer

    def models():
        gc.collect()
        return sum(isinstance(o, Transformer) for o in gc.get_objects())

    before = models()
    for _ in range(3):
        lk.measure_step("tiny", seq=64, precision="fp32", fake=False)
    assert models() == before


def test_the_first_step_shows_adamw_state_as_optimizer_state_while_it_is_born():
    import torch
    from labkit.transformer.model import build_model
    from labkit.training.train import train_step
    torch.manual_seed(0)
    model = build_model(lk.preset("tiny"))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 33))
    with lk.MemoryTracker(model, opt) as mt:
        train_step(model, opt, tokens[:, :-1], tokens[:, 1:], tracker=mt)
    in_step = [i for i, p in enumerate(mt.timeline.phase) if p == "optimizer"]
    state = mt.timeline.by_category["optimizer"]
    n = sum(p.numel() for p in model.parameters())
    assert state[in_step[0]] == 0                      # born in this step...
    assert state[in_step[len(in_step) // 2]] > 0       # ...counted as state while the step runs
    assert state[in_step[-1]] == 8 * n + 4 * len(list(model.parameters()))   # m, v, step


def test_event_log_lists_each_storage_made_and_freed_with_its_phase():
    """``events=True``: the allocator's view of the step. Storages alive at the start come
    first (phase "setup"); a resize frees the old size and allocates the new one."""
    weights = torch.zeros(250)                                  # 1000 bytes, made before
    with lk.MemoryTracker(events=True) as mt:
        mt.tag(weights, "params")
        with mt.phase("forward"):
            a = torch.empty(1000)                               # 4000 bytes
            del a
            gc.collect()
        weights.untyped_storage().resize_(2000)
    log = [(e.action, e.storage, e.nbytes, e.category, e.phase) for e in mt.events]
    assert log == [("alloc", 0, 1000, "params", "setup"),
                   ("alloc", 1, 4000, "activations", "forward"),
                   ("free", 1, 4000, "activations", "forward"),
                   ("free", 0, 1000, "params", "setup"),
                   ("alloc", 0, 2000, "params", "setup")]
    assert lk.MemoryTracker().events is None                    # off by default: no cost


def test_event_log_replays_to_the_trackers_peak_and_names_gradients():
    """Adding up the log gives the tracker's peak to the byte, and a gradient (made in the
    backward pass, found by its hook) is logged as gradients from its allocation on."""
    m = lk.measure_step("tiny", batch=2, seq=16, precision="fp32", fake=True, events=True)
    live, current, peak = {}, 0, 0
    for e in m.events:
        if e.action == "alloc":
            live[e.storage] = e.nbytes
            current += e.nbytes
        else:
            current -= live.pop(e.storage)
        peak = max(peak, current)
    assert peak == m.total
    grads = [e for e in m.events if e.action == "alloc" and e.category == "grads"]
    assert len(grads) == sum(1 for _ in lk.build_model(lk.preset("tiny")).parameters())
    assert {e.phase for e in grads} == {"backward"}


def test_further_steps_run_under_the_same_tracker_with_their_own_shapes():
    """``then``: a step per (batch, seq) on one model and optimizer. The weights and optimizer
    state are logged once; the batch whose tokens are widest sets the activations' peak."""
    one = lk.measure_step("tiny", batch=3, seq=16, precision="fp32", fake=True, events=True)
    three = lk.measure_step("tiny", batch=1, seq=16, precision="fp32", fake=True, events=True,
                            then=[(3, 16), (2, 16)])
    def before_the_first_step(m):
        first = next(i for i, e in enumerate(m.events) if e.phase == "forward")
        return sorted(e.nbytes for e in m.events[:first] if e.category != "activations")
    assert before_the_first_step(three) == before_the_first_step(one)   # weights and states
    assert three.saved_activations < one.saved_activations       # the last step's batch is 2
    assert abs(three.total - one.total) <= 0.01 * one.total        # the 3-wide step's peak
    assert len([e for e in three.events if e.action == "alloc"]) > 2 * len(
        [e for e in one.events if e.action == "alloc"])
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        lk.measure_step("tiny", batch=1, seq=16, fake=True, then=[(0, 16)])
