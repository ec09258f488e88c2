"""Lab 07's exercises: attention, the KV cache, MLA and a paged cache."""
from __future__ import annotations

from labkit.core.config import preset
from labkit.course.exercises.core import GiB, register
from labkit.predict import kv_cache_bytes
from labkit.predict.layers import count_params
from labkit.predict.papers import model_state_bytes


@register(
    "07-naive-attention-gib",
    question="""Naive attention writes softmax(q k^T / sqrt(d)) out for every head, a (B, H, T, T)
matrix, and autograd keeps it for the backward pass. Under bf16-mixed (autocast) it keeps the
softmax's fp32 output and the bf16 copy the next matmul makes of it: 4 + 2 = 6 bytes per
(query, key) pair and head. How many GiB of probabilities does one layer of LLaMA-2-7B keep at
batch 1 x 4096 tokens?""",
    unit="GiB",
    hint="B x H x T x T pairs of 6 bytes, with H = lk.preset('llama-2-7b').heads; "
         "labkit.predict.layers.layer_saved(cfg, 'bf16-mixed', attention='naive') lists the term "
         "(.bytes(batch, seq)). 1 GiB = 2^30 bytes.",
    solution="""{heads} heads x 4096 x 4096 pairs x {per_pair:g} bytes = {bytes:,} bytes
= {answer:.2f} GiB per layer (labkit.predict.layers.layer_saved(..., attention="naive")); x {layers}
layers = {all:.0f} GiB, beside the {states:.1f} GiB of its model states (AdamW). SDPA's fused
kernel (and labkit's tiled core) keeps instead q, k, v, the output and one fp32 log-sum-exp per
row and head: {sdpa_core:.0f} MiB per layer, against naive's {naive_core:,.0f} MiB (its
probabilities, q, the repeated k and v, wo's input).
lk.estimate("llama-2-7b", 1, 4096, precision="bf16-mixed", attention=...): saved activations
{saved_naive:.1f} GiB naive, {saved_sdpa:.1f} GiB with SDPA; the step's peak {peak_naive:.1f} GiB
naive (in the {phase_naive} phase), {peak_sdpa:.1f} GiB with SDPA (in the {phase_sdpa} phase).""",
)
def _naive_attention_gib():
    from labkit.predict.layers import layer_saved
    from labkit.predict import estimate
    c, batch, seq = preset("llama-2-7b"), 1, 4096

    def core(attention):     # the attention core's terms: q/k/v/output, probabilities or lse
        return [t for t in layer_saved(c, "bf16-mixed", attention=attention)
                if t.name.startswith(("q, ", "attention "))]

    probs = next(t for t in core("naive") if t.per_pair)
    naive, sdpa = (estimate(c, batch, seq, precision="bf16-mixed", attention=a)
                   for a in ("naive", "sdpa"))
    per_layer = probs.bytes(batch, seq)
    return {"answer": per_layer / GiB, "heads": c.heads, "per_pair": probs.per_pair / c.heads,
            "bytes": per_layer, "layers": c.layers, "all": c.layers * per_layer / GiB,
            "states": model_state_bytes(count_params(c).total, "bf16-mixed", "adamw") / GiB,
            "sdpa_core": sum(t.bytes(batch, seq) for t in core("sdpa")) / 2**20,
            "naive_core": sum(t.bytes(batch, seq) for t in core("naive")) / 2**20,
            "saved_naive": naive.saved_activations / GiB,
            "saved_sdpa": sdpa.saved_activations / GiB,
            "peak_naive": naive.total / GiB, "phase_naive": naive.peak_phase,
            "peak_sdpa": sdpa.total / GiB, "phase_sdpa": sdpa.peak_phase}


