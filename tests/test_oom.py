"""OOM triage (labkit.host.oom): PyTorch's message read back to its numbers, the verdict's order,
and memory_summary's rows from the allocator model's statistics."""
import pytest

from labkit.host.allocator import AllocatorSettings, CachingAllocator, OutOfMemory
from labkit.host.oom import memory_summary, parse_oom

GiB, MiB = 2**30, 2**20

# the message's form in PyTorch 2.1-2.13 (c10/cuda/CUDACachingAllocator.cpp), numbers made up
REAL = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a "
        "total capacity of 23.64 GiB of which 1.12 GiB is free. Process 4121 has 6.20 GiB memory "
        "in use. Including non-PyTorch memory, this process has 16.30 GiB memory in use. Of the "
        "allocated memory 15.10 GiB is allocated by PyTorch, and 312.00 MiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_a_real_message_reads_back_to_its_numbers():
    r = parse_oom(REAL)
    assert (r.requested, r.free, r.others) == (round(1.95 * GiB), round(1.12 * GiB), round(6.2 * GiB))
    assert (r.allocated, r.cached, r.this_process) == (round(15.1 * GiB), 312 * MiB, round(16.3 * GiB))
    assert r.shortfall == round(1.95 * GiB) - round(1.12 * GiB)
    assert r.outside_pytorch == round(16.3 * GiB) - round(15.1 * GiB) - 312 * MiB
    assert r.verdict().startswith("another process")


def test_the_allocator_models_message_reads_back_within_its_rounding():
    a = CachingAllocator(capacity=100 * MiB)
    a.malloc(30 * MiB, "a")
    a.malloc(30 * MiB, "b")
    a.free("a")                            # a 30 MiB hole; 70 MiB of 100 MiB free is too little
    with pytest.raises(OutOfMemory) as oom:
        a.malloc(80 * MiB, "c")
    r = parse_oom(str(oom.value))
    assert r.requested == 80 * MiB and r.capacity == 100 * MiB
    assert r.allocated == a.stats().allocated_bytes == 30 * MiB
    assert r.cached == 0                   # the hole's segment was released before the retry
    assert r.this_process is None and r.verdict().startswith("the step's tensors")


@pytest.mark.parametrize("cached,others,this,verdict", [
    (600 * MiB, 0, None, "fragmentation first"),    # holes larger than the shortfall: try first
    (100 * MiB, 4 * GiB, None, "another process"),
    (100 * MiB, 0, 20 * GiB, "memory outside PyTorch"),   # 20 - 18 - 0.1 GiB: NCCL, extensions
    (100 * MiB, 0, 18 * GiB + 900 * MiB, "the step's tensors"),   # 0.8 GiB: a CUDA context's
    (100 * MiB, 0, 18 * GiB + 100 * MiB, "the step's tensors")])
def test_the_verdict_checks_fragmentation_then_others_then_outside_pytorch(cached, others, this,
                                                                          verdict):
    from labkit.host.oom import OomReport
    r = OomReport(requested=GiB, capacity=24 * GiB, free=GiB // 2, allocated=18 * GiB,
                  cached=cached, this_process=this, others=others)
    assert r.shortfall == GiB // 2 and r.verdict().startswith(verdict)


def test_an_older_message_with_its_typo_reads_and_other_text_is_refused():
    old = REAL.replace("capacity", "capacty").replace(" Process 4121 has 6.20 GiB memory in use.", "")
    assert parse_oom(old).others == 0 and parse_oom(old).capacity == round(23.64 * GiB)
    with pytest.raises(ValueError, match="whole text"):
        parse_oom("RuntimeError: CUDA error: an illegal memory access was encountered")


def test_memory_summary_prints_the_models_statistics_in_torchs_rows():
    a = CachingAllocator(AllocatorSettings())
    a.malloc(5 * MiB, "x")
    a.malloc(3 * MiB, "y")
    a.free("x")
    text = memory_summary(a.memory_stats())
    rows = {line[:24].strip(): line[24:].split() for line in text.splitlines()[1:-1]}
    assert rows["Allocated memory"] == ["3.00", "MiB", "8.00", "MiB"]
    assert rows["GPU reserved memory"] == ["20.00", "MiB", "20.00", "MiB"]   # one 20 MiB segment
    assert rows["Non-releasable memory"][:2] == ["17.00", "MiB"]   # the split segment's free rest
    assert rows["Allocations"] == ["1", "2"]
    assert text.splitlines()[-1].split() == ["cudaMalloc", "retries:", "0", "CUDA", "OOMs:", "0"]


def test_the_forms_real_messages_take_are_read():
    """Private pools (CUDA graphs, 2.2+), a log's line breaks, a container's PID namespace (this
    process printed as "Process N"), and a memory fraction's cap ("... allowed;")."""
    pools = REAL.replace("is allocated by PyTorch, and", "is allocated by PyTorch, with 2.00 GiB "
                         "allocated in private pools (e.g., CUDA Graphs), and")
    r = parse_oom(pools.replace(". ", ".\n  "))
    assert r.private_pools == 2 * GiB and r.live == r.allocated - 2 * GiB
    assert r.verdict().startswith("CUDA graphs' private pools")    # before another process
    container = ("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of "
                 "47.53 GiB of which 20.00 MiB is free. Process 1686436 has 47.51 GiB memory in use. "
                 "Of the allocated memory 46.00 GiB is allocated by PyTorch, and 1.15 GiB is "
                 "reserved by PyTorch but unallocated.")
    r = parse_oom(container)
    assert r.guessed_this and r.others == 0 and r.this_process == round(47.51 * GiB)
    assert r.verdict().startswith("fragmentation first")  # not "another process"
    neighbour = container.replace("47.53 GiB", "139.80 GiB").replace(    # an H200 shared
        "Process 1686436 has 47.51 GiB memory in use.",
        "Process 7 has 92.00 GiB memory in use. Process 1686436 has 47.51 GiB memory in use.")
    r = parse_oom(neighbour)                     # the smallest line that holds what PyTorch reserves
    assert r.this_process == round(47.51 * GiB) and r.others == 92 * GiB
    capped = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 "
              "GiB of which 40.00 GiB is free. 38.00 GiB allowed; Of the allocated memory 35.50 GiB "
              "is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated.")
    r = parse_oom(capped)
    assert r.allowed == 38 * GiB and r.shortfall == 2 * GiB - (38 * GiB - r.reserved)
    assert r.verdict().startswith("fragmentation first")        # 1.20 GiB cached >= 0.70 lacked
    with pytest.raises(ValueError, match="cudaMallocAsync"):
        parse_oom("CUDA out of memory. Tried to allocate 2.00 GiB. Allocation on device 0 would "
                  "exceed allowed memory. (out of memory) Currently allocated: 70 GiB ... "
                  "CUDA-side: cudaMallocAsync")


def test_sufficient_lists_every_memory_that_alone_covers_the_request():
    r = parse_oom(REAL)              # 917 MiB outside PyTorch: about a CUDA context, not a cure
    assert r.outside_pytorch < 2**30 and r.sufficient() == {"other processes": round(6.2 * GiB)}
    more = parse_oom(REAL.replace("this process has 16.30 GiB", "this process has 17.30 GiB"))
    assert more.sufficient() == {"other processes": round(6.2 * GiB),
                                 "outside PyTorch": more.outside_pytorch}   # above 1 GiB: counted
    with pytest.raises(ValueError, match="memory_stats"):
        memory_summary({})
