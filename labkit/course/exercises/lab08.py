"""Lab 08's exercises: the host and the caching allocator."""
from __future__ import annotations

from labkit.course.exercises.core import register


@register(
    "08-shm-image-loader",
    question="""A DataLoader with 6 workers and prefetch_factor=4 yields batches of 32 images,
3 x 512 x 512 in fp32. How many MiB of /dev/shm do its batches take at most, by the lab's
formula (an upper bound: batches in flight plus two the loop may hold, each in whole 4 KiB
pages)? Give one decimal; the solution says whether Docker's default /dev/shm holds them.""",
    unit="MiB", rtol=1e-3,
    hint="In flight: num_workers x prefetch_factor; the loop holds up to two more. "
         "labkit.host.shm computes the bound from one batch's bytes.",
    solution="""one batch is 32 x 3 x 512 x 512 x 4 B = {batch:,} B ({pages:,} pages of 4 KiB);
{workers} workers x prefetch {prefetch} = {in_flight} in flight, plus 2 held by the loop: {alive}
batches, {needed:,} B = {answer:.1f} MiB (labkit.host.shm.shm_needed): it does not fit Docker's
default 64 MiB ({times:.1f}x). A safe flag for one rank: ``{flag}``
(labkit.host.shm.docker_shm_flag: twice the need, as a power of two); with N ranks in the container pass ranks=N, and nccl=True
when they talk over NCCL.""",
)
def _shm_image_loader():
    from labkit.host.shm import batches_alive, batch_shm_bytes, docker_shm_flag, shm_needed
    batch, workers, prefetch = 32 * 3 * 512 * 512 * 4, 6, 4
    needed = shm_needed(batch, workers, prefetch)
    MiB = 2**20
    return {"answer": needed / MiB, "batch": batch, "pages": batch_shm_bytes(batch) // 4096,
            "workers": workers, "prefetch": prefetch, "in_flight": workers * prefetch,
            "alive": batches_alive(workers, prefetch), "needed": needed,
            "times": needed / (64 * MiB), "flag": docker_shm_flag(needed)}


@register(
    "08-small-pool-tensors",
    question="""How many tensors of 100,000 bytes each does PyTorch's CUDA caching allocator fit
into one segment of its small pool before it must reserve a second one?""",
    unit="tensors", rtol=0,
    hint="Requests of at most 1 MiB share 2 MiB segments; each is first rounded up to a multiple "
         "of 512 bytes (labkit.host.allocator.round_size).",
    solution="""100,000 B rounds up to {rounded:,} B (a multiple of 512); a small-pool segment is
{segment:,} B, so {answer} fit ({left:,} B stay free). labkit.host.allocator.CachingAllocator
reserves its second segment at tensor {second}.""",
)
def _small_pool_tensors():
    from labkit.host.allocator import CachingAllocator, kSmallBuffer, round_size
    alloc, n = CachingAllocator(record_trace=False), 0
    while alloc.stats().reserved_bytes <= kSmallBuffer:
        alloc.malloc(100_000, n)
        n += 1
    rounded = round_size(100_000)
    return {"answer": n - 1, "rounded": rounded, "segment": kSmallBuffer,
            "left": kSmallBuffer - (n - 1) * rounded, "second": n}


