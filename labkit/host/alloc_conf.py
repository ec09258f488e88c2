"""PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF: the CUDA caching allocator's settings, parsed
and checked as PyTorch 2.13 does (``c10/core/AllocatorConfig.cpp``), for ``labkit.host.allocator``'s
model and the host report (``labkit.host.system``); and its size rules (``round_size``,
``get_allocation_size``: ``c10/cuda/CUDACachingAllocator.cpp``).

    parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.units import check_choice

kMinLargeAlloc = 10485760      # allocations between 1 and 10 MiB may use kLargeBuffer
kLargeBuffer = 20971520        # "large" allocations may be packed in 20 MiB blocks (large_segment_size)
kRoundUpPowerOfTwoIntervals = 16   # roundup_power2_divisions: one value per power of two, 1 MiB..64 GiB
kMB = 1048576
kMinBlockSize = 512            # all sizes are rounded to at least 512 bytes
kSmallSize = 1048576           # largest "small" allocation is 1 MiB
kSmallBuffer = 2097152         # "small" allocations are packed in 2 MiB blocks
kRoundLarge = 2097152          # round up large allocations to 2 MiB

@dataclass(frozen=True)
class AllocatorSettings:
    """What PYTORCH_ALLOC_CONF sets (bytes, not MiB). None means PyTorch's default."""

    expandable_segments: bool = False
    max_split_size: int | None = None             # blocks this big are never split; None: no limit
    roundup_power2_divisions: int | tuple | None = None   # one int, or 16 (per power of two from 1 MiB)
    garbage_collection_threshold: float | None = None     # parsed; only acts with a memory fraction
    backend: str = "native"                       # "native" | "cudaMallocAsync" (not modelled)
    large_segment_size: int = kLargeBuffer        # the segment a 1-10 MiB request takes
    max_non_split_rounding_size: int | None = None   # None: large_segment_size
    unmodelled: tuple = ()                        # ((key, value), ...) accepted, with no effect here

    def __post_init__(self):
        check_choice("backend", self.backend, ("native", "cudaMallocAsync"))

    @property
    def split_limit(self) -> int:
        """``max_split_size()``: unlimited (SIZE_MAX in the source) unless set."""
        return self.max_split_size if self.max_split_size is not None else 2**64 - 1

    @property
    def rounding_limit(self) -> int:
        return self.max_non_split_rounding_size or self.large_segment_size

    def divisions(self, size: int) -> int:
        """``roundup_power2_divisions(size)``: the setting for the power of two ``size`` falls in."""
        d = self.roundup_power2_divisions
        if d is None or isinstance(d, int):
            return d or 0
        return d[min(max(size.bit_length() - 1 - 20, 0), kRoundUpPowerOfTwoIntervals - 1)]


_MODELLED = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
             "garbage_collection_threshold", "backend", "large_segment_size_mb",
             "max_non_split_rounding_mb")
