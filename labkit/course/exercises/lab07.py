"""Lab 07's exercises: attention, the KV cache, MLA and a paged cache."""
from __future__ import annotations

from labkit.core.config import preset
from labkit.core.units import torch_dtype
from labkit.course.exercises.core import GiB, register
from labkit.predict import kv_cache_bytes


@register(
    "07-naive-minus-sdpa-gqa",
    question="""Section 1's naive core keeps, in every layer, the (B, H, T, T) probabilities and k
and v repeated from the model's kv heads to all H query heads; labkit's SDPA call
(enable_gqa=True) keeps k and v at the kv heads and one fp32 log-sum-exp per row and head
instead (transformers' SDPA path repeats k and v too whenever it is given an attention mask).
Mistral 7B uses grouped-query attention.
Predict how many GiB more activations a training step of mistral-7b keeps with naive attention
than with SDPA, at batch 1 x 4096 tokens under bf16-mixed (autocast), all layers; then check
with lk.estimate("mistral-7b", 1, 4096, precision="bf16-mixed", attention=a).saved_activations
for a = "naive" and "sdpa".""",
    unit="GiB", rtol=0.004,
    hint="Per layer, three terms: the probabilities (bytes per pair and head under autocast: "
         "section 1), the extra heads of k and v (in the autocast dtype), less the log-sum-exp. "
         "lk.preset('mistral-7b') has layers, heads, kv_heads and head_dim. 1 GiB = 2^30 bytes.",
    solution="""Per layer: probabilities {heads} heads x 4096^2 pairs x 6 B (the fp32 softmax and
its bf16 copy) = {probs:,} B; k and v repeated from {kv_heads} to {heads} heads, bf16: 2 x {extra}
extra heads x 4096 x {d} x 2 B = {repeat:,} B; less SDPA's log-sum-exp {heads} x 4096 x 4 B =
{lse:,} B.
x {layers} layers = {predicted:,} B = {answer:.2f} GiB; lk.estimate's saved activations differ by
{measured:,} B ({saved_naive:.2f} - {saved_sdpa:.2f} GiB). The repeated k and v are {share:.1%} of
it: forgetting them gives {without:.2f} GiB. The step's peak moves from the {phase_sdpa} phase
({peak_sdpa:.1f} GiB with SDPA) to the {phase_naive} phase ({peak_naive:.1f} GiB naive).""",
)
def _naive_minus_sdpa_gqa():
    from labkit.predict import estimate
    c, batch, seq = preset("mistral-7b"), 1, 4096
    H, Hkv, d, L = c.heads, c.kv_heads, c.head_dim, c.layers
    probs = batch * H * seq * seq * (4 + 2)                # fp32 softmax + its bf16 copy
    repeat = 2 * batch * (H - Hkv) * seq * d * 2           # k and v, the extra heads, bf16
    lse = batch * H * seq * 4                              # SDPA's fp32 log-sum-exp
    naive, sdpa = (estimate(c, batch, seq, precision="bf16-mixed", attention=a)
                   for a in ("naive", "sdpa"))
    measured = naive.saved_activations - sdpa.saved_activations
    predicted = L * (probs + repeat - lse)
    return {"answer": measured / GiB, "heads": H, "kv_heads": Hkv, "extra": H - Hkv, "d": d,
            "layers": L, "probs": probs, "repeat": repeat, "lse": lse, "predicted": predicted,
            "measured": measured, "saved_naive": naive.saved_activations / GiB,
            "saved_sdpa": sdpa.saved_activations / GiB, "share": L * repeat / measured,
            "without": L * (probs - lse) / GiB,
            "peak_naive": naive.total / GiB, "phase_naive": naive.peak_phase,
            "peak_sdpa": sdpa.total / GiB, "phase_sdpa": sdpa.peak_phase}


TILE_SIZES = (64, 128, 256, 512)       # rows per tile (real GPU kernels use 64-128)


