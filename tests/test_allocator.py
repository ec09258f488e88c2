"""The caching-allocator model rounds, packs, splits, merges, releases and runs out of memory
the way c10/cuda/CUDACachingAllocator.cpp does, by hand-worked cases."""
from collections import namedtuple

import pytest

from labkit.host.allocator import (AllocatorSettings, CachingAllocator, OutOfMemory, format_size,
                                   get_allocation_size, parse_alloc_conf, replay, round_size,
                                   roundup_power2_next_division)

KiB, MiB = 2**10, 2**20
Event = namedtuple("Event", "action storage nbytes category phase")


def blocks(alloc, segment=0):
    """(size in bytes, in use?) of each block of one segment, in address order."""
    return [(b.size, b.allocated) for b in alloc.segments()[segment].blocks]


def test_a_100_byte_request_takes_512_bytes_of_a_new_2_mib_small_segment():
    alloc = CachingAllocator()
    block = alloc.malloc(100, "x")
    s = alloc.stats()
    assert block.size == 512 and block.requested == 100
    assert (s.allocated_bytes, s.requested_bytes, s.reserved_bytes) == (512, 100, 2 * MiB)
    assert s.segments == 1 and s.inactive_split_bytes == 2 * MiB - 512
    assert blocks(alloc) == [(512, True), (2 * MiB - 512, False)]


def test_two_600_kib_requests_share_one_2_mib_segment():
    alloc = CachingAllocator()
    alloc.malloc(600 * KiB, "a"), alloc.malloc(600 * KiB, "b")
    assert alloc.stats().reserved_bytes == 2 * MiB and len(alloc.segments()) == 1
    assert blocks(alloc) == [(600 * KiB, True), (600 * KiB, True), (2 * MiB - 1200 * KiB, False)]


