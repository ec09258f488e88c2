"""Greedy generation with a KV cache for labkit's ``Transformer``: GQA (MHA, MQA) and MLA.

A decoder that generates token t needs every earlier token's keys and values in every layer.
Recomputing them each step costs a forward over the whole prefix; keeping them costs memory
that grows with the context: the KV cache (Pope et al., 2022, "Efficiently Scaling Transformer
Inference"). What each layer keeps per token:

- grouped-query attention (``KVCache``): keys (after RoPE) and values of its kv_heads,
  2 x kv_heads x head_dim numbers: MHA when kv_heads == heads, MQA when kv_heads == 1;
- multi-head latent attention (``LatentCache``): what DeepSeek-V2 keeps (section 2.1.2),
  the compressed latent c_KV (kv_lora_rank numbers, kept after ``kv_norm`` as DeepSeek's
  inference code does) and the one RoPE key shared by all heads (qk_rope_dim numbers).

MLA then attends in the absorbed form (DeepSeek-V2, section 2.1.3): W_UK is folded into the
query and W_UV applied after the softmax, so scores and values come from the cached latent
itself and no per-head key or value of the prefix is ever built. ``decompressed_attention``,
beside it, rebuilds them from the latent (the naive path) and gives the same output.

``share=2`` is cross-layer attention (CLA, Brandon et al., 2024): the first layer of each pair
writes its keys and values and the second reads them instead of its own: half the cache, and a
different model (CLA trains it that way from the start).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from labkit.core.config import ModelConfig, preset, presets
from labkit.core.units import TORCH_DTYPE_NAMES, check_positive, torch_dtype
from labkit.predict import kv_cache_bytes
from labkit.transformer.attention import naive_attention, soft_cap
from labkit.transformer.model import (LatentAttention, Transformer, build_model, embed_tokens,
                                     rotate, window_band)


# ---- caches --------------------------------------------------------------------------------
class Cache:
    """Per layer, tensors preallocated for ``capacity`` tokens along dimension ``time_dim``;
    ``length`` tokens are filled. Layers share one slot in groups of ``share``: the first layer
    of a group writes it, the others only read it (cross-layer attention)."""

    time_dim = 2

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, share: int = 1,
                 dtype: torch.dtype = torch.float32, device=None):
        check_positive("batch", batch)
        check_positive("capacity (tokens the cache holds)", capacity)
        check_positive("share (layers per cache slot; 1: no sharing)", share)
        self.capacity, self.share, self.length = capacity, share, 0
        self.device = device
        slots = -(-cfg.layers // share)
        self.slots = [{name: torch.zeros(shape, dtype=self.stored_dtype(name, dtype), device=device)
                       for name, shape in self.shapes(cfg, batch, capacity).items()}
                      for _ in range(slots)]

    def shapes(self, cfg: ModelConfig, batch: int, capacity: int) -> dict:
        raise NotImplementedError

    def stored_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype entry ``name`` is stored in: the cache's own (a quantised cache differs)."""
        return dtype

    def writes(self, layer: int) -> bool:
        """Whether ``layer`` computes and stores its own entries (the first of its group)."""
        return layer % self.share == 0

    def write(self, layer: int, **new):
        """Store the new tokens' entries at positions length .. length + T."""
        slot = self.slots[layer // self.share]
        for name, t in new.items():
            slot[name].narrow(self.time_dim, self.length, t.shape[self.time_dim]).copy_(t)

    def read(self, layer: int, end: int) -> list:
        """Views of the first ``end`` tokens of the layer's slot, in ``shapes`` order."""
        return [t.narrow(self.time_dim, 0, end) for t in self.slots[layer // self.share].values()]

    def make_room(self, tokens: int) -> None:
        if self.length + tokens > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} tokens and has {self.length}; "
                             f"adding {tokens} needs capacity >= {self.length + tokens}: "
                             f"make the cache with a larger capacity")

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's storages (all ``capacity`` tokens, filled or not)."""
        return sum(t.untyped_storage().nbytes() for slot in self.slots for t in slot.values())

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // self.capacity


class KVCache(Cache):
    """GQA, MHA and MQA: keys after RoPE and values, each (B, kv_heads, capacity, head_dim)."""

    def shapes(self, cfg, batch, capacity):
        shape = (batch, cfg.kv_heads, capacity, cfg.head_dim)
        return {"k": shape, "v": shape}


class LatentCache(Cache):
    """MLA: the normalised latent c_KV (B, capacity, kv_lora_rank) and the shared RoPE key
    k_rope (B, capacity, qk_rope_dim); nothing per head."""

    time_dim = 1

    def shapes(self, cfg, batch, capacity):
        return {"latent": (batch, capacity, cfg.kv_lora_rank),
                "k_rope": (batch, capacity, cfg.qk_rope_dim)}


def new_cache(model: Transformer, batch: int, capacity: int, share: int = 1,
              dtype: torch.dtype | None = None) -> Cache:
    """An empty cache of the kind the model's attention needs, in the weights' dtype."""
    kind = LatentCache if model.cfg.attention == "mla" else KVCache
    weight = model.embed.weight
    return kind(model.cfg, batch, capacity, share, dtype or weight.dtype, weight.device)


# ---- one attention layer over the cache ----------------------------------------------------
def causal_mask(T: int, start: int, device=None):
    """(T, start + T) bool, True where query i (at position start + i) may see key j; None
    for one query, which sees every cached key."""
    if T == 1:
        return None
    return torch.ones(T, start + T, dtype=torch.bool, device=device).tril(diagonal=start)


def gqa_attention(attn, x, rotary, mask, cache: KVCache, layer: int):
    """``GroupedQueryAttention`` on new tokens x (B, T, hidden), attending to the whole cache
    (a sliding-window layer: to its last ``attn.window`` positions; the cache keeps them all)."""
    B, T, _ = x.shape
    H, Hkv, d = attn.heads, attn.kv_heads, attn.head_dim
    start = cache.length
    if attn.window and start + T > attn.window:
        mask = window_band(T, start, attn.window, x.device)
    # q and k normalised as the model does (Qwen3, Gemma 3, OLMo 2)
    q = rotate(attn.heads_of(x, attn.wq, H, attn.q_norm), *rotary)                 # (B, H, T, d)
    if cache.writes(layer):
        k = rotate(attn.heads_of(x, attn.wk, Hkv, attn.k_norm), *rotary)          # (B, Hkv, T, d)
        v = attn.heads_of(x, attn.wv, Hkv)                                        # (B, Hkv, T, d)
        cache.write(layer, k=k, v=v)
    k, v = cache.read(layer, start + T)                                           # (B, Hkv, L, d)
    if attn.softcap:           # SDPA cannot soft-cap: the scores written out (Gemma 2)
        y = naive_attention(q, k, v, causal=False, softcap=attn.softcap, mask=mask)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=Hkv != H)
    return attn.wo(y.transpose(1, 2).reshape(B, T, H * d))                        # (B, T, hidden)