@register(
    "08-reserved-three-tensors",
    question="""A fresh caching allocator is asked for tensors of 3 MiB, 7 MiB and 11 MiB, in
that order, none of them freed. How many MiB does it reserve from the GPU?""",
    unit="MiB", rtol=0,
    hint="A request between 1 and 10 MiB that finds no free block takes a 20 MiB segment and "
         "splits it; a later request takes the smallest free block that fits; a larger one "
         "gets its own segment, rounded up to 2 MiB.",
    solution="""3 MiB: no free block, a new {first} MiB segment, split ({rest1} MiB free); 7 MiB:
the best fit is that remainder, split again ({rest2} MiB free); 11 MiB: nothing fits, a new
segment of 11 MiB rounded up to 2 MiB = {third} MiB. Reserved: {answer:g} MiB for {used} MiB of
tensors (labkit.host.allocator.CachingAllocator).""",
)
def _reserved_three_tensors():
    from labkit.host.allocator import CachingAllocator
    MiB, alloc, reserved = 2**20, CachingAllocator(record_trace=False), []
    for i, size in enumerate((3, 7, 11)):
        alloc.malloc(size * MiB, i)
        reserved.append(alloc.stats().reserved_bytes // MiB)
    return {"answer": reserved[-1], "first": reserved[0], "rest1": reserved[0] - 3,
            "rest2": reserved[0] - 10, "third": reserved[2] - reserved[1], "used": 21}


@register(
    "08-pinned-staging-buffer",
    question="""On a CUDA machine you pin two staging buffers with torch.empty(..., pin_memory=True):
300 MiB for activations and 520 MiB for optimizer states. How many MiB of page-locked host memory
does PyTorch's pinned-memory cache take for the two?""",
    unit="MiB", rtol=0,
    hint="By default the pinned (host) caching allocator rounds each request up on its own "
         "(labkit.host.pinned models the rule).",
    solution="""Each request rounds up to the next power of two: 300 MiB -> {first:g} MiB, 520 MiB ->
{second:g} MiB, {answer:g} MiB in all (CachingHostAllocator: c10::llvm::PowerOf2Ceil), {extra:g} MiB
more than asked. Freed, a block stays cached for the next request that fits until
torch.accelerator.empty_host_cache() (torch.cuda.host_memory_stats() counts the rounded bytes).""",
)
def _pinned_staging_buffer():
    from labkit.host.pinned import pinned_host_bytes
    MiB = 2**20
    first, second = (pinned_host_bytes(n * MiB) // MiB for n in (300, 520))
    return {"answer": first + second, "first": first, "second": second,
            "extra": first + second - 820}


@register(
    "08-eval-leak-per-batch",
    question="""An evaluation loop over `small` at batch 8 x 128 tokens enters
torch.autocast("cpu", dtype=torch.bfloat16) for each batch and sums its losses as tensors
(total = total + model(x, y)), without torch.no_grad(). How many MiB does each evaluation batch
leave alive? Predict it, then write the loop and run two batches under lk.MemoryTracker.""",
    unit="MiB", rtol=0.01,
    hint="A batch keeps what its forward saved for a backward that never comes. Autocast's cast "
         "cache is dropped when its block exits, but the graph keeps the bf16 weight copies it "
         "saved: 2 bytes for every weight a matmul used (the linear layers and the LM head, not "
         "the embedding nor the norms). The estimate has both terms in bf16-mixed.",
    solution="""Every batch keeps its graph with what the forward saved, and its own bf16 copy of
every matmul weight: {answer:.2f} MiB measured (labkit.training.leaks.run_leak), of which
{copies:.2f} MiB are the copies (2 B x {weights:,} weights); the formula
(labkit.training.leaks.kept_per_step: lk.estimate's saved activations and weight cache)
gives {expected:.2f} MiB. With autocast entered once around the loop the copies are made once:
{around:.2f} MiB a batch. Over a 1,000-batch evaluation that is {thousand:.1f} GiB. Under
torch.no_grad() (and with total += loss.item()) nothing stays.""",
)
def _eval_leak_per_batch():
    from labkit.predict import count_params
    from labkit.training.leaks import kept_per_step, run_leak
    MiB, B, T = 2**20, 8, 128
    per_batch, around = (run_leak(leak, cfg="small", batch=B, seq=T, steps=2).per_step
                         for leak in ("eval, autocast per batch", "eval, autocast around loop"))
    pc = count_params("small")
    weights = pc.total - pc.by_component["embedding"] - pc.by_component["norms"]
    return {"answer": per_batch / MiB, "copies": (per_batch - around) / MiB, "weights": weights,
            "expected": kept_per_step("eval, autocast per batch", "small", B, T) / MiB,
            "around": around / MiB, "thousand": 1000 * per_batch / 2**30}