@register(
    "07-tiled-peak-block",
    question="""Section 3's tracker counts, at the peak of one forward + backward beyond the inputs,
SDPA's fused CPU kernel as five (H, N, d) fp32 tensors and labkit's tiled core as four, plus two
(H, N) fp32 rows (the log-sum-exp and D) and five (H, b, b) fp32 tiles (S, P, dS and two
temporaries) for tiles of b rows. With 8 heads of 64 at N = 2048, what is the smallest tile size
b among 64, 128, 256 and 512 at which the tiled core peaks higher than SDPA? Reason it out, then
check with labkit.transformer.attention.core_peak_bytes("tiled", 2048, block=b) against
core_peak_bytes("sdpa", 2048).""",
    unit="rows per tile", rtol=0,
    hint="Only the tiles grow with b. The tiled core peaks higher once its five (H, b, b) tiles "
         "outweigh what SDPA holds beyond the tiled core's four (H, N, d) tensors and two (H, N) "
         "rows. Solve for b, then take the next size in the list.",
    solution="""SDPA holds one (H, N, d) fp32 tensor more than the tiled core: 8 x 2048 x 64 x 4 B =
{unit:.2f} MiB, less the tiled core's two rows, 2 x 8 x 2048 x 4 B = {rows:.3f} MiB: {gap:.3f} MiB.
The tiles, 5 x 8 x b^2 x 4 B, pass it from b^2 > {b2:,.0f}, b > {b_min:.0f}: the first size in the
list is {answer}. Measured (core_peak_bytes, N = 2048): {table}; SDPA {sdpa:.2f} MiB. The tiles
do not grow with N: at N = 4096 the crossing moves to b > {b_min_4096:.0f}, since SDPA's extra
tensor doubles. A GPU kernel keeps its tiles in on-chip memory (SRAM), not in GPU memory: the
tile term is the cost of labkit's PyTorch loop, which makes each tile a tensor. SDPA's fifth
tensor is one gradient copied into these (B, H, N, d)-contiguous leaves: it disappears when q, k
and v are views of a model's projections (core_peak_bytes(..., layout="model")).""",
)
def _tiled_peak_block():
    from labkit.transformer.attention import core_peak_bytes
    H, N, d, MiB = 8, 2048, 64, 2**20
    sdpa = core_peak_bytes("sdpa", N, heads=H, head_dim=d)
    measured = {}
    for b in TILE_SIZES:                    # in order, up to the first that peaks above SDPA
        measured[b] = core_peak_bytes("tiled", N, heads=H, head_dim=d, block=b)
        if measured[b] > sdpa:
            break
    else:
        raise RuntimeError(f"the tiled core stays below SDPA up to tiles of {b}")
    gap = H * N * d * 4 - 2 * H * N * 4                  # SDPA's fifth tensor less the two rows
    gap_4096 = H * 4096 * d * 4 - 2 * H * 4096 * 4
    table = ", ".join(f"b = {b}: {m / MiB:.2f} MiB" for b, m in measured.items())
    return {"answer": b, "unit": H * N * d * 4 / MiB, "rows": 2 * H * N * 4 / MiB,
            "gap": gap / MiB, "b2": gap / (5 * H * 4), "b_min": (gap / (5 * H * 4)) ** 0.5,
            "b_min_4096": (gap_4096 / (5 * H * 4)) ** 0.5, "table": table,
            "sdpa": sdpa / MiB, "measured": measured}


WATERMARKS = (5, 10, 15, 20, 25, 30, 35, 40)       # percent of the blocks kept free