@register(
    "07-kv-cache-70b",
    question="""LLaMA-2-70B caches a key and a value per layer, token and key/value head;
grouped-query attention (GQA) gives it 8 key/value heads for its 64 query heads. How many GiB
does its bf16 KV cache take for a batch of 8 sequences of 4096 tokens?""",
    unit="GiB",
    hint="Per token: 2 (K and V) x layers x kv_heads x head_dim numbers of 2 bytes; then x batch "
         "x tokens. Check with lk.kv_cache_bytes('llama-2-70b', batch=8, seq=4096).",
    solution="""per token: 2 x {layers} layers x {kv} kv heads x {d} dims x 2 bytes = {per:,} bytes;
x 8 x 4096 tokens = {bytes:,} bytes = {answer:.1f} GiB (lk.kv_cache_bytes). With multi-head
attention, one key/value head per query head (dataclasses.replace(cfg, kv_heads={heads})), the
same batch would cache {mha:.1f} GiB, {groups}x as much: GQA saves {saved:.1f} GiB
({saved_share:.1%}) of cache, beside the model's {weights:.1f} GiB of bf16 weights.""",
)
def _kv_cache_70b():
    from dataclasses import replace
    c, batch, seq = preset("llama-2-70b"), 8, 4096
    gqa = kv_cache_bytes(c, batch, seq, "bf16")
    mha = kv_cache_bytes(replace(c, kv_heads=c.heads), batch, seq, "bf16")
    return {"answer": gqa / GiB, "bytes": gqa, "per": gqa // (batch * seq),
            "layers": c.layers, "kv": c.kv_heads, "d": c.head_dim, "heads": c.heads,
            "mha": mha / GiB, "groups": c.heads // c.kv_heads, "saved": (mha - gqa) / GiB,
            "saved_share": 1 - gqa / mha, "weights": 2 * count_params(c).total / GiB}


@register(
    "07-mla-bytes-per-token",
    question="""DeepSeek-V2's multi-head latent attention (MLA) caches, per token and layer, one
compressed latent of kv_lora_rank numbers and one RoPE key of qk_rope_dim numbers shared by
all heads. How many bytes does one token's cache take, over all of its layers, in bf16?""",
    unit="bytes per token", rtol=0,
    hint="(kv_lora_rank + qk_rope_dim) x layers x 2 bytes, from lk.preset('deepseek-v2'); "
         "check with lk.kv_cache_bytes('deepseek-v2', seq=1).",
    solution="""({r} + {rope}) x {layers} layers x 2 bytes = {answer:,} bytes per token
(lk.kv_cache_bytes("deepseek-v2", seq=1)). Multi-head attention with the same {heads} heads of
d_h = {d} caches 2 x {heads} x {d} = {mha_per_layer:,} numbers per layer: {mha:,} bytes per token,
{ratio:.1f}x as much; MLA saves {saved:.1%}
(labkit.transformer.generate.mla_reduction("deepseek-v2")). In
the paper's units MLA caches {in_head_dims} d_h per layer, as much as GQA with {groups:g}
groups. One sequence of {seq} tokens: {mla_seq:.2f} GiB with MLA, {mha_seq:.1f} GiB with MHA.""",
)
def _mla_bytes_per_token():
    from labkit.transformer.generate import mla_reduction
    c, r = preset("deepseek-v2"), mla_reduction("deepseek-v2")
    per_token = kv_cache_bytes(c, seq=1, dtype="bf16")
    mha = per_token * r.mha_per_layer // r.mla_per_layer     # same layers, same format
    return {"answer": per_token, "r": r.latent, "rope": r.rope_key, "layers": r.layers,
            "heads": r.heads, "d": r.head_dim, "mha_per_layer": r.mha_per_layer, "mha": mha,
            "ratio": r.ratio, "saved": r.saved, "in_head_dims": str(r.in_head_dims),
            "groups": float(r.gqa_groups), "seq": c.max_seq,
            "mla_seq": c.max_seq * per_token / GiB, "mha_seq": c.max_seq * mha / GiB}


@register(
    "07-paged-waste",
    question="""A paged KV cache (PagedAttention, the vLLM paper) hands LLaMA-2-13B's fp16 cache
out in blocks of 16 tokens, so a request wastes at most the empty slots of its last block. How
many MiB can one request waste at most? (A server that reserves a contiguous slab of 2048
tokens per request wastes far more: the solution compares a request that stops at 300
tokens.) Give two decimals.""",
    unit="MiB", rtol=1e-3,
    hint="The worst last block holds one token and 15 empty slots; one token takes "
         "lk.kv_cache_bytes('llama-2-13b', seq=1, dtype='fp16') bytes over all layers. "
         "1 MiB = 2^20 bytes. labkit.transformer.paged.make_cache('paged', ...) measures it: "
         ".fragmentation_bytes.",
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
