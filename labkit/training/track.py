"""Count the bytes of every live tensor storage, by category, on CPU, CUDA and fake tensors.

``MemoryTracker`` is a ``TorchDispatchMode``: every operator's outputs pass through it, and
each new storage is counted once (views and in-place results share their storage) until
Python frees it (``weakref.finalize``). On CPU and fake tensors this is exact and repeatable;
on CUDA it equals what the caching allocator hands out before its rounding to 512-byte
blocks, so ``torch.cuda.max_memory_allocated`` reads slightly higher.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from labkit.core.units import CATEGORIES, HOST


# Tensors made in each phase start in this category (gradients and states are re-tagged).
_PHASE_CATEGORY = {"forward": "activations"}
# a cast of a weight (what autocast does before each matmul) is the weight cache, whatever the phase
_CASTS = {torch.ops.aten._to_copy.default}


@dataclass(frozen=True)
class StorageEvent:
    """One storage made or freed: what a caching allocator is asked for (``labkit.host.allocator``
    replays these). ``storage`` numbers the storages of one tracker 0, 1, 2, ... in order."""

    action: str          # "alloc" | "free"
    storage: int
    nbytes: int
    category: str        # the storage's category when it was made (its latest tag when freed)
    phase: str


@dataclass
class Timeline:
    """Live bytes per category after each allocation or free, with the phase it happened in."""

    phase: list = field(default_factory=list)
    by_category: dict = field(default_factory=lambda: {c: [] for c in CATEGORIES})

    def __len__(self):
        return len(self.phase)

    @property
    def total(self) -> list[int]:
        return [sum(v) for v in zip(*self.by_category.values())]

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """(phase, first event, last event + 1) for each contiguous run of one phase."""
        spans, start = [], 0
        for i in range(1, len(self.phase) + 1):
            if i == len(self.phase) or self.phase[i] != self.phase[start]:
                spans.append((self.phase[start], start, i))
                start = i
        return spans


# ``UntypedStorage.resize_`` reaches no dispatch mode: FSDP and ZeRO-3 free and re-allocate a
# gathered buffer that way, so the trackers inside their ``with`` are told of each resize
_RESIZE = torch.UntypedStorage.resize_
_ACTIVE: list = []


_ON_HOST = [0]        # > 0 while an offloading mechanism runs its host-side work


@contextlib.contextmanager
def on_host():
    """Storages made inside count as host memory (``"host"``) in every tracker: the optimizer
    step ZeRO-Offload runs on the CPU, told apart where host and device are one memory."""
    _ON_HOST[0] += 1
    try:
        yield
    finally:
        _ON_HOST[0] -= 1


def current() -> "MemoryTracker | None":
    """The tracker measuring now (the innermost running one), or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def tag_live(tensor: torch.Tensor, category: str):
    """Tell every tracker running now what ``tensor`` is (nothing when none runs): mechanisms
    that make their own gradient or state buffers, such as labkit's ZeRO, call it."""
    for tracker in _ACTIVE:
        tracker.tag(tensor, category)


def _counted_resize(storage, nbytes):
    before = storage.nbytes()
    out = _RESIZE(storage, nbytes)
    for tracker in _ACTIVE:
        tracker._resized(storage, before)
    return out