def test_a_1_5_mib_request_takes_a_20_mib_segment_and_the_next_5_mib_request_splits_it():
    alloc = CachingAllocator()
    alloc.malloc(3 * MiB // 2, "a")
    assert alloc.stats().reserved_bytes == 20 * MiB
    alloc.malloc(5 * MiB, "b")
    s = alloc.stats()
    assert s.reserved_bytes == 20 * MiB and s.segments == 1
    assert blocks(alloc) == [(3 * MiB // 2, True), (5 * MiB, True), (27 * MiB // 2, False)]
    assert s.inactive_split_bytes == 27 * MiB // 2


def test_a_request_of_10_mib_or_more_takes_its_own_segment_rounded_up_to_2_mib():
    alloc = CachingAllocator()
    alloc.malloc(11 * MiB + 1, "a")
    # 11 MiB + 1 rounds to 11 MiB + 512, its segment to 12 MiB; the 1 MiB - 512 left is not split
    assert alloc.stats().reserved_bytes == 12 * MiB
    assert blocks(alloc) == [(12 * MiB, True)]
    assert alloc.stats().allocated_bytes == 12 * MiB       # the whole unsplit block counts


def test_freeing_merges_the_pieces_back_into_one_free_block():
    alloc = CachingAllocator()
    alloc.malloc(3 * MiB // 2, "a"), alloc.malloc(5 * MiB, "b")
    alloc.free("a")
    assert blocks(alloc) == [(3 * MiB // 2, False), (5 * MiB, True), (27 * MiB // 2, False)]
    assert alloc.stats().inactive_split_bytes == 15 * MiB
    alloc.free("b")
    s = alloc.stats()
    assert blocks(alloc) == [(20 * MiB, False)]
    assert (s.allocated_bytes, s.inactive_split_bytes, s.inactive_split) == (0, 0, 0)
    assert s.reserved_bytes == 20 * MiB                     # cached, not given back


def test_best_fit_picks_the_smaller_of_two_free_blocks():
    alloc = CachingAllocator()
    for key, size in (("big", 14 * MiB), ("sep1", 12 * MiB), ("small", 12 * MiB), ("sep2", 12 * MiB)):
        alloc.malloc(size, key)
    small_addr = alloc.live["small"].addr
    alloc.free("big"), alloc.free("small")
    assert alloc.malloc(11 * MiB, "new").addr == small_addr    # 12 MiB fits better than 14 MiB


def test_a_large_pool_remainder_of_exactly_1_mib_is_not_split_off():
    alloc = CachingAllocator()
    alloc.malloc(19 * MiB, "a")                               # its segment rounds up to 20 MiB
    assert blocks(alloc) == [(20 * MiB, True)]                # remainder 1 MiB: not > kSmallSize
    other = CachingAllocator()
    other.malloc(3 * MiB, "a"), other.malloc(16 * MiB - 512, "b")
    assert blocks(other) == [(3 * MiB, True), (16 * MiB - 512, True), (MiB + 512, False)]


def test_max_split_size_keeps_an_oversize_block_from_being_split_or_reused_for_small_requests():
    settings = AllocatorSettings(max_split_size=20 * MiB)
    alloc = CachingAllocator(settings)
    alloc.malloc(30 * MiB, "a")
    alloc.free("a")
    alloc.malloc(24 * MiB, "b")                 # reuses the 30 MiB block whole: no split
    assert blocks(alloc) == [(30 * MiB, True)]
    assert alloc.stats().allocated_bytes == 30 * MiB and alloc.stats().requested_bytes == 24 * MiB
    alloc.free("b")
    alloc.malloc(5 * MiB, "c")                  # an oversize block is not used for it: new 20 MiB
    assert alloc.stats().reserved_bytes == 50 * MiB
    without = CachingAllocator()
    without.malloc(30 * MiB, "a"), without.free("a"), without.malloc(24 * MiB, "b")
    assert blocks(without) == [(24 * MiB, True), (6 * MiB, False)]


def test_an_oversize_block_too_big_to_round_up_is_freed_to_make_room():
    alloc = CachingAllocator(AllocatorSettings(max_split_size=20 * MiB), capacity=70 * MiB)
    alloc.malloc(50 * MiB, "a"), alloc.free("a")
    alloc.malloc(30 * MiB, "b")                 # 50 >= 30 + 20: not reused; released instead
    s = alloc.stats()
    assert (s.reserved_bytes, s.num_device_free, s.num_alloc_retries) == (30 * MiB, 1, 0)


def fragmented(settings):
    """Three 30 MiB tensors, freed, then three 25 MiB ones: 5 MiB slivers (100 MiB GPU)."""
    alloc = CachingAllocator(settings, capacity=100 * MiB)
    for key in "abc":
        alloc.malloc(30 * MiB, key)
    for key in "abc":
        alloc.free(key)
    for key in "xyz":
        alloc.malloc(25 * MiB, key)
    return alloc


def test_fragmentation_runs_out_of_memory_without_expandable_segments_and_fits_with_them():
    alloc = fragmented(AllocatorSettings())
    assert alloc.stats().inactive_split_bytes == 15 * MiB          # 3 slivers of 5 MiB
    with pytest.raises(OutOfMemory) as err:
        alloc.malloc(12 * MiB, "n")           # 75 MiB allocated, 25 MiB free in all: no 12 in one piece
    assert str(err.value).startswith(
        "CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has a total capacity of 100.00 MiB"
        " of which 10.00 MiB is free. Of the allocated memory 75.00 MiB is allocated by PyTorch,"
        " and 15.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory"
        " is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert isinstance(err.value, RuntimeError) and err.value.allocated == 75 * MiB
    assert alloc.stats().num_ooms == 1 and alloc.stats().num_alloc_retries == 1
    grown = fragmented(AllocatorSettings(expandable_segments=True))
    grown.malloc(12 * MiB, "n")                # one segment of 20 MiB pages: the 25 MiB tail fits it
    s = grown.stats()
    assert (s.allocated_bytes, s.reserved_bytes) == (87 * MiB, 100 * MiB)


def test_empty_cache_releases_only_unsplit_free_segments():
    alloc = CachingAllocator()
    alloc.malloc(12 * MiB, "whole"), alloc.malloc(2 * MiB, "part"), alloc.malloc(3 * MiB, "keep")
    alloc.free("whole"), alloc.free("part")
    assert alloc.stats().reserved_bytes == 32 * MiB
    alloc.empty_cache()                        # the 12 MiB segment goes; the split 20 MiB one stays
    s = alloc.stats()
    assert (s.reserved_bytes, s.segments, s.num_device_free) == (20 * MiB, 1, 1)
    alloc.free("keep"), alloc.empty_cache()
    assert alloc.stats().reserved_bytes == 0 and alloc.segments() == []


def test_expandable_segments_map_20_mib_pages_and_give_back_whole_free_pages():
    alloc = CachingAllocator(AllocatorSettings(expandable_segments=True))
    alloc.malloc(30 * MiB, "a")                # two 20 MiB pages
    alloc.malloc(5 * MiB, "b")                 # into the 10 MiB left: no new pages
    assert alloc.stats().reserved_bytes == 40 * MiB
    assert blocks(alloc) == [(30 * MiB, True), (5 * MiB, True), (5 * MiB, False)]
    alloc.malloc(100, "s")                     # the small pool grows by 2 MiB pages
    assert alloc.stats().reserved_bytes == 42 * MiB
    alloc.free("a"), alloc.empty_cache()       # page 0 lies wholly inside the free 30 MiB
    assert alloc.stats().reserved_bytes == 22 * MiB
    large = [s for s in alloc.segments() if s.pool == "large_pool"]
    assert [(s.total_size, s.expandable) for s in large] == [(20 * MiB, True)]
    assert [a for a, *_ in alloc.trace].count("segment_unmap") == 1


def test_round_size_follows_512_byte_steps_or_power_of_two_divisions():
    assert [round_size(n) for n in (1, 511, 512, 513, 1025)] == [512, 512, 512, 1024, 1536]
    assert roundup_power2_next_division(1200, 4) == 1280           # the source's own example
    assert roundup_power2_next_division(1024, 4) == 1024
    four = AllocatorSettings(roundup_power2_divisions=4)
    assert round_size(5 * MiB + 1, four) == 6 * MiB                # 4 MiB, 5, 6, 7 MiB steps
    assert round_size(1200, four) == 1536      # only above 512 x divisions: 512-byte steps below
    assert get_allocation_size(MiB) == 2 * MiB and get_allocation_size(MiB + 1) == 20 * MiB
    assert get_allocation_size(10 * MiB) == 10 * MiB


def test_format_size_prints_as_the_allocator_does():
    assert [format_size(n) for n in (512, 1024, 1536, MiB, 20 * MiB, 3 * 2**30)] == [
        "512 bytes", "1024 bytes", "1.50 KiB", "1024.00 KiB", "20.00 MiB", "3.00 GiB"]


def test_parse_alloc_conf_reads_what_pytorch_accepts():
    s = parse_alloc_conf("expandable_segments:True, max_split_size_mb:128")
    assert s.expandable_segments and s.max_split_size == 128 * MiB
    assert parse_alloc_conf("") == AllocatorSettings()
    assert parse_alloc_conf("PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync").backend == "cudaMallocAsync"
    s = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6")
    assert s.garbage_collection_threshold == 0.6
    assert s.divisions(100 * MiB) == 1 and s.divisions(300 * MiB) == 1   # 256 MiB..512 MiB: 1
    assert s.divisions(600 * MiB) == 2 and s.divisions(4 * 2**30) == 4
    s = parse_alloc_conf("large_segment_size_mb:40,pinned_use_background_threads:True")
    assert s.large_segment_size == 40 * MiB and s.unmodelled == (("pinned_use_background_threads", "True"),)
    assert get_allocation_size(2 * MiB, s.large_segment_size) == 40 * MiB
    # the pinned host allocator's size limits (torch 2.13's c10 reads both): valid, not modelled
    s = parse_alloc_conf("pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:1024")
    assert s == AllocatorSettings(unmodelled=(("pinned_max_round_threshold_mb", "64"),
                                              ("pinned_max_cached_size_mb", "1024")))


@pytest.mark.parametrize("text, fix", [
    ("expandible_segments:True", "use one of expandable_segments"),
    ("expandable_segments:true", "True or False"),
    ("max_split_size_mb:10", "must be >= 20"),
    ("max_split_size_mb:lots", "whole number"),
    ("garbage_collection_threshold:1.5", "(0.0, 1.0)"),
    ("roundup_power2_divisions:3", "power of two"),
    ("backend:cuda", "native, cudaMallocAsync"),
    ("expandable_segments", "a colon, then the value"),
    ("expandable_segments:True;max_split_size_mb:40", "separate settings with commas"),
    ("large_segment_size_mb:8", "must be > 10"),
])
def test_parse_alloc_conf_rejects_bad_strings_and_names_the_fix(text, fix):
    with pytest.raises(ValueError) as err:
        parse_alloc_conf(text)
    assert fix in str(err.value)


def test_bad_calls_raise_value_errors_that_name_the_fix():
    alloc = CachingAllocator()
    alloc.malloc(8, "a")
    with pytest.raises(ValueError, match="free it first"):
        alloc.malloc(8, "a")
    with pytest.raises(ValueError, match="malloc it first"):
        alloc.free("b")
    with pytest.raises(ValueError, match=">= 0"):
        alloc.malloc(-1, "c")
    with pytest.raises(ValueError, match="positive number of bytes"):
        CachingAllocator(capacity=0)
    with pytest.raises(ValueError, match="native, cudaMallocAsync"):
        AllocatorSettings(backend="async")


def test_a_zero_byte_request_takes_no_block():
    alloc = CachingAllocator()
    assert alloc.malloc(0, "empty") is None
    alloc.free("empty")
    assert alloc.stats().reserved_bytes == 0 and alloc.trace == []


def test_memory_stats_uses_torch_cuda_memory_stats_keys():
    alloc = CachingAllocator()
    alloc.malloc(100, "s"), alloc.malloc(3 * MiB, "l")
    m = alloc.memory_stats()
    assert m["reserved_bytes.all.current"] == 22 * MiB
    assert m["reserved_bytes.small_pool.current"] == 2 * MiB
    assert m["allocated_bytes.large_pool.peak"] == 3 * MiB and m["num_device_alloc"] == 2


STEP = [Event("alloc", 0, 4 * MiB, "params", "setup"),
        Event("alloc", 1, 100, "activations", "forward"),
        Event("alloc", 2, 64, "host", "forward"),            # host memory: no device block
        Event("alloc", 3, 0, "activations", "forward"),      # 0 bytes: no block
        Event("alloc", 4, 18 * MiB, "activations", "forward"),   # > the 16 MiB left: own segment
        Event("free", 4, 18 * MiB, "activations", "backward"),
        Event("free", 2, 64, "host", "backward"),
        Event("free", 1, 100, "activations", "backward"),
        Event("alloc", 5, 2 * MiB, "grads", "backward")]


def test_replay_gives_one_value_per_event_and_the_reserved_peak():
    run = replay(STEP)
    assert len(run.allocated) == len(run.reserved) == len(run.phase) == len(STEP)
    assert run.reserved == [20 * MiB, 22 * MiB, 22 * MiB, 22 * MiB, 40 * MiB, 40 * MiB,
                            40 * MiB, 40 * MiB, 40 * MiB]
    assert run.allocated[4] == 4 * MiB + 512 + 18 * MiB
    assert (run.peak_reserved, run.peak_index, run.phase[run.peak_index]) == (40 * MiB, 4, "forward")
    assert run.peak_allocated == 22 * MiB + 512 and run.peak_requested == 22 * MiB + 100
    assert run.fragmentation == (40 * MiB - (22 * MiB + 512)) / (40 * MiB)
    # the 2 MiB gradient best-fits the 16 MiB left in the first segment, not the free 18 MiB one
    assert run.allocated[-1] == 6 * MiB and run.oom is None
    assert blocks(run.allocator, 0) == [(4 * MiB, True), (2 * MiB, True), (14 * MiB, False)]
    assert run.stats.reserved_bytes == 40 * MiB


def test_replay_reports_where_it_ran_out_of_memory_instead_of_raising():
    run = replay(STEP, capacity=30 * MiB)
    assert run.oom.index == 4 and run.oom.phase == "forward" and run.oom.nbytes == 18 * MiB
    assert "Tried to allocate 18.00 MiB" in run.oom.message
    assert len(run.reserved) == 4                              # the series stop before the failure


def test_replay_rejects_a_free_of_a_storage_it_never_saw():
    with pytest.raises(ValueError, match="whole event log"):
        replay([Event("free", 7, 8, "activations", "forward")])


def test_min_capacity_is_where_a_fragmented_step_stops_running_out():
    """Two 6 MiB blocks live in one 20 MiB segment with a free 6 MiB hole between them: a new
    12 MiB request fits no hole, so the step needs 20 + 12 MiB - not the 24 MiB of tensors."""
    MiB = 2**20
    E = namedtuple("E", "action storage nbytes category phase")
    events = [E("alloc", 0, 6 * MiB, "activations", "forward"),
              E("alloc", 1, 6 * MiB, "activations", "forward"),
              E("alloc", 2, 6 * MiB, "activations", "forward"),
              E("free", 1, 6 * MiB, "activations", "forward"),
              E("alloc", 3, 12 * MiB, "activations", "forward")]
    from labkit.host.allocator import min_capacity
    assert min_capacity(events, tolerance=1) == 32 * MiB
    assert replay(events, capacity=32 * MiB - 512).oom is not None


def _non_monotone_events():
    """More room, more need: a kept 1 KiB (a 2 MiB small segment), then A (40 MiB) freed and
    cached, B (50 MiB) new. Under 92 MiB that segment is released for B and M (20 MiB) gets its
    own: L (60 MiB) then fits once B's is released, from 82 MiB. From 92 MiB A's segment stays
    cached, M splits it, and L finds room only from 102 MiB."""
    def alloc(key, nbytes):
        return Event("alloc", key, nbytes, "activations", "forward")

    def free(key):
        return Event("free", key, 0, "activations", "forward")
    return [alloc("t", KiB), alloc("A", 40 * MiB), free("A"), alloc("B", 50 * MiB),
            alloc("M", 20 * MiB), free("B"), alloc("L", 60 * MiB)]


def test_a_replay_can_run_on_a_device_and_fail_on_a_larger_one():
    from labkit.host.alloc_need import runs_on
    events, s = _non_monotone_events(), AllocatorSettings()
    ran = {mib: runs_on(events, s, mib * MiB) for mib in (81, 82, 91, 92, 101, 102)}
    assert ran == {81: False, 82: True, 91: True, 92: False, 101: False, 102: True}
    for s in (AllocatorSettings(), AllocatorSettings(expandable_segments=True),
              AllocatorSettings(max_split_size=30 * MiB)):    # runs_on counts reserved bytes only
        assert all(runs_on(events, s, c) == (replay(events, s, capacity=c).oom is None)
                   for c in range(80 * MiB, 104 * MiB, MiB // 2))


def test_need_band_finds_the_lowest_device_that_runs_below_the_bisected_one():
    """Bisection lands on the upper boundary (102 MiB); the scan below it finds the band's low
    end, which runs, with one step less failing."""
    from labkit.host.alloc_need import need_band
    from labkit.host.allocator import min_capacity
    events = _non_monotone_events()
    band = need_band(events, step=MiB)
    assert band.bisected == band.high == min_capacity(events, tolerance=MiB)
    assert 102 * MiB <= band.high < 103 * MiB and 82 * MiB <= band.low < 83 * MiB
    assert replay(events, capacity=band.low).oom is None
    assert replay(events, capacity=band.low - MiB).oom is not None
    assert band.highest_failure == band.high - MiB
    assert replay(events, capacity=band.highest_failure).oom is not None
    assert band.scanned[0] >= replay(events).peak_allocated and band.width == 20 * MiB
    above = need_band(events, step=MiB, above=4 * MiB)
    assert (above.low, above.high, above.replays) == (band.low, band.high, band.replays + 4)


@pytest.mark.parametrize("kwargs, fix", [({"step": 0}, r"4 \* 2\*\*20"), ({"above": -1}, "0 scans")])
def test_need_band_names_the_fix_for_a_bad_step_or_range(kwargs, fix):
    from labkit.host.alloc_need import need_band
    with pytest.raises(ValueError, match=fix):
        need_band(_non_monotone_events(), **kwargs)
