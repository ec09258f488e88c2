"""The allocator model's state and trace in the format of ``torch.cuda.memory._snapshot()``.

So that PyTorch's own viewer draws a replayed training step: ``torch.cuda._memory_viz``
(``trace_plot``, ``segment_plot``, ``segsum``, ``trace``) and pytorch.org/memory_viz read it.
The fields follow ``torch/csrc/cuda/memory_snapshot.cpp`` (``_memory_snapshot_pickled``) and what
``torch/utils/viz/MemoryViz.js`` reads: segments (address, total_size, stream, segment_type,
allocated/active/requested size, device, blocks) and one trace per device (action, addr, size,
stream, frames, time_us). A block's frame names what the tracker said it is ("forward:
activations"), so hovering over it in the viewer says so.

    snap = snapshot(replay(tracker.events))
    save_snapshot(snap, "step.pickle")
    # then: python -m torch.cuda._memory_viz trace_plot step.pickle -o step.html
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

from labkit.host.alloc_conf import parse_alloc_conf
from labkit.host.allocator import AllocatorSettings, CachingAllocator, Replay, replay


def _frames(context) -> list[dict]:
    """One frame that says what the memory is: (category, phase) -> "phase: category"."""
    if context is None:
        return []
    name = f"{context[1]}: {context[0]}" if isinstance(context, tuple) else str(context)
    return [{"filename": "labkit", "line": 0, "name": name}]


def _category(context) -> str:
    return context[0] if isinstance(context, tuple) else "unknown"


def _block(b) -> dict:
    state = "active_allocated" if b.allocated else "inactive"
    return {"address": b.addr, "size": b.size, "requested_size": b.requested if b.allocated else 0,
            "state": state, "frames": _frames(b.context)}


def _segment(seg) -> dict:
    blocks = [_block(b) for b in seg.blocks]
    active = [b for b in blocks if b["state"] == "active_allocated"]
    return {"device": 0, "address": seg.address, "total_size": seg.total_size, "stream": 0,
            "segment_type": "small" if seg.pool == "small_pool" else "large",
            "segment_pool_id": (0, 0), "is_expandable": seg.expandable,
            "allocated_size": sum(b["size"] for b in active),
            "active_size": sum(b["size"] for b in active),
            "requested_size": sum(b["requested_size"] for b in active),
            "frames": _frames(seg.context), "blocks": blocks}


def _trace_entry(action, addr, size, context, time) -> dict:
    entry = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time,
             "frames": _frames(context)}
    if action == "oom":                     # the source stores the device's free bytes here
        entry["device_free"] = entry.pop("addr")
    # MemoryViz.js colours allocations by "category" and crashes (a typo, `categores`) when
    # categories exist but "unknown" is not one: segment events carry "unknown"
    entry["category"] = _category(context) if action in ("alloc", "free_requested",
                                                         "free_completed") else "unknown"
    return entry


def _settings(s: AllocatorSettings) -> dict:
    """``allocator_settings`` as the snapshot reports them (max_split_size: SIZE_MAX = unset)."""
    d = s.roundup_power2_divisions
    table = [d or 0] * 16 if d is None or isinstance(d, int) else list(d)
    return {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": min(s.split_limit, 2**63 - 1),
            "garbage_collection_threshold": s.garbage_collection_threshold or 0.0,
            "expandable_segments": s.expandable_segments, "pinned_num_register_threads": 1,
            "release_lock_on_cudamalloc": False, "pinned_use_cuda_host_register": False,
            "roundup_power2_divisions": {str(2**i): v for i, v in enumerate(table)}}


def snapshot(source: Replay | CachingAllocator) -> dict:
    """The model's segments now and its whole trace, as ``torch.cuda.memory._snapshot()`` gives."""
    alloc = source.allocator if isinstance(source, Replay) else source
    if not isinstance(alloc, CachingAllocator):
        raise ValueError("snapshot() takes a Replay (from replay()) or a CachingAllocator")
    if alloc.trace is None:
        raise ValueError("this allocator kept no trace; make it with record_trace=True")
    return {"segments": [_segment(s) for s in alloc.segments()],
            "device_traces": [[_trace_entry(*t) for t in alloc.trace]],
            "allocator_settings": _settings(alloc.settings)}


def save_snapshot(snap: dict, path) -> None:
    """Write the pickle that ``python -m torch.cuda._memory_viz trace_plot`` and the web viewer read
    (protocol 4: MemoryViz.js unpickles protocols 2 to 4 only)."""
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=4)


def load_snapshot(path) -> dict:
    """A snapshot written by ``save_snapshot`` or by ``torch.cuda.memory._dump_snapshot``."""
    with open(path, "rb") as f:
        return pickle.load(f)


def snapshot_timeline(snap: dict, device: int = 0) -> dict:
    """Read a snapshot's trace back, as a viewer does: after each entry, the live bytes of each
    block category (``alloc`` to ``free_completed``) and the bytes of mapped segments."""
    trace = snap["device_traces"][device]
    live, reserved_now = {}, 0
    by_category, reserved = {}, []
    for i, entry in enumerate(trace):
        action, size = entry["action"], entry["size"]
        category = entry.get("category") or "unknown"
        if action == "alloc":
            live[category] = live.get(category, 0) + size
        elif action == "free_completed":
            live[category] = live.get(category, 0) - size
        elif action in ("segment_alloc", "segment_map"):
            reserved_now += size
        elif action in ("segment_free", "segment_unmap"):
            reserved_now -= size
        for c in set(live) | set(by_category):
            by_category.setdefault(c, [0] * i).append(live.get(c, 0))
        reserved.append(reserved_now)
    return {"by_category": by_category, "reserved": reserved}


@dataclass
class CudaCheck:
    """One real CUDA step beside the model's replay of its events: what the tracker counted,
    what the model predicts, what ``torch.cuda.memory_stats()`` says, and both snapshots."""

    tracker_peak: int               # MemoryTracker: the tensors' bytes at the step's peak
    cuda_allocated: int             # allocated_bytes.all.peak (rounded blocks)
    cuda_reserved: int              # reserved_bytes.all.peak
    model: Replay                   # the replay of the same step's events
    real_snapshot: dict             # torch.cuda.memory._snapshot() after the step
    model_snapshot: dict

    @property
    def reserved_error(self) -> float:
        """The model's peak reserved over the GPU's, less one."""
        return self.model.peak_reserved / self.cuda_reserved - 1


def cuda_check(cfg, batch: int, seq: int, precision: str = "bf16-mixed",
               settings: AllocatorSettings | None = None, **step) -> CudaCheck:
    """Run one training step on the GPU with the allocator's history recorded, and replay the
    tracker's events of the same step through the model with the process's own settings
    (``PYTORCH_CUDA_ALLOC_CONF``, else ``PYTORCH_ALLOC_CONF``). CUDA only."""
    import torch

    from labkit.training.measure import measure_step

    if not torch.cuda.is_available():
        raise RuntimeError("cuda_check runs a step on a CUDA GPU; none is available here")
    if settings is None:
        text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))
        settings = parse_alloc_conf(text)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        m = measure_step(cfg, batch, seq, precision=precision, fake=False, device="cuda",
                         events=True, **step)
        real = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    model = replay(m.events, settings)
    return CudaCheck(m.total, stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"],
                     model, real, snapshot(model))
