"""PyTorch's CUDA caching allocator, modelled in Python, and a training step replayed through it.

Why ``torch.cuda.memory_reserved()`` (and nvidia-smi) shows more than the tensors use
(``memory_allocated()``): the caching allocator rounds every request, carves it from cached
segments, and can leave free holes inside segments it cannot give back. This module follows
``DeviceCachingAllocator`` in PyTorch 2.13's ``c10/cuda/CUDACachingAllocator.cpp`` and the
settings in ``c10/core/AllocatorConfig.{h,cpp}``, function by function and with the same names:
``round_size``, ``get_allocation_size``, ``get_free_block``, ``should_split``,
``alloc_found_block``, ``free_block``/``try_merge_blocks``, the out-of-memory path
(``release_available_cached_blocks``, ``release_cached_blocks``) and expandable segments
(``find_expandable_block``, ``map_block``, ``unmap_block``). One device, one stream; no CUDA
graphs, IPC, events or garbage collection.

    alloc = CachingAllocator(parse_alloc_conf("expandable_segments:True"), capacity=80 * 2**30)
    alloc.malloc(100, key="x"); alloc.stats().reserved_bytes      # 2 MiB: a small-pool segment
    run = replay(tracker.events)                                   # a step's storages, replayed
    run.peak_reserved, run.fragmentation                           # what a GPU would reserve
"""
from __future__ import annotations

import bisect

from labkit.host.alloc_blocks import (POOLS, AllocatorStats, Block, OomInfo,  # noqa: F401
                                      OutOfMemory, Replay, Segment, _Expandable, _Pool)
from labkit.host.alloc_conf import (ALLOC_CONF_KEYS, AllocatorSettings, kLargeBuffer,  # noqa: F401
                                    kMB, kMinBlockSize, kMinLargeAlloc, kRoundLarge, kSmallBuffer,
                                    kSmallSize, format_size, get_allocation_size, parse_alloc_conf,
                                    round_size, roundup_power2_next_division)

_ADDRESS_BASE = 0x7F0000000000     # where the model's "cudaMalloc" hands out addresses


# ---------------------------------------------------------------------------- the allocator
_STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
          "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")