def mla_attention(attn: LatentAttention, x, rotary, mask, cache: LatentCache, layer: int,
                  absorb: bool = True):
    """``LatentAttention`` on new tokens x (B, T, hidden): caches their latent and RoPE key,
    then attends absorbed (default) or through per-head keys and values rebuilt from the cache."""
    c, (B, T, _) = attn.cfg, x.shape
    H, nope, rdim, vdim = c.heads, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim
    start = cache.length
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))) if c.q_lora_rank else attn.wq(x)
    q_nope, q_rope = q.view(B, T, H, nope + rdim).transpose(1, 2).split([nope, rdim], dim=-1)
    q_rope = rotate(q_rope, *rotary)                                               # (B, H, T, rdim)
    if cache.writes(layer):
        latent, k_rope = attn.wkv_a(x).split([c.kv_lora_rank, rdim], dim=-1)    # (B, T, r|rdim)
        cache.write(layer, latent=attn.kv_norm(latent), k_rope=rotate(k_rope, *rotary))
    latent, k_rope = cache.read(layer, start + T)                                 # (B, L, r|rdim)
    core = absorbed_attention if absorb else decompressed_attention
    y = core(attn, q_nope, q_rope, latent, k_rope, mask)                          # (B, H, T, v)
    return attn.wo(y.transpose(1, 2).reshape(B, T, H * vdim))                     # (B, T, hidden)