def _storages(tensor) -> list:
    """The storages that hold a tensor's bytes: its own, or for a wrapper subclass (a DTensor)
    those of the tensors inside it (its local shard): the wrapper itself owns no memory."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)    # a DTensor also names its mesh
        return [s for t in inner if isinstance(t, torch.Tensor) for s in _storages(t)]
    return [tensor.untyped_storage()]


def _free_if_alive(tracker_ref, key):
    tracker = tracker_ref()
    if tracker is not None:
        tracker._free(key)


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages, by category, with a timeline.

    Pass the ``model`` and ``optimizer`` to count what exists before tracking starts
    (weights, buffers, optimizer state) and to tag gradients and optimizer state as they
    appear. Mark phases with ``with mt.phase("forward"): ...``. With ``events=True`` it also
    logs each storage made and freed (``mt.events``), the requests a GPU's caching allocator
    would see (``labkit.host.allocator.replay``).

        with lk.MemoryTracker(model, opt) as mt:
            with mt.phase("forward"):
                loss = model(x, y)
        mt.peak, mt.peak_by_category, mt.timeline
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, timeline: bool = True,
                 events: bool = False):
        super().__init__()
        self.model, self.optimizer, self.record_timeline = model, optimizer, timeline
        self.events: list[StorageEvent] | None = [] if events else None
        self._live: dict[int, list] = {}           # storage id -> [nbytes, category, serial]
        self._bytes = dict.fromkeys(CATEGORIES, 0)
        self.current = 0
        self.peak = 0
        self.peak_by_category = dict(self._bytes)
        self.peak_phase = None
        self.host = self.host_peak = 0              # bytes tagged "host" (offloaded), not counted above
        self._phase = "setup"
        self.timeline = Timeline()
        self._hooks = []
        self._serials = 0                          # storages counted so far
        self._alloc_event: dict[int, int] = {}     # serial -> index of its "alloc" in events
        self._state_entries = 0                    # optimizer state entries tagged so far
        self._lock = threading.Lock()

    # ---- bookkeeping -----------------------------------------------------------------
    def _add(self, storage, category):
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = [nbytes, category, self._serials]
        self._serials += 1
        self._log("alloc", self._live[key])
        # a weak reference: the tracker (and the model and optimizer it names) must not live
        # as long as the storages it counted, or every measured model would stay in memory
        weakref.finalize(storage, _free_if_alive, weakref.ref(self), key)
        self._change(category, nbytes)

    def _free(self, key):
        entry = self._live.pop(key, None)
        if entry is None:
            return
        self._log("free", entry)
        self._change(entry[1], -entry[0])

    def _log(self, action: str, entry: list):
        if self.events is not None:
            if action == "alloc":
                self._alloc_event[entry[2]] = len(self.events)
            self.events.append(StorageEvent(action, entry[2], entry[0], entry[1], self._phase))

    def _relabel(self, entry: list):
        """A storage re-tagged (a gradient found by its hook): its "alloc" says what it is."""
        at = self._alloc_event.get(entry[2]) if self.events is not None else None
        if at is not None:
            self.events[at] = dataclasses.replace(self.events[at], category=entry[1])

    def _resized(self, storage, before: int):
        """A storage changed size in place: count the difference (or the storage, if new)."""
        entry = self._live.get(storage._cdata)
        if entry is None:
            self._add(storage, _PHASE_CATEGORY.get(self._phase, "other"))
            return
        delta = storage.nbytes() - before
        self._log("free", entry)                   # the allocator frees the old size ...
        entry[0] += delta
        if entry[0]:
            self._log("alloc", entry)              # ... and allocates the new one
        self._change(entry[1], delta)

    def _change(self, category: str, delta: int, record: bool = True):
        """Live bytes of ``category`` moved by ``delta``: update the total, the peak, the timeline.
        A storage can die on another thread (gloo's worker lets go of a collective's buffer):
        the update holds a lock."""
        with self._lock:
            self._change_locked(category, delta, record)

    def _change_locked(self, category: str, delta: int, record: bool):
        if category == HOST:
            self.host += delta
            self.host_peak = max(self.host_peak, self.host)
            return
        self._bytes[category] += delta
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_category = dict(self._bytes)
            self.peak_phase = self._phase
        if record:
            self._record()

    def _record(self):
        if self.record_timeline:
            self.timeline.phase.append(self._phase)
            for category, series in self.timeline.by_category.items():
                series.append(self._bytes[category])

    def _category_of(self, tensor) -> str | None:
        entry = (self._live.get(_storages(tensor)[0]._cdata) if isinstance(tensor, torch.Tensor)
                 else None)
        return entry[1] if entry else None

    def tag(self, tensor: torch.Tensor, category: str):
        """Count ``tensor``'s storage under ``category`` (moving it there if already counted).
        ``"host"``: it lives in host memory (offloaded), counted in ``host``, not the device."""
        if category not in CATEGORIES and category != HOST:
            raise ValueError(f"unknown category {category!r}; use one of {', '.join(CATEGORIES)}"
                             f" or {HOST!r}")
        for storage in _storages(tensor):
            entry = self._live.get(storage._cdata)
            if entry is None:
                self._add(storage, category)
            elif entry[1] != category:
                self._change(entry[1], -entry[0], record=False)
                self._change(category, entry[0], record=False)
                entry[1] = category
                self._relabel(entry)

    def _tag_grad(self, param):
        if param.grad is not None:     # a hook before this one (labkit's ZeRO) may have taken it
            self.tag(param.grad, "grads")

    def _optimizer_tensors(self) -> list:
        """(tensor, category) for the optimizer's state: "optimizer", unless the optimizer
        says otherwise (``memory_tags``: master shards, offloaded state)."""
        own = list(getattr(self.optimizer, "memory_tags", list)())
        said = {t.untyped_storage()._cdata for t, _ in own}
        return [(value, "optimizer") for state in self.optimizer.state.values()
                for value in state.values() if isinstance(value, torch.Tensor)
                and value.untyped_storage()._cdata not in said] + own

    def _tag_new_optimizer_state(self):
        """The first step creates AdamW's state inside ``step()``: tag it once it is stored.
        A wrapper's state (``MasterWeights``) grows only with its inner optimizer's, so that is
        counted: this runs at every op of the step, and the wrapper builds its state afresh."""
        holder = getattr(self.optimizer, "inner", self.optimizer)
        entries = sum(len(state) for state in holder.state.values())
        if entries != self._state_entries:
            self._state_entries = entries
            for tensor, category in self._optimizer_tensors():
                self.tag(tensor, category)

    def tag_states(self):
        """Tag the model's weights, buffers and gradients and the optimizer's state."""
        if self.model is not None:
            for p in self.model.parameters():
                self.tag(p, "params")
                if p.grad is not None:
                    self.tag(p.grad, "grads")
            for b in self.model.buffers():
                self.tag(b, "other")
        if self.optimizer is not None:
            for tensor, category in self._optimizer_tensors():
                self.tag(tensor, category)

    # ---- phases ----------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Label the events inside the block (``forward``, ``backward``, ``optimizer``, ...)."""
        previous, self._phase = self._phase, name
        try:
            yield self
        finally:
            if name == "optimizer":
                self.tag_states()           # the first step creates the optimizer state:
                self._record()              # a point that shows it under its own category
            self._phase = previous

    def reset_peak(self):
        """Start a new peak from the bytes live now (and a new timeline)."""
        self.peak, self.peak_by_category = self.current, dict(self._bytes)
        self.peak_phase, self.host_peak = self._phase, self.host
        self.timeline = Timeline()
        self._record()

    @property
    def by_category(self) -> dict[str, int]:
        """Live bytes per category now."""
        return dict(self._bytes)

    # ---- the mode --------------------------------------------------------------------
    def __enter__(self):
        self.tag_states()
        if self.model is not None:
            for p in self.model.parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._tag_grad))
        self.reset_peak()
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _counted_resize
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _RESIZE
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._phase == "optimizer" and self.optimizer is not None:
            self._tag_new_optimizer_state()
        out = func(*args, **(kwargs or {}))
        category = HOST if _ON_HOST[0] else _PHASE_CATEGORY.get(self._phase, "other")
        if func in _CASTS and self._category_of(args[0]) == "params":
            category = "weight_cache"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for storage in _storages(t):
                    self._add(storage, category)
        return out


def activations_per_module(model, tokens, targets, modules) -> dict[str, int]:
    """Bytes each named module adds to what the forward pass keeps alive (its saved activations).

    The tracker's live bytes are read before and after each module's forward: what stays is
    what autograd saved for the backward pass, plus the module's output.
    """
    kept, before, handles = {}, {}, []
    with MemoryTracker(model) as mt:
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: before.__setitem__(name, mt.current)))
            handles.append(module.register_forward_hook(
                lambda m, args, out, name=name: kept.__setitem__(name, mt.current - before[name])))
        try:
            with mt.phase("forward"):
                loss = model(tokens, targets)
        finally:
            for h in handles:
                h.remove()
    del loss
    return kept