# keys PyTorch 2.13 accepts (AcceleratorAllocatorConfig::getKeys + CUDAAllocatorConfig::getKeys)
_UNMODELLED = ("pinned_use_background_threads", "release_lock_on_cudamalloc",
               "pinned_use_cuda_host_register", "pinned_num_register_threads",
               "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse",
               "per_process_memory_fraction", "pinned_free_catch_all", "throw_on_cudamalloc_oom",
               "release_lock_on_hipmalloc", "pinned_use_hip_host_register",
               "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
ALLOC_CONF_KEYS = _MODELLED + _UNMODELLED


def _tokens(text: str) -> list[str]:
    """ConfigTokenizer: split on , : [ ] (kept as tokens), drop whitespace."""
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            out += [buf, ch] if buf else [ch]
            buf = ""
        elif not ch.isspace():
            buf += ch
    return out + [buf] if buf else out


def _int(key: str, token: str) -> int:
    if not token.isdigit():
        raise ValueError(f"{key} takes a whole number, got {token!r}")
    return int(token)


def _power2_divisions(key: str, tokens: list[str]) -> int | tuple:
    """Either one power of two for every size, or [boundary_mb:divisions, ..., >:divisions]."""
    if tokens[0] != "[":
        value = _int(key, tokens[0])
        if value & (value - 1):
            raise ValueError(f"{key} must be a power of two, got {value}")
        return value
    table, first, last, body = [0] * kRoundUpPowerOfTwoIntervals, True, 0, tokens[1:-1]
    for entry in " ".join(body).split(" , "):
        boundary, _, value = entry.partition(" : ")
        value = _int(key, value)
        if value & (value - 1):
            raise ValueError(f"{key}: divisions must be a power of two or 0, got {value}")
        if boundary == ">":
            table[last + 1:] = [value] * (kRoundUpPowerOfTwoIntervals - last - 1)
            continue
        mb = _int(key, boundary)
        if mb & (mb - 1) or mb == 0:
            raise ValueError(f"{key}: size boundaries are powers of two (MiB), got {boundary}")
        index = min(mb.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
        if first:
            table[:index], first = [value] * index, False
        table[index], last = value, index
    return tuple(table)


def parse_alloc_conf(text: str) -> AllocatorSettings:
    """Settings from a PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF string, checked as PyTorch does:
    ``"expandable_segments:True,max_split_size_mb:128"``."""
    text = text.split("=", 1)[1] if text.strip().startswith("PYTORCH_") else text
    tokens, values, i = _tokens(text), {}, 0
    while i < len(tokens):
        key = tokens[i]
        if key not in ALLOC_CONF_KEYS:
            raise ValueError(f"unknown allocator setting {key!r}; use one of {', '.join(ALLOC_CONF_KEYS)}")
        if i + 2 >= len(tokens) or tokens[i + 1] != ":" or tokens[i + 2] in ",:]":
            raise ValueError(f"write {key}:<value> (a colon, then the value)")
        if tokens[i + 2] == "[" and "]" not in tokens[i:]:
            raise ValueError(f"close the list of {key} with ']'")
        end = tokens.index("]", i) + 1 if tokens[i + 2] == "[" else i + 3
        values[key] = tokens[i + 2:end]
        if end < len(tokens) and tokens[end] != ",":
            raise ValueError(f"separate settings with commas, got {tokens[end]!r} after {key}")
        i = end + 1
    s, unmodelled = {}, []
    for key, toks in values.items():
        value = toks[0]
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"{key} takes True or False (capitalised), got {value!r}")
            s[key] = value == "True"
        elif key == "backend":
            check_choice("backend", value, ("native", "cudaMallocAsync"))
            s[key] = value
        elif key == "garbage_collection_threshold":
            try:
                threshold = float(value)
            except ValueError:
                threshold = -1.0
            if not 0 < threshold < 1:
                raise ValueError(f"garbage_collection_threshold must be in (0.0, 1.0), got {value!r}")
            s[key] = threshold
        elif key == "roundup_power2_divisions":
            s[key] = _power2_divisions(key, toks)
        elif key in _MODELLED:
            s[key] = _int(key, value)
        else:
            unmodelled.append((key, " ".join(toks)))
    segment_mb = s.pop("large_segment_size_mb", kLargeBuffer // kMB)
    if segment_mb <= kMinLargeAlloc // kMB:
        raise ValueError(f"large_segment_size_mb must be > {kMinLargeAlloc // kMB}, got {segment_mb}")
    for key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        if s.get(key, segment_mb) < segment_mb:
            raise ValueError(f"{key} must be >= {segment_mb} (large_segment_size_mb), got {s[key]}")
    mb = {k: s.pop(k) * kMB for k in ("max_split_size_mb", "max_non_split_rounding_mb") if k in s}
    return AllocatorSettings(**s, large_segment_size=segment_mb * kMB,
                             max_split_size=mb.get("max_split_size_mb"),
                             max_non_split_rounding_size=mb.get("max_non_split_rounding_mb"),
                             unmodelled=tuple(unmodelled))


# ---- size rules (CUDACachingAllocator.cpp) ------------------------------------------------
def roundup_power2_next_division(size: int, divisions: int) -> int:
    """Round up to the next of ``divisions`` equal steps between two powers of two (1200, 4 -> 1280)."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(size: int, settings: AllocatorSettings = AllocatorSettings()) -> int:
    """The block size a request gets: at least 512 B, then a multiple of 512 (or a power-2 division)."""
    if size < kMinBlockSize:
        return kMinBlockSize
    divisions = settings.divisions(size)
    if divisions > 1 and size > kMinBlockSize * divisions:
        return roundup_power2_next_division(size, divisions)
    return kMinBlockSize * -(-size // kMinBlockSize)


def get_allocation_size(size: int, large_segment_size: int = kLargeBuffer) -> int:
    """The segment cudaMalloc is asked for when no cached block fits a (rounded) request."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return large_segment_size
    return kRoundLarge * -(-size // kRoundLarge)


def format_size(size: int) -> str:
    """The allocator's own size printer (its OOM message): '20.00 MiB', '512 bytes'."""
    for limit, unit in ((1024, None), (kMB, "KiB"), (1 << 30, "MiB")):
        if size <= limit:
            return f"{size} bytes" if unit is None else f"{size / (limit >> 10):.2f} {unit}"
    return f"{size / (1 << 30):.2f} GiB"