def _up_projections(attn: LatentAttention):
    """wkv_b split per head into W_UK (H, nope, r) and W_UV (H, v, r)."""
    c = attn.cfg
    w = attn.wkv_b.weight.view(c.heads, c.qk_nope_dim + c.v_head_dim, c.kv_lora_rank)
    return w.split([c.qk_nope_dim, c.v_head_dim], dim=1)


def absorbed_attention(attn: LatentAttention, q_nope, q_rope, latent, k_rope, mask):
    """DeepSeek-V2's inference form: q_nope . (W_UK c) = (q_nope W_UK) . c, so each head's query
    is moved into the latent space once; the values (P c) W_UV are taken the same way round.

    q_nope (B, H, T, nope), q_rope (B, H, T, rdim), latent (B, L, r), k_rope (B, L, rdim)
    -> (B, H, T, v). The largest tensors are the (B, H, T, L) scores: nothing per head per token.
    """
    w_uk, w_uv = _up_projections(attn)                                           # (H, nope|v, r)
    q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)                       # (B, H, T, r)
    scores = (torch.einsum("bhtr,blr->bhtl", q_latent, latent)                    # (B, H, T, L)
              + torch.einsum("bhtd,bld->bhtl", q_rope, k_rope))
    scores = scores / attn.cfg.qk_head_dim ** 0.5          # the scale of the uncompressed heads
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = scores.softmax(dim=-1, dtype=torch.float32).to(latent.dtype)
    out_latent = torch.einsum("bhtl,blr->bhtr", p, latent)                        # (B, H, T, r)
    return torch.einsum("bhtr,hvr->bhtv", out_latent, w_uv)                       # (B, H, T, v)


def decompressed_attention(attn: LatentAttention, q_nope, q_rope, latent, k_rope, mask):
    """The naive path, as ``LatentAttention.forward``: every cached token's per-head key and
    value rebuilt from its latent, (B, H, L, nope + rdim) and (B, H, L, v), then SDPA."""
    c, (B, L, _) = attn.cfg, latent.shape
    H, nope, rdim = c.heads, c.qk_nope_dim, c.qk_rope_dim
    kv = attn.wkv_b(latent).view(B, L, H, nope + c.v_head_dim).transpose(1, 2)
    k_nope, v = kv.split([nope, c.v_head_dim], dim=-1)                          # (B, H, L, nope|v)
    k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(B, H, L, rdim)], dim=-1)    # (B, H, L, qk)
    q = torch.cat([q_nope, q_rope], dim=-1)                                       # (B, H, T, qk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)                # (B, H, T, v)


# ---- the model, one step at a time ---------------------------------------------------------
def step(model: Transformer, tokens, cache: Cache, absorb: bool = True):
    """Run tokens (B, T) at positions cache.length .. + T through the model, adding them to the
    cache: the prefill (the prompt) and each decoding step (T = 1). -> logits (B, T, vocab)."""
    B, T = tokens.shape
    start = cache.length
    cache.make_room(T)
    if start + T > model.cfg.max_seq:
        raise ValueError(f"position {start + T} is past max_seq={model.cfg.max_seq} (the RoPE "
                         f"tables' length); build the model with a larger max_seq")
    rotary = (model.rope.cos[start:start + T], model.rope.sin[start:start + T])   # (T, rope_dim)
    mask = causal_mask(T, start, tokens.device)
    x = embed_tokens(model.embed, tokens, model.cfg)                              # (B, T, hidden)
    for layer, block in enumerate(model.blocks):
        h = block.attn_norm(x)
        if isinstance(block.attn, LatentAttention):
            h = mla_attention(block.attn, h, rotary, mask, cache, layer, absorb)
        else:
            h = gqa_attention(block.attn, h, rotary, mask, cache, layer)
        x = x + block.attn_post_norm(h)                          # Identity unless post norms
        x = x + block.mlp_post_norm(block.mlp(block.mlp_norm(x)))
    cache.length += T
    return soft_cap(model.lm_head(model.norm(x)), model.cfg.logit_softcap)        # (B, T, vocab)


