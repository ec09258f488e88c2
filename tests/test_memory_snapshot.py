"""A replayed step exported as torch.cuda.memory._snapshot() is read by PyTorch's own viewer."""
import base64
import json
import pickle
import pickletools
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from torch.cuda import _memory_viz as viz

import labkit as lk
from labkit.host.allocator import AllocatorSettings, CachingAllocator, replay
from labkit.host.memory_snapshot import save_snapshot, snapshot

MiB = 2**20
Event = namedtuple("Event", "action storage nbytes category phase")
STEP = [Event("alloc", 0, 4 * MiB, "params", "setup"),
        Event("alloc", 1, 100, "activations", "forward"),
        Event("alloc", 2, 3 * MiB, "activations", "forward"),
        Event("free", 1, 100, "activations", "backward"),
        Event("alloc", 3, 2 * MiB, "grads", "backward")]
# the pickle opcodes MemoryViz.js's unpickle() understands (torch/utils/viz/MemoryViz.js)
JS_OPCODES = {"PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE",
              "BINGET", "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME",
              "LONG1", "LONG_BINGET", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS",
              "SETITEM", "DICT", "SHORT_BINUNICODE", "BINUNICODE", "STOP", "EMPTY_TUPLE",
              "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT"}


def test_segments_list_their_blocks_in_address_order_and_the_sizes_add_up():
    snap = snapshot(replay(STEP))
    assert [s["segment_type"] for s in snap["segments"]] == ["large", "small"]
    large, small = snap["segments"]
    assert large["total_size"] == 20 * MiB == sum(b["size"] for b in large["blocks"])
    assert [(b["size"], b["state"]) for b in large["blocks"]] == [
        (4 * MiB, "active_allocated"), (3 * MiB, "active_allocated"),
        (2 * MiB, "active_allocated"), (11 * MiB, "inactive")]
    assert large["allocated_size"] == large["active_size"] == 9 * MiB
    assert large["requested_size"] == 9 * MiB
    assert [b["address"] for b in large["blocks"]] == [
        large["address"], large["address"] + 4 * MiB, large["address"] + 7 * MiB,
        large["address"] + 9 * MiB]
    assert large["blocks"][1]["frames"] == [{"filename": "labkit", "line": 0,
                                             "name": "forward: activations"}]
    assert (small["total_size"], small["blocks"][0]["state"]) == (2 * MiB, "inactive")
    assert all(s["device"] == 0 and s["stream"] == 0 for s in snap["segments"])


def test_the_trace_records_each_allocator_action_stamped_with_the_event_index():
    trace = snapshot(replay(STEP))["device_traces"][0]
    assert [(t["action"], t["size"], t["time_us"]) for t in trace] == [
        ("segment_alloc", 20 * MiB, 0), ("alloc", 4 * MiB, 0),
        ("segment_alloc", 2 * MiB, 1), ("alloc", 100, 1), ("alloc", 3 * MiB, 2),
        ("free_requested", 100, 3), ("free_completed", 100, 3), ("alloc", 2 * MiB, 4)]
    assert {t["category"] for t in trace} == {"params", "activations", "grads", "unknown"}


