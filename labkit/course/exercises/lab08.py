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
    "08-max-split-needs",
    question="""Replay the lab's six steps of varying length (section 3: LLaMA-2-7B's shapes cut to
4 layers, batch 1, seq 1024, 2048, 1536, 4096, 3072, 2560, bf16-mixed, fake tensors with CUDA's
defaults: the notebook's mv.events) through the caching allocator with
PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128. How many GiB of device memory does it need
(labkit.host.allocator.min_capacity, to 4 MiB)? Then set it beside what the default settings
need, and beside what each reserves with no memory pressure.""",
    unit="GiB", rtol=1e-3,
    hint="parse_alloc_conf turns the setting's text into AllocatorSettings; "
         "min_capacity(mv.events, settings, tolerance=4 * MiB) bisects a device the replay runs "
         "on with 4 MiB less failing; replay(mv.events, settings).peak_reserved is what it keeps "
         "with no limit.",
    solution="""min_capacity(mv.events, parse_alloc_conf("max_split_size_mb:128"), tolerance=4 MiB) =
{answer:.2f} GiB, against {native:.2f} GiB bisected with the default settings. Bisection finds one
boundary: the default allocator is not monotonic in memory here, and
labkit.host.alloc_need.need_band, scanning every 4 MiB below, finds it running from
{native_low:.2f} GiB (and failing on some devices between that and {native:.2f} GiB). So it saves
{saved_low:.0f}-{saved:.0f} MiB, read to that band; with it, {split_band}. Cached
blocks of 128 MiB or more are never split, so small requests cannot strand free space inside them.
With no pressure it reserves {res_split:.2f} GiB against {res_native:.2f} GiB: a large cached block no longer
serves a smaller request, so more segments are made; nvidia-smi looks worse while the
out-of-memory comes later. roundup_power2_divisions:4, bisected, needs {power2:.2f} GiB here,
{power2_gap:.2f} GiB {power2_word} the default's band (each request rounds up to one of four
sizes per power of two). All from labkit's one-stream replay, not from a GPU.""",
)
def _max_split_needs():
    from labkit.host.alloc_need import need_band
    from labkit.host.allocator import min_capacity, parse_alloc_conf, replay
    MiB, GiB = 2**20, 2**30
    events = _six_varying_steps()
    conf = {name: parse_alloc_conf(text) for name, text in (
        ("native", ""), ("split", "max_split_size_mb:128"), ("power2", "roundup_power2_divisions:4"))}
    band = {name: need_band(events, conf[name], step=4 * MiB) for name in ("native", "split")}
    split, native, power2 = (band["split"].bisected, band["native"],
                             min_capacity(events, conf["power2"], tolerance=4 * MiB))
    split_band = ("the scan below its bisected size finds no device that runs"
                  if band["split"].low == split else
                  f"it runs from {band['split'].low / GiB:.2f} GiB on some devices")
    above = power2 > native.high
    return {"answer": split / GiB, "native": native.high / GiB, "native_low": native.low / GiB,
            "saved": (native.high - band["split"].low) / MiB,
            "saved_low": (native.low - split) / MiB, "split_band": split_band,
            "power2": power2 / GiB, "power2_word": "above" if above else "below",
            "power2_gap": (power2 - native.high if above else native.low - power2) / GiB,
            "res_split": replay(events, conf["split"], record_trace=False).peak_reserved / GiB,
            "res_native": replay(events, conf["native"], record_trace=False).peak_reserved / GiB}


def _six_varying_steps():
    """The storage events of section 3's six steps of varying length (the notebook's mv.events)."""
    from labkit.core.config import preset
    from labkit.training.measure import measure_step
    seqs = [1024, 2048, 1536, 4096, 3072, 2560]
    cfg4 = preset("llama-2-7b").replace(layers=4, name="llama-2-7b, 4 layers")
    return measure_step(cfg4, 1, seqs[0], precision="bf16-mixed", fake=True, device="cuda",
                        events=True, then=[(1, s) for s in seqs[1:]]).events


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
torch.no_grad() (and with total += loss.detach()) nothing stays.""",
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


OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 "
               "GiB of which 40.10 GiB is free. Including non-PyTorch memory, this process has "
               "37.20 GiB memory in use. 38.00 GiB allowed; Of the allocated memory 35.50 GiB "
               "is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated.")


@register(
    "08-oom-capped-shortfall",
    question=f"""To rehearse a 40 GB card on an 80 GB one, a script calls
torch.cuda.set_per_process_memory_fraction(0.48), and stops with:

    {OOM_MESSAGE}

The card has 40 GiB free, and the request is 2 GiB: how many GiB did the request actually lack?
Then triage it: fragmentation, another process, memory outside PyTorch, or the step's tensors?""",
    unit="GiB", rtol=0.005,
    hint="'38.00 GiB allowed' is the fraction's cap. Under it, PyTorch may reserve at most 38 GiB: "
         "what it already reserves is allocated + reserved-but-unallocated. The room left is the "
         "cap less that, or the device's free memory if smaller. labkit.host.oom.parse_oom(message) "
         "reads the numbers; .shortfall and .verdict() check yours.",
    solution="""PyTorch reserves 35.50 + 1.20 = 36.70 GiB of the 38.00 GiB allowed: 1.30 GiB of
room, so the 2.00 GiB request lacked {answer:.2f} GiB, not nothing (the device's 40 GiB free do
not count under the cap). The 1.20 GiB cached ({share:.1%} of what PyTorch reserves) covers
it: try expandable segments under the same cap first. No other process is printed, and the
{outside:.2f} GiB this process holds outside PyTorch is about what a CUDA context takes.
parse_oom's verdict: "{verdict}". Only if the step still fails with
expandable segments is the rehearsed 40 GB card too small for it.""",
)
def _oom_capped_shortfall():
    from labkit.host.oom import parse_oom
    r = parse_oom(OOM_MESSAGE)
    GiB = 2**30
    return {"answer": r.shortfall / GiB, "share": r.cached / r.reserved,
            "verdict": r.verdict().split(":")[0], "outside": r.outside_pytorch / GiB}