@dataclass
class Generation:
    """Prompt and new tokens (B, P + N), the logits that chose each new token (B, N, vocab),
    and the cache at the end (None without one)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    cache: Cache | None

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes if self.cache is not None else 0


def _check_request(model: Transformer, prompt, new_tokens: int) -> None:
    if not (isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and prompt.shape[1] > 0
            and not prompt.is_floating_point()):
        raise ValueError("prompt must be token ids of shape (batch, tokens), at least one token; "
                         "for one sequence pass prompt[None]")
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens <= 0:
        raise ValueError(f"new_tokens must be a positive integer, got {new_tokens!r}; ask for "
                         f"at least one token")
    P, max_seq = prompt.shape[1], model.cfg.max_seq
    if P + new_tokens > max_seq:
        raise ValueError(f"prompt ({P} tokens) + new_tokens ({new_tokens}) = {P + new_tokens} "
                         f"exceeds max_seq={max_seq}, the positions RoPE covers: shorten the "
                         f"prompt, ask for fewer tokens, or build the model with "
                         f"max_seq >= {P + new_tokens}")


def generate(model: Transformer, prompt, new_tokens: int, cache: bool = True,
             absorb: bool = True, share: int = 1) -> Generation:
    """Greedy decoding of ``new_tokens`` after ``prompt`` (B, P).

    cache=True: one prefill of the prompt, then one token per step against the cache.
    cache=False: each step runs the whole prefix again (the model's own forward; with
    share > 1 a fresh shared cache, as the cross-layer model has no other forward).
    ``absorb``: MLA's absorbed attention (else decompressed). ``share``: layers per cache slot.
    """
    _check_request(model, prompt, new_tokens)
    check_positive("share (layers per cache slot; 1: no sharing)", share)
    B, P = prompt.shape
    # the last new token is never fed back: the cache ends holding P + N - 1 tokens
    kv = new_cache(model, B, P + new_tokens - 1, share) if cache else None
    tokens, chosen_by, fed = prompt, [], prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            if kv is not None:
                last = step(model, fed, kv, absorb)[:, -1]                        # (B, vocab)
            elif share == 1:
                last = model(tokens)[:, -1]
            else:
                fresh = new_cache(model, B, tokens.shape[1], share)
                last = step(model, tokens, fresh, absorb)[:, -1]
            fed = last.argmax(dim=-1, keepdim=True)                               # (B, 1)
            tokens = torch.cat([tokens, fed], dim=1)
            chosen_by.append(last)
    return Generation(tokens, torch.stack(chosen_by, dim=1), kv)


# ---- measured cache bytes ------------------------------------------------------------------
def attention_kind(cfg: ModelConfig) -> str:
    """MHA, GQA or MQA by how many query heads share a key/value head; or MLA."""
    if cfg.attention == "mla":
        return "MLA"
    return "MHA" if cfg.kv_heads == cfg.heads else "MQA" if cfg.kv_heads == 1 else "GQA"


@dataclass(frozen=True)
class CacheBytes:
    """Bytes per token (all layers, batch 1): measured from a cache after a prefill, and
    ``kv_cache_bytes``'s prediction."""

    name: str
    kind: str
    dtype: str
    measured: int
    predicted: int


