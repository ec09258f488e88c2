"""The caching allocator model's records (``labkit.host.allocator``): a block of a segment, a pool
of free blocks, an expandable segment's pages, the statistics and snapshot it reports, an
out-of-memory error that reads like PyTorch's, and a replay's result."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

POOLS = ("small_pool", "large_pool")


class OutOfMemory(RuntimeError):
    """The model ran out of ``capacity``; the message reads like PyTorch's OutOfMemoryError."""

    def __init__(self, message: str, requested: int, alloc_size: int, allocated: int, reserved: int):
        super().__init__(message)
        self.requested, self.alloc_size = requested, alloc_size
        self.allocated, self.reserved = allocated, reserved


@dataclass(eq=False, slots=True)
class Block:
    """A piece of a segment: handed out (``allocated``) or cached free; ``mapped`` is False only
    for the not-yet-backed address space of an expandable segment."""

    addr: int
    size: int
    pool: _Pool = field(repr=False)
    requested: int = 0
    allocated: bool = False
    mapped: bool = True
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    expandable: _Expandable | None = field(default=None, repr=False)
    context: object = None                 # what the tensor is (the snapshot's frames)
    segment_context: object = None         # what made the segment (its first block only)

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """``BlockPool``: free blocks ordered by (size, address) - best fit is a bisect - and the
    unmapped blocks of expandable segments ordered by address."""

    def __init__(self, is_small: bool):
        self.is_small, self.name = is_small, POOLS[0] if is_small else POOLS[1]
        self.blocks: list[tuple] = []          # (size, addr, Block)
        self.unmapped: list[tuple] = []        # (addr, Block)

    def insert(self, b: Block):
        bisect.insort(self.blocks, (b.size, b.addr, b))

    def erase(self, b: Block):
        i = bisect.bisect_left(self.blocks, (b.size, b.addr))
        del self.blocks[i]

    def erase_unmapped(self, b: Block):
        del self.unmapped[bisect.bisect_left(self.unmapped, (b.addr,))]


class _Expandable:
    """``ExpandableSegment``: a reserved address range whose pages are mapped on demand."""

    def __init__(self, base: int, page: int, pages: int):
        self.base, self.page, self.pages, self.mapped = base, page, pages, set()

    def map(self, addr: int, size: int, room: int) -> int:
        """Map the pages covering [addr, addr+size); all or nothing. Returns the bytes mapped."""
        begin, end = (addr - self.base) // self.page, -(-(addr + size - self.base) // self.page)
        if (end - begin) * self.page > room:
            return 0                            # cuMemCreate fails: release what it made, map none
        self.mapped.update(range(begin, end))
        return (end - begin) * self.page

    def unmap(self, addr: int, size: int) -> tuple[int, int]:
        """Unmap the whole pages inside [addr, addr+size): (their start, their bytes)."""
        begin, end = -(-(addr - self.base) // self.page), (addr + size - self.base) // self.page
        if begin >= end:
            return addr, 0
        self.mapped.difference_update(range(begin, end))
        return self.base + begin * self.page, (end - begin) * self.page


@dataclass
class AllocatorStats:
    """``torch.cuda.memory_stats()``'s aggregate numbers ("all" pools): current and peak bytes."""

    allocated_bytes: int          # rounded sizes of the blocks handed out (memory_allocated)
    reserved_bytes: int           # segments from cudaMalloc, or mapped pages (memory_reserved)
    requested_bytes: int          # what the callers asked for
    active_bytes: int
    inactive_split_bytes: int     # free bytes inside segments that are partly in use
    allocations: int
    segments: int                 # cudaMalloc segments (expandable segments do not count)
    inactive_split: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    peak_inactive_split_bytes: int
    num_alloc_retries: int
    num_ooms: int
    num_device_alloc: int
    num_device_free: int


@dataclass
class Segment:
    """One segment as ``torch.cuda.memory_snapshot()`` lists it (an expandable segment: one
    contiguous mapped range)."""

    address: int
    total_size: int
    pool: str                     # "small_pool" | "large_pool"
    expandable: bool
    blocks: list[Block]
    context: object = None


@dataclass
class OomInfo:
    """Where a replay ran out of memory, and PyTorch's message for it."""

    index: int                    # the event that failed
    nbytes: int
    category: str
    phase: str
    message: str


@dataclass
class Replay:
    """A tracker's event log replayed through the allocator: the series after each event."""

    allocated: list[int]          # memory_allocated() after each event
    reserved: list[int]           # memory_reserved()
    requested: list[int]          # the bytes the tensors asked for
    inactive_split: list[int]     # free bytes stranded inside partly used segments
    phase: list[str]
    peak_allocated: int
    peak_reserved: int
    peak_requested: int
    peak_index: int               # the first event at which reserved peaks (-1: no events)
    fragmentation: float          # (reserved - allocated) / reserved at that event
    oom: OomInfo | None           # the series stop at the event that failed
    stats: AllocatorStats
    allocator: CachingAllocator = field(repr=False)