@register(
    "07-watermark-no-preemption",
    question="""Section 5's paged server (LLaMA-2-13B in fp16, 12 GiB of cache, the 500 requests of
paged.request_stream(500, seed=0)) admits a request only while a watermark of its blocks stays
free. Run paged.simulate("paged", 12 * 2**30, stream, watermark=w) for watermarks in steps of
5%: what is the smallest at which no request is sent back to the queue?""",
    unit="percent", rtol=0,
    hint="Loop over w = 0.05, 0.10, 0.15, ... and read .preempted of each simulation; the first "
         "that is 0 is the answer (about a second each).",
    solution="""Requests sent back, and requests at once on average, by watermark:
{table}.
The first with none sent back: {answer}%. The price is concurrency: {running:.1f} requests at
once on average against {eager:.1f} at vLLM V0's 1% watermark ({eager_preempted} sent back there,
{eager_recomputed:,} tokens prefilled again). The answer belongs to this stream and budget: a
server tunes its watermark against its own.""",
)
def _watermark_no_preemption():
    from labkit.transformer.paged import request_stream, simulate
    stream, budget = request_stream(500, seed=0), 12 * GiB
    runs = {}
    for w in WATERMARKS:                    # in order, up to the first with none sent back
        runs[w] = simulate("paged", budget, stream, watermark=w / 100)
        if runs[w].preempted == 0:
            break
    else:
        raise RuntimeError(f"requests are sent back at every watermark up to {w}%")
    answer = w
    eager = simulate("paged", budget, stream, watermark=0.01)
    table = "; ".join(f"{w}%: {s.preempted} sent back, {s.mean_running:.1f} at once"
                      for w, s in runs.items())
    return {"answer": answer, "table": table, "running": runs[answer].mean_running,
            "eager": eager.mean_running, "eager_preempted": eager.preempted,
            "eager_recomputed": eager.recomputed}


@register(
    "07-paged-waste",
    question="""A paged KV cache (PagedAttention, the vLLM paper) hands LLaMA-2-13B's fp16 cache
out in blocks of 16 tokens, so a request wastes at most the empty slots of its last block. How
many MiB can one request waste at most? (A server that reserves a contiguous slab of 2048
tokens per request wastes far more: the solution compares a request that stops at 300
tokens.) Give two decimals.""",
    unit="MiB", rtol=1e-3,
    hint="How empty can a request's last block be, at worst? lk.kv_cache_bytes gives the "
         "cache's bytes for any number of tokens; labkit.transformer.paged.make_cache('paged', "
         "...) measures it (.fragmentation_bytes). 1 MiB = 2^20 bytes.",
    solution="""one token of LLaMA-2-13B: 2 x {layers} layers x {kv} heads x {d} dims x 2 bytes =
{per:,} bytes; at most {block} - 1 = {slack} empty slots: {waste:,} bytes = {answer:.2f} MiB
(a PagedKVCache one token into its last block: fragmentation_bytes = {measured:,}). The
300-token request holds {blocks} blocks, {paged_used:g} MiB of them empty. A contiguous
slab of {max_seq} tokens reserves {slab:,.0f} MiB for it and fills {used:.0f} MiB: {contiguous:,.0f}
MiB ({contiguous_share:.0%}) empty, {ratio:.0f}x the paged worst case
(labkit.transformer.paged.make_cache(kind, ...) on the meta device).""",
)
def _paged_waste():
    from labkit.transformer.paged import make_cache
    c, block, max_seq, used = preset("llama-2-13b"), 16, 2048, 300
    per = kv_cache_bytes(c, seq=1, dtype="fp16")                # one token, all layers

    def cache_after(kind, tokens):
        cache = make_cache(kind, kv_cache_bytes(c, seq=max_seq, dtype="fp16"), c,
                           block_size=block, max_seq=max_seq, dtype="fp16")
        cache.admit("request")
        cache.grow("request", tokens)
        return cache

    waste = (block - 1) * per
    paged, slab = cache_after("paged", used), cache_after("contiguous", used)
    MiB = 2**20
    return {"answer": waste / MiB, "layers": c.layers, "kv": c.kv_heads, "d": c.head_dim,
            "per": per, "block": block, "slack": block - 1, "waste": waste,
            "measured": cache_after("paged", block + 1).fragmentation_bytes,
            "blocks": paged.blocks_for(used), "paged_used": paged.fragmentation_bytes / MiB,
            "max_seq": max_seq, "slab": slab.reserved_bytes / MiB, "used": slab.used_bytes / MiB,
            "contiguous": slab.fragmentation_bytes / MiB,
            "contiguous_share": slab.fragmentation_bytes / slab.reserved_bytes,
            "ratio": slab.fragmentation_bytes / waste}