def cache_bytes_per_token(model_or_cfg: Transformer | ModelConfig | str, tokens: int = 8,
                          dtype: torch.dtype | None = None) -> CacheBytes:
    """Prefill ``tokens`` tokens into a cache holding exactly that many, and read its storage
    bytes / tokens. A model runs as it is (its dtype); a config or preset name is built on fake
    tensors at full size (bf16 unless ``dtype``): real shapes and storages, no memory."""
    check_positive("tokens", tokens)
    fake = not isinstance(model_or_cfg, Transformer)
    if fake:
        cfg = preset(model_or_cfg) if isinstance(model_or_cfg, str) else model_or_cfg
        dtype = dtype or torch.bfloat16
    else:
        cfg = model_or_cfg.cfg
        dtype = dtype or model_or_cfg.embed.weight.dtype
    if tokens > cfg.max_seq:
        raise ValueError(f"tokens={tokens} exceeds max_seq={cfg.max_seq}; prefill fewer tokens")
    with FakeTensorMode() if fake else contextlib.nullcontext(), torch.no_grad():
        model = build_model(cfg, dtype) if fake else model_or_cfg
        cache = new_cache(model, 1, tokens, dtype=dtype)
        step(model, torch.zeros(1, tokens, dtype=torch.long, device=cache.device), cache)
        measured = cache.nbytes // tokens
    name = {torch_dtype(n): n for n in TORCH_DTYPE_NAMES}.get(dtype)
    if name is None:
        raise ValueError(f"no format name for {dtype}; cache in one of {', '.join(TORCH_DTYPE_NAMES)}")
    predicted = kv_cache_bytes(cfg, 1, tokens, name, windows=False) // tokens  # labkit's keeps all
    return CacheBytes(cfg.name, attention_kind(cfg), name, measured, predicted)


@dataclass(frozen=True)
class Sharing:
    """Cross-layer KV sharing (CLA) measured on one model: cache bytes with one slot per layer
    and with one per ``share`` layers, and how far the shared model's outputs move."""

    share: int
    layers: int
    slots: int
    unshared_bytes: int
    shared_bytes: int
    tokens_changed: int          # generated tokens that differ from the unshared model's
    max_logit_change: float      # over the logits of the first new token (same prefix)

    @property
    def saved(self) -> float:
        return 1 - self.shared_bytes / self.unshared_bytes


def cross_layer_sharing(model: Transformer, prompt, new_tokens: int, share: int = 2) -> Sharing:
    """Generate with and without cross-layer sharing (Brandon et al., 2024): adjacent groups of
    ``share`` layers use the first layer's keys and values (MLA: its latent and RoPE key).

    What it measures is memory: the cache shrinks to ceil(layers / share) slots. The outputs
    change, because the model is another one: CLA trains it with sharing from the start, while
    here the reading layers simply lose their own key and value projections.
    """
    check_positive("share (layers per cache slot)", share)
    alone = generate(model, prompt, new_tokens)
    shared = generate(model, prompt, new_tokens, share=share)
    P = prompt.shape[1]
    changed = int((alone.tokens[:, P:] != shared.tokens[:, P:]).sum())
    first = (alone.logits[:, 0] - shared.logits[:, 0]).abs().max().item()
    return Sharing(share, model.cfg.layers, len(shared.cache.slots), alone.cache_bytes,
                   shared.cache_bytes, changed, first)


CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)


def cache_bytes_by_context(names=None, contexts=CONTEXTS, batch: int = 1,
                           dtype: str = "bf16") -> dict:
    """{preset: {context: KV cache bytes}} from ``kv_cache_bytes`` (every preset by default),
    whether or not the model was trained for that context (its max_seq)."""
    return {name: {seq: kv_cache_bytes(name, batch, seq, dtype) for seq in contexts}
            for name in (names or presets())}


# ---- DeepSeek-V2's reduction ---------------------------------------------------------------
@dataclass(frozen=True)
class MLAReduction:
    """Elements cached per token per layer: MLA's d_c + d_h^R against MHA's 2 n_h d_h with the
    same heads n_h and head width d_h (DeepSeek-V2, Table 1), and what that assumes."""

    name: str
    heads: int                  # n_h
    head_dim: int               # d_h
    latent: int                 # d_c (kv_lora_rank)
    rope_key: int               # d_h^R (qk_rope_dim)
    layers: int
    mla_per_layer: int          # d_c + d_h^R
    mha_per_layer: int          # 2 n_h d_h
    assumptions: tuple

    @property
    def in_head_dims(self) -> Fraction:
        """MLA's cache in units of d_h: 9/2 in DeepSeek-V2's setting."""
        return Fraction(self.mla_per_layer, self.head_dim)

    @property
    def gqa_groups(self) -> Fraction:
        """The GQA group count with the same cache: 2.25 in the paper's words."""
        return Fraction(self.mla_per_layer, 2 * self.head_dim)

    @property
    def ratio(self) -> float:
        """MHA's cache / MLA's."""
        return self.mha_per_layer / self.mla_per_layer

    @property
    def saved(self) -> float:
        return 1 - self.mla_per_layer / self.mha_per_layer