class CachingAllocator:
    """``DeviceCachingAllocator`` for one device and one stream. ``capacity``: bytes the "GPU"
    lets the allocator reserve (None: never runs out). Records a trace for the snapshot viewer."""

    def __init__(self, settings: AllocatorSettings = AllocatorSettings(), capacity: int | None = None,
                 record_trace: bool = True):
        if capacity is not None and (not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(f"capacity must be a positive number of bytes or None, got {capacity!r}")
        self.settings, self.capacity = settings, capacity
        self.small, self.large = _Pool(True), _Pool(False)
        self.live: dict[object, Block | None] = {}          # key -> its block (None: 0 bytes)
        self.current = {(s, p): 0 for s in _STATS for p in ("all", *POOLS)}
        self.peak = dict(self.current)
        self.counts = dict.fromkeys(("num_alloc_retries", "num_ooms", "num_device_alloc",
                                     "num_device_free"), 0)
        self.trace: list[tuple] | None = [] if record_trace else None   # (action, addr, size, ctx, t)
        self.clock = 0                # time_us of trace entries; replay sets it to the event index
        self._next_addr = _ADDRESS_BASE
        self._expandables: list[_Expandable] = []

    # --- bookkeeping
    def _add(self, pool: str, *changes: tuple[str, int]):
        """Move statistics of one pool (and of "all") by (stat, bytes or count) pairs."""
        current, peak = self.current, self.peak
        for stat, n in changes:         # unrolled: the replay's hottest lines
            value = current[stat, "all"] = current[stat, "all"] + n
            if value > peak[stat, "all"]:
                peak[stat, "all"] = value
            value = current[stat, pool] = current[stat, pool] + n
            if value > peak[stat, pool]:
                peak[stat, pool] = value

    def _record(self, action: str, addr: int, size: int, context=None):
        if self.trace is not None:
            self.trace.append((action, addr, size, context, self.clock))

    def _address(self, size: int, align: int = kRoundLarge) -> int:
        """A fresh device address (the model never reuses one: addresses only name blocks)."""
        addr = self._next_addr
        self._next_addr += -(-size // align) * align
        return addr

    @property
    def reserved(self) -> int:
        return self.current["reserved_bytes", "all"]

    # --- malloc
    def malloc(self, nbytes: int, key, context=None) -> Block | None:
        """Hand out a block for ``nbytes`` under ``key``; None for 0 bytes (no block, as PyTorch)."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a whole number of bytes >= 0, got {nbytes!r}")
        if key in self.live:
            raise ValueError(f"key {key!r} already holds a block; free it first")
        if nbytes == 0:
            self.live[key] = None
            self.clock += 1
            return None
        size = round_size(nbytes, self.settings)
        pool = self.small if size <= kSmallSize else self.large
        alloc_size = get_allocation_size(size, self.settings.large_segment_size)
        block = (self.get_free_block(pool, size)
                 or self.alloc_block(pool, size, alloc_size, context)
                 or (self.release_available_cached_blocks(pool, size)
                     and self.alloc_block(pool, size, alloc_size, context))
                 or (self.release_cached_blocks()
                     and self.alloc_block(pool, size, alloc_size, context, retry=True)))
        if not block:
            self._out_of_memory(nbytes, size, alloc_size, context)
        block = self.alloc_found_block(block, size, nbytes, context, self.should_split(block, size))
        self.live[key] = block
        self.clock += 1
        return block

    def get_free_block(self, pool: _Pool, size: int) -> Block | None:
        """Best fit: the smallest cached block >= size (ties: lowest address), within max_split_size."""
        i = bisect.bisect_left(pool.blocks, (size,))
        if i == len(pool.blocks):
            return None
        block = pool.blocks[i][2]
        if block.expandable is not None:
            # a block at an expandable segment's mapped end can grow: judge it by the size it
            # can reach, and prefer a larger block that cannot grow into the address space
            def reach(b):
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while (block.expandable is not None and i + 1 < len(pool.blocks)
                   and reach(pool.blocks[i + 1][2]) < reach(block)):
                i += 1
                block = pool.blocks[i][2]
        limit = self.settings.split_limit
        if size < limit <= block.size:
            return None                     # do not return an oversized block for a small request
        if size >= limit and block.size >= size + self.settings.rounding_limit:
            return None                     # an oversized block may be rounded up only so far
        del pool.blocks[i]
        return block

    def should_split(self, block: Block, size: int) -> bool:
        """Split off the rest when it is big enough to be worth caching on its own."""
        remaining = block.size - size
        if block.pool.is_small or self.settings.expandable_segments:
            return remaining >= kMinBlockSize
        return size < self.settings.split_limit and remaining > kSmallSize

    def alloc_block(self, pool: _Pool, size: int, alloc_size: int, context, retry=False) -> Block | None:
        """A new segment ("cudaMalloc" of alloc_size), or, with expandable segments, new pages."""
        self.counts["num_alloc_retries"] += retry
        if self.settings.expandable_segments:
            return self.try_allocate_expandable_block(pool, size, context)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        block = Block(self._address(alloc_size), alloc_size, pool, segment_context=context)
        self._add(pool.name, ("segment", 1), ("reserved_bytes", alloc_size))
        self.counts["num_device_alloc"] += 1
        self._record("segment_alloc", block.addr, alloc_size, context)
        return block

    def alloc_found_block(self, block: Block, size: int, nbytes: int, context, split: bool) -> Block:
        """Cut ``size`` bytes off the front of the found block (when ``split``) and hand them out."""
        pool, already_split, counted = block.pool, block.is_split, block.expandable is None
        if split:
            remaining = block
            block = Block(remaining.addr, size, pool, prev=remaining.prev, next=remaining,
                          expandable=remaining.expandable, segment_context=remaining.segment_context)
            if block.prev is not None:
                block.prev.next = block
            remaining.prev, remaining.segment_context = block, None
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
            if already_split and counted:      # an inactive split block shrinks by size
                self._add(pool.name, ("inactive_split_bytes", -size))
            elif counted:                      # a new inactive split block: the remainder
                self._add(pool.name, ("inactive_split_bytes", remaining.size), ("inactive_split", 1))
        elif already_split and counted:        # an inactive split block becomes active whole
            self._add(pool.name, ("inactive_split_bytes", -block.size), ("inactive_split", -1))
        block.allocated, block.requested, block.context = True, nbytes, context
        self._record("alloc", block.addr, nbytes, context)
        self._add(pool.name, ("allocation", 1), ("allocated_bytes", block.size), ("active", 1),
                  ("active_bytes", block.size), ("requested_bytes", nbytes))
        return block

    def _out_of_memory(self, nbytes: int, size: int, alloc_size: int, context):
        allocated, reserved = self.current["allocated_bytes", "all"], self.reserved
        free = self.capacity - reserved
        self.counts["num_ooms"] += 1
        if self.trace is not None:
            self.trace.append(("oom", free, size, context, self.clock))
        raise OutOfMemory(
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 has a total "
            f"capacity of {format_size(self.capacity)} of which {format_size(free)} is free. "
            f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and "
            f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated. If "
            "reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
            nbytes, alloc_size, allocated, reserved)

    # --- free
    def free(self, key) -> None:
        """Return the key's block to the cache, merged with its free neighbours."""
        if key not in self.live:
            raise ValueError(f"key {key!r} holds no block; malloc it first")
        block = self.live.pop(key)
        if block is not None:
            block.allocated = False
            self._add(block.pool.name, ("allocation", -1), ("allocated_bytes", -block.size))
            self._record("free_requested", block.addr, block.requested, block.context)
            self.free_block(block)
        self.clock += 1

    def free_block(self, block: Block) -> None:
        """Move a block into its pool's cache, merging it with free neighbours (same segment)."""
        self._record("free_completed", block.addr, block.requested, block.context)
        pool, size, requested = block.pool, block.size, block.requested
        net_blocks = net_size = 0
        for neighbour in (block.prev, block.next):
            subsumed = self.try_merge_blocks(block, neighbour, pool)
            if subsumed:
                net_blocks, net_size = net_blocks - 1, net_size - subsumed
        block.context = None
        pool.insert(block)
        if block.is_split:
            net_blocks, net_size = net_blocks + 1, net_size + block.size
        changes = [("active", -1), ("active_bytes", -size), ("requested_bytes", -requested)]
        if block.expandable is None:           # fully free pages of expandable segments can always go
            changes += [("inactive_split", net_blocks), ("inactive_split_bytes", net_size)]
        self._add(pool.name, *changes)

    def try_merge_blocks(self, dst: Block, src: Block | None, pool: _Pool) -> int:
        """Fold a free neighbour ``src`` into ``dst``; the bytes it brought (0: not mergeable)."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        pool.erase(src) if src.mapped else pool.erase_unmapped(src)
        if dst.prev is src:                    # [src dst]
            dst.addr, dst.prev, dst.segment_context = src.addr, src.prev, src.segment_context
            if dst.prev is not None:
                dst.prev.next = dst
        else:                                  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # --- giving memory back
    def release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """Free oversize cached segments (>= max_split_size) until ``size`` could fit."""
        limit = self.settings.split_limit
        if self.settings.max_split_size is None:
            return False
        target = max(size, limit)
        i = bisect.bisect_left(pool.blocks, (target,))
        if i < len(pool.blocks):
            block = pool.blocks[i][2]
            if block.expandable is not None or block.is_split:
                return False                   # only whole cudaMalloc segments can be freed
            self.release_block(block)
            return True
        released = 0                           # no single block is big enough: free the largest ones
        for _, _, block in reversed(pool.blocks[:]):
            if released >= target or block.size < limit:
                break
            if block.expandable is None and not block.is_split:
                released += block.size
                self.release_block(block)
        return released >= target

    def release_cached_blocks(self) -> bool:
        """Free every cached segment that is wholly free; unmap free pages of expandable ones."""
        for pool in (self.large, self.small):
            to_unmap = []
            for _, _, block in pool.blocks[:]:
                if block.expandable is not None:
                    to_unmap.append(block)
                elif not block.is_split:
                    self.release_block(block)
            for block in to_unmap:
                self.unmap_block(block)
                if not block.is_split:         # the whole segment is unmapped: drop it
                    pool.erase_unmapped(block)
                    self._expandables.remove(block.expandable)
        return True

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every unsplit free segment."""
        self.release_cached_blocks()
        self.clock += 1           # each call is one tick of the trace's clock

    def release_block(self, block: Block) -> None:
        """"cudaFree" one whole free segment."""
        self._record("segment_free", block.addr, block.size, block.segment_context)
        self._add(block.pool.name, ("segment", -1), ("reserved_bytes", -block.size))
        self.counts["num_device_free"] += 1
        block.pool.erase(block)

    # --- expandable segments
    def find_expandable_block(self, pool: _Pool, size: int) -> Block:
        """The lowest address where free and unmapped space add up to ``size``, or a new segment."""
        def room(b):
            total = 0
            while total < size and b is not None and not b.allocated:
                total, b = total + b.size, b.next
            return total >= size
        for _, c in pool.unmapped:
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if room(c):
                return c
        # pages of 2 MiB for the small pool and 20 MiB for the large one (Note [Expandable
        # Segments]); address space for 1 1/8 of the GPU's memory
        page = kSmallBuffer if pool.is_small else self.settings.large_segment_size
        space = (self.capacity or 1 << 40) * 9 // 8
        seg = _Expandable(self._address(space, page), page, -(-space // page))
        self._expandables.append(seg)
        block = Block(seg.base, seg.pages * page, pool, mapped=False, expandable=seg)
        bisect.insort(pool.unmapped, (block.addr, block))
        return block

    def map_block(self, block: Block, size: int, context) -> bool:
        """Back the first ``size`` bytes of an unmapped block with pages, merging with free neighbours."""
        room = self.capacity - self.reserved if self.capacity is not None else 1 << 62
        mapped = block.expandable.map(block.addr, size, room)
        if mapped == 0:
            return False
        pool, addr = block.pool, block.addr
        pool.erase_unmapped(block)
        block.mapped = True
        if mapped < block.size:                # block -> remaining (unmapped) -> block.next
            rest = Block(block.addr + mapped, block.size - mapped, pool, mapped=False,
                         prev=block, next=block.next, expandable=block.expandable)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, mapped
            bisect.insort(pool.unmapped, (rest.addr, rest))
        self.try_merge_blocks(block, block.prev, pool)
        self.try_merge_blocks(block, block.next, pool)
        pool.insert(block)
        self._add(pool.name, ("reserved_bytes", mapped))
        self.counts["num_device_alloc"] += 1
        self._record("segment_map", addr, mapped, context)
        if block.prev is None and block.segment_context is None:
            block.segment_context = context
        return True

    def try_allocate_expandable_block(self, pool: _Pool, size: int, context) -> Block | None:
        """Map pages at the lowest place that fits ``size`` and take the free block there."""
        c = self.find_expandable_block(pool, size)
        if not c.mapped and not self.map_block(c, min(c.size, size), context):
            return None
        while c.size < size:                   # free -> unmapped: map more and merge
            nxt = c.next
            if not self.map_block(nxt, min(size - c.size, nxt.size), context):
                return None
            c = nxt
        pool.erase(c)
        return c

    def unmap_block(self, block: Block) -> None:
        """Give back the whole pages inside a free block of an expandable segment."""
        start, size = block.expandable.unmap(block.addr, block.size)
        if size == 0:
            return
        pool = block.pool
        pool.erase(block)
        before, after = start - block.addr, block.size - (start - block.addr) - size
        if before > 0:                         # prev -> before -> block
            b = Block(block.addr, before, pool, prev=block.prev, next=block,
                      expandable=block.expandable, segment_context=block.segment_context)
            if block.prev is not None:
                block.prev.next = b
            block.prev, block.segment_context = b, None
            pool.insert(b)
        if after > 0:                          # block -> after -> next
            a = Block(start + size, after, pool, prev=block, next=block.next,
                      expandable=block.expandable)
            if block.next is not None:
                block.next.prev = a
            block.next = a
            pool.insert(a)
        block.addr, block.size, block.mapped = start, size, False
        self.try_merge_blocks(block, block.prev, pool)
        self.try_merge_blocks(block, block.next, pool)
        bisect.insort(pool.unmapped, (block.addr, block))
        self._add(pool.name, ("reserved_bytes", -size))
        self.counts["num_device_free"] += 1
        self._record("segment_unmap", start, size, block.segment_context)

    # --- what it holds
    def stats(self) -> AllocatorStats:
        """The aggregate statistics now (peaks since the allocator was made)."""
        cur = {s: self.current[s, "all"] for s in _STATS}
        pk = {s: self.peak[s, "all"] for s in _STATS}
        return AllocatorStats(
            cur["allocated_bytes"], cur["reserved_bytes"], cur["requested_bytes"],
            cur["active_bytes"], cur["inactive_split_bytes"], cur["allocation"], cur["segment"],
            cur["inactive_split"], pk["allocated_bytes"], pk["reserved_bytes"],
            pk["requested_bytes"], pk["inactive_split_bytes"], **self.counts)

    def memory_stats(self) -> dict[str, int]:
        """The same numbers under ``torch.cuda.memory_stats()``'s keys, to set beside a real GPU's."""
        out = {}
        for (stat, pool), value in self.current.items():
            out[f"{stat}.{pool}.current"] = value
            out[f"{stat}.{pool}.peak"] = self.peak[stat, pool]
        return {**dict(sorted(out.items())), **self.counts}

    def segments(self) -> list[Segment]:
        """Every segment (expandable: every mapped range), by address, with its blocks in order."""
        heads = [b for pool in (self.small, self.large) for _, _, b in pool.blocks]
        heads += [b for b in self.live.values() if b is not None]
        out = []
        for head in heads:
            if head.prev is not None and head.prev.mapped:
                continue
            blocks, b = [], head
            while b is not None and b.mapped:
                blocks.append(b)
                b = b.next
            out.append(Segment(head.addr, sum(x.size for x in blocks), head.pool.name,
                               head.expandable is not None, blocks, head.segment_context))
        return sorted(out, key=lambda s: s.address)


# ------------------------------------------------------------------------------------ replay
def feed(alloc: "CachingAllocator", events, after=None):
    """Send ``StorageEvent``-like objects (action, storage, nbytes, category, phase) to ``alloc``
    in order, calling ``after(event)`` once each is applied. Host memory and 0-byte storages take
    no device block and are skipped. Returns (index, event, OutOfMemory) of the first request
    the allocator could not serve, or None when every one was."""
    skipped = set()
    for i, e in enumerate(events):
        alloc.clock = i
        if e.action == "alloc":
            if e.category == "host" or e.nbytes == 0:
                skipped.add(e.storage)
            else:
                try:
                    alloc.malloc(e.nbytes, e.storage, (e.category, e.phase))
                except OutOfMemory as err:
                    return i, e, err
        elif e.action == "free":
            if e.storage in skipped:
                skipped.discard(e.storage)
            elif e.storage not in alloc.live:
                raise ValueError(f"event {i} frees storage {e.storage}, which no earlier event "
                                 "allocated: replay one tracker's whole event log")
            else:
                alloc.free(e.storage)
        else:
            raise ValueError(f"event {i} has action {e.action!r}; use 'alloc' or 'free'")
        if after is not None:
            after(e)
    return None


def replay(events, settings: AllocatorSettings = AllocatorSettings(), capacity: int | None = None,
           record_trace: bool = True) -> Replay:
    """Replay ``StorageEvent``-like objects through a fresh allocator (``feed``), with its
    allocated, reserved, requested and inactive bytes after each event."""
    alloc = CachingAllocator(settings, capacity, record_trace)
    cur = alloc.current
    allocated, reserved, requested, inactive, phases = [], [], [], [], []

    def record(e):
        allocated.append(cur["allocated_bytes", "all"])
        reserved.append(cur["reserved_bytes", "all"])
        requested.append(cur["requested_bytes", "all"])
        inactive.append(cur["inactive_split_bytes", "all"])
        phases.append(e.phase)

    failed = feed(alloc, events, record)
    oom = None
    if failed is not None:
        i, e, err = failed
        oom = OomInfo(i, e.nbytes, e.category, e.phase, str(err))
    peak = max(reserved, default=0)
    at = reserved.index(peak) if reserved else -1
    frag = (peak - allocated[at]) / peak if peak else 0.0
    return Replay(allocated, reserved, requested, inactive, phases, max(allocated, default=0), peak,
                  max(requested, default=0), at, frag, oom, alloc.stats(), alloc)


def min_capacity(events, settings: AllocatorSettings = AllocatorSettings(),
                 tolerance: int = 2 * kMB) -> int:
    """A device memory on which the replay runs, with ``tolerance`` bytes less failing: what the
    step needs, as against what an unpressed allocator keeps reserved. Bisection between the
    peak of allocated blocks and the peak reserved with no limit. The allocator is not
    monotonic in memory: with more room it caches segments that can fragment later, so a device
    a little larger may still fail, and a smaller one run: ``alloc_need.need_band`` scans that
    band (lab 08); read the answer to its width."""
    free_run = replay(events, settings, record_trace=False)
    low, high = free_run.peak_allocated, free_run.peak_reserved
    if replay(events, settings, capacity=low, record_trace=False).oom is None:
        return low
    while high - low > tolerance:
        mid = (low + high) // 2
        if replay(events, settings, capacity=mid, record_trace=False).oom is None:
            high = mid
        else:
            low = mid
    return high