def test_the_trace_replayed_forward_ends_in_the_segments_the_snapshot_lists():
    events = [Event("alloc", i, (i % 7 + 1) * MiB // 3, "activations", "forward") for i in range(40)]
    freed = [*range(20), *range(21, 40, 3)]    # the first half: whole pages come free
    events += [Event("free", i, 0, "activations", "backward") for i in freed]
    run = replay(events, AllocatorSettings(expandable_segments=True), capacity=200 * MiB)
    run.allocator.empty_cache()                # unmaps the free pages: segment_unmap entries
    snap = snapshot(run)
    assert "segment_unmap" in {t["action"] for t in snap["device_traces"][0]}
    reserved, live = 0, set()
    for t in snap["device_traces"][0]:
        sign = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
        reserved += sign.get(t["action"], 0) * t["size"]
        if t["action"] == "alloc":
            live.add(t["addr"])
        elif t["action"] == "free_completed":
            live.remove(t["addr"])
    assert reserved == sum(s["total_size"] for s in snap["segments"])
    assert reserved == run.allocator.stats().reserved_bytes
    active = {b["address"] for s in snap["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"}
    assert active == live and all(s["is_expandable"] for s in snap["segments"])


def test_torch_memory_viz_reads_it():
    snap = snapshot(replay(STEP))
    summary = viz.segsum(snap)            # checks every segment's bytes add up, or raises
    assert "segments: 2" in summary and "total_reserved: 22.0MiB" in summary
    assert "total_allocated: 9.0MiB" in summary
    assert "cudaMalloc" in viz.trace(snap) and "del " in viz.trace(snap)
    flat = viz.memory(snap, format_flamegraph=lambda lines: lines)
    assert "labkit:0:setup: params 4194304" in flat
    assert "seg_" in viz.segments(snap, format_flamegraph=lambda lines: lines)
    assert "Allocator State History" in viz.segment_plot(snap)


def test_trace_plot_embeds_a_pickle_the_javascript_viewer_can_unpickle():
    snap = snapshot(replay(STEP, AllocatorSettings(expandable_segments=True)))
    html = viz.trace_plot(snap)
    files = json.loads(html.split("const local_files = ")[1].split("\n")[0])
    data = base64.b64decode(files[0]["base64"])
    assert pickle.loads(data) == snap
    assert {op.name for op, _, _ in pickletools.genops(data)} <= JS_OPCODES


def test_an_out_of_memory_shows_in_the_trace_with_the_free_bytes():
    alloc = CachingAllocator(capacity=20 * MiB)
    alloc.malloc(15 * MiB, "a")
    with pytest.raises(RuntimeError):
        alloc.malloc(8 * MiB, "b")
    oom = snapshot(alloc)["device_traces"][0][-1]
    assert oom["action"] == "oom" and oom["device_free"] == 4 * MiB and "addr" not in oom
    assert "raise OutOfMemoryError" in viz.trace(snapshot(alloc))


def test_snapshot_needs_a_trace_and_an_allocator():
    with pytest.raises(ValueError, match="record_trace=True"):
        snapshot(CachingAllocator(record_trace=False))
    with pytest.raises(ValueError, match="takes a Replay"):
        snapshot({"segments": []})


def test_save_snapshot_round_trips_through_pickle(tmp_path):
    snap = snapshot(replay(STEP))
    save_snapshot(snap, tmp_path / "step.pickle")
    assert pickle.loads((tmp_path / "step.pickle").read_bytes()) == snap


@pytest.mark.slow                         # a fresh Python that imports torch: ~6 s on 2 cores
def test_the_memory_viz_command_line_writes_the_trace_plot(tmp_path):
    save_snapshot(snapshot(replay(STEP)), tmp_path / "step.pickle")
    subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot",
                    str(tmp_path / "step.pickle"), "-o", str(tmp_path / "step.html")],
                   check=True, capture_output=True, timeout=120)
    assert "Active Memory Timeline" in (tmp_path / "step.html").read_text()


def test_the_snapshot_read_back_gives_the_replays_reserved_and_allocated_bytes():
    """``snapshot_timeline`` walks the exported trace as a viewer does: its reserved peak is the
    replay's, and the blocks alive at the end add up to the bytes their tensors requested (a
    trace's alloc entry carries the request, as PyTorch's does)."""
    from labkit.host.memory_snapshot import snapshot_timeline
    m = lk.measure_step("tiny", batch=2, seq=32, precision="bf16-mixed", fake=True, events=True)
    run = replay(m.events)
    series = snapshot_timeline(snapshot(run))
    assert max(series["reserved"]) == run.peak_reserved
    assert sum(v[-1] for v in series["by_category"].values()) == run.requested[-1]
    assert set(series["by_category"]) <= set(lk.CATEGORIES)


def test_cuda_check_needs_a_gpu():
    from labkit.host.memory_snapshot import cuda_check
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the next test runs the real check")
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        cuda_check("tiny", 1, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_model_predicts_the_reserved_peak_of_a_real_step():
    from labkit.host.memory_snapshot import cuda_check
    check = cuda_check("small", 4, 256)
    assert abs(check.reserved_error) < 0.05
    assert check.real_snapshot["segments"]