def mla_reduction(cfg: ModelConfig | str = "deepseek-v2") -> MLAReduction:
    """DeepSeek-V2's comparison for an MLA config (Table 1 of the paper)."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    if c.attention != "mla":
        raise ValueError(f"{c.name} uses {attention_kind(c)} attention; mla_reduction compares "
                         f"an MLA config (e.g. 'deepseek-v2') with its MHA baseline")
    d_h = c.qk_nope_dim
    assumptions = (
        f"the MHA baseline has the same n_h = {c.heads} heads and caches a key and a value of "
        f"d_h = qk_nope_dim = {d_h} per head ({c.qk_nope_dim} + {c.v_head_dim} numbers)",
        f"MLA caches the latent d_c = {c.kv_lora_rank} = {Fraction(c.kv_lora_rank, d_h)} d_h "
        f"and one RoPE key d_h^R = {c.qk_rope_dim} = {Fraction(c.qk_rope_dim, d_h)} d_h, "
        f"shared by all heads",
        "both in the same number format, per token and per layer; the MHA baseline's RoPE "
        "covers the whole head (no decoupled key)",
    )
    return MLAReduction(c.name, c.heads, d_h, c.kv_lora_rank, c.qk_rope_dim, c.layers,
                        c.kv_lora_rank + c.qk_rope_dim, c.heads * (c.qk_nope_dim + c.v_head_dim),
                        assumptions)


# DeepSeek LLM 67B (DeepSeek-AI, 2024; its public config.json): the dense model DeepSeek-V2's
# "reduces the KV cache by 93.3%" is measured against
DEEPSEEK_LLM_67B = ModelConfig(name="deepseek-llm-67b", hidden=8192, layers=95, heads=64,
                               kv_heads=8, ffn=22016, vocab_size=102400,
                               published="67B", family="DeepSeek LLM (DeepSeek-AI, 2024)")


@dataclass(frozen=True)
class Headline:
    """DeepSeek-V2's KV cache per token against DeepSeek 67B's, with and without the 6-bit
    KV cache quantisation of V2's deployment (section 3.2.3 of the paper)."""

    v2_bytes_bf16: int
    v2_bytes_quantised: float
    baseline_bytes: int
    assumptions: tuple

    @property
    def saved(self) -> float:
        """The paper's 93.3%: V2 at kv_bits per element against 67B in bf16."""
        return 1 - self.v2_bytes_quantised / self.baseline_bytes

    @property
    def saved_bf16(self) -> float:
        """The same comparison with both caches in bf16."""
        return 1 - self.v2_bytes_bf16 / self.baseline_bytes


def deepseek_v2_headline(kv_bits: float = 6) -> Headline:
    """Reconstruct "compared with DeepSeek 67B, DeepSeek-V2 ... reduces the KV cache by 93.3%"."""
    v2 = preset("deepseek-v2")
    elements = (v2.kv_lora_rank + v2.qk_rope_dim) * v2.layers                  # per token
    assumptions = (
        "per token, all layers, batch 1: DeepSeek-V2 caches (512 + 64) x 60 layers = "
        f"{elements} elements, DeepSeek 67B 2 x 8 KV heads x 128 x 95 layers (GQA)",
        "67B's cache in bf16 (2 bytes), V2's at 6 bits per element on average, as the paper's "
        "deployment quantises it",
    )
    return Headline(kv_cache_bytes(v2, 1, 1, "bf16"), elements * kv_bits / 8,
                    kv_cache_bytes(DEEPSEEK_LLM_67B, 1, 1, "bf16"), assumptions)