@register(
    "07-decode-batch-for-80-percent",
    question="""Mistral-7B decodes at 4,096 tokens of context on an A100 80GB (2,039 GB/s), bf16
weights and cache. A step reads the weights W once for the whole batch and each sequence's
cache K, so with bandwidth B the batch makes b x B / (W + b x K) tokens a second, which no batch
passes: B / K. From which batch b on does it reach 80% of that ceiling? Work it out from W and
K first (labkit.transformer.decoding.decode_step gives both), then check with the roofline's
tokens_per_second and cache_ceiling. Does that batch fit the card?""",
    unit="sequences", rtol=0,
    hint="b x B / (W + b x K) >= 0.8 x B / K  <=>  b x K >= 0.8 x (W + b x K)  <=>  b >= 4 W / K. "
         "W: decode_step('mistral-7b', 1, 4096).weight_bytes; K: its kv_bytes (one sequence). "
         "largest_batch('mistral-7b', 4096, 'a100-80gb') says how many fit.",
    solution="""W = {w:.2f} GiB, K = {k:.3f} GiB per sequence: b >= 4 W / K = {bound:.1f}, so from
batch {answer} on (the roofline: {tps:,.0f} of its {ceiling:,.0f} tokens/s ceiling; batch {below}
makes {below_share:.1%}). Bandwidth bounds it there: the weights' FLOPs take {flops_ms:.1f} ms,
their bytes {bytes_ms:.1f} ms. The card fits {fits} sequences beside the weights (90% of its
memory): {verdict}. Half the cache per sequence (an 8-bit cache) doubles the ceiling, and the
batch that reaches 80% of it.""",
)
def _decode_batch_for_80_percent():
    from labkit.transformer.decoding import decode_step, largest_batch
    GiB, a100 = 2**30, "a100-80gb"
    one = decode_step("mistral-7b", 1, 4096)
    ceiling = one.cache_ceiling(a100)
    b = 1
    while decode_step("mistral-7b", b, 4096).tokens_per_second(a100) < 0.8 * ceiling:
        b += 1
    fits = largest_batch("mistral-7b", 4096, a100)
    below = decode_step("mistral-7b", b - 1, 4096).tokens_per_second(a100)
    return {"answer": b, "w": one.weight_bytes / GiB, "k": one.kv_bytes / GiB,
            "bound": 4 * one.weight_bytes / one.kv_bytes, "ceiling": ceiling,
            "tps": decode_step("mistral-7b", b, 4096).tokens_per_second(a100), "below": b - 1,
            "below_share": below / ceiling, "fits": fits,
            "verdict": "it fits" if b <= fits else "it does not fit",
            "flops_ms": 1e3 * decode_step("mistral-7b", b, 4096).weight_flops / 312e12,
            "bytes_ms": 1e3 * one.weight_bytes / 2039e9}


@register(
    "07-kv-int8-gib",
    question="""Predict, then check. LLaMA-3-8B (32 layers, 8 KV heads of 128 numbers) serves 32
sequences of 8,192 tokens with an int8 KV cache that keeps one fp32 scale per token and KV head,
as labkit's QuantisedKVCache does. How many GiB does the cache take? What would bf16 take, and
what share of it do the scales add?""",
    unit="GiB", rtol=1e-3,
    hint="Per token, layer and KV head: keys and values, each 128 one-byte codes and a 4-byte "
         "scale. Check without allocating 17 GiB: QuantisedKVCache(lk.preset('llama-3-8b')"
         ".replace(layers=1), 32, 8192, fmt='int8', device='meta').nbytes, times 32 layers "
         "(from labkit.transformer.kv_quant import QuantisedKVCache).",
    solution="""32 sequences x 8,192 tokens x 32 layers x 8 heads x 2 (k, v) x (128 + 4) B =
{bytes:,} B = {answer:.2f} GiB. In bf16: {bf16:.2f} GiB ({share:.1%} of it in int8); the scales
add {scales:.2f} GiB, {scale_share:.1%} of the int8 cache. One scale per tensor (vLLM's FP8
cache) would make them negligible.""",
)
def _kv_int8_gib():
    from labkit.transformer.kv_quant import QuantisedKVCache
    c = preset("llama-3-8b")
    one_layer = QuantisedKVCache(c.replace(layers=1), 32, 8192, fmt="int8", device="meta")
    nbytes, bf16 = one_layer.nbytes * c.layers, kv_cache_bytes(c, 32, 8192, "bf16")
    scales = 32 * 8192 * c.layers * c.kv_heads * 2 * 4
    return {"answer": nbytes / GiB, "bytes": nbytes, "bf16": bf16 / GiB, "share": nbytes / bf16,
            "scales": scales / GiB, "scale_share": scales / nbytes}


@register(
    "07-prefix-shared-mib",
    question="""A server runs 40 requests of LLaMA-2-13B in fp16 (40 layers, 40 KV heads of 128
numbers), each starting with the same 1,000-token system prompt, in 16-token blocks. Prefix
caching shares full blocks only, so each request keeps the prompt's last partial block to
itself. How many MiB of cache does sharing save against every request holding its own copy?""",
    unit="MiB", rtol=1e-4,
    hint="Full blocks of 1,000 tokens: 1000 // 16. Shared, they are held once instead of 40 "
         "times. A token costs 2 x layers x kv_heads x head_dim x 2 bytes. Check with "
         "paged.PagedKVCache(..., device='meta'): admit one request, grow it, then share it "
         "39 times and compare reserved_bytes.",
    solution="""1,000 tokens fill {full} blocks of 16 ({shared} tokens); the last {tail} tokens
stay in a block of each request's own. Each token takes {per_token:,} bytes, so one copy of the
shared blocks is {copy:.1f} MiB, and 39 of the 40 copies are saved: {answer:.1f} MiB
(PagedKVCache on the meta device: {measured:.1f} MiB less reserved).""",
)
def _prefix_shared():
    from labkit.transformer.paged import PagedKVCache
    c = preset("llama-2-13b")
    per_token = kv_cache_bytes(c, 1, 1, "fp16")
    full = 1000 // 16
    reserved = {}
    for sharing in (False, True):
        cache = PagedKVCache(4096, 16, c.layers, c.kv_heads, c.head_dim, torch_dtype("fp16"),
                             "meta")
        cache.admit(0)
        cache.grow(0, 1000)
        for r in range(1, 40):
            if sharing:
                cache.share(0, r, 1000)
            else:
                cache.admit(r)
            cache.grow(r, 1000 - cache.tokens(r))
        reserved[sharing] = cache.reserved_bytes
    return {"answer": 39 * full * 16 * per_token / 2**20, "full": full, "shared": full * 16,
            "tail": 1000 - full * 16, "per_token": per_token,
            "copy": full * 16 * per_token / 2**20,
            "measured": (reserved[False] - reserved[True]) / 2**20}


@register(
    "07-pool-share-tokens",
    question="""A vLLM-style server runs LLaMA-3-8B in bf16 (32 layers, 8 KV heads of 128 numbers)
on one H100-80GB (79.65 GiB, the course's table) at gpu_memory_utilization 0.9. To leave room
for a second process you lower it to 0.85. How many fewer tokens does its KV-cache pool hold?
(The weights and the profiled peak do not change.)""",
    unit="tokens", rtol=1e-3,
    hint="The share falls by 5% of the GPU, and all of it comes out of the pool. A token costs "
         "2 x layers x kv_heads x head_dim x 2 bytes. Check with "
         "serving.size_block_pool('llama-3-8b', 'h100-80gb', share).tokens for both shares.",
    solution="""5% of 79.65 GiB is {freed:,} bytes; a token of LLaMA-3-8B's cache is {per_token:,}
bytes (128 KiB), so the pool holds {answer:,.0f} fewer tokens, in whole blocks of 16 ({at_90:,}
tokens at 0.9, {at_85:,} at 0.85): {requests:.1f} fewer requests of 8,192 tokens.""",
)
def _pool_share_tokens():
    from labkit.training.serving import size_block_pool
    pools = {share: size_block_pool("llama-3-8b", "h100-80gb", share) for share in (0.9, 0.85)}
    at_90, at_85 = pools[0.9].tokens, pools[0.85].tokens
    return {"answer": at_90 - at_85, "at_90": at_90, "at_85": at_85,
            "freed": pools[0.9].share - pools[0.85].share,
            "per_token": kv_cache_bytes("llama-3-8b", 1, 1, "bf16"),
            "requests": (at_90 - at_85) / 8192}
