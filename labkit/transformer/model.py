"""One readable decoder-only transformer built from any ``ModelConfig``.

LLaMA-style blocks (RMSNorm, RoPE, SwiGLU, grouped-query attention through SDPA) and
DeepSeek's two changes: multi-head latent attention (MLA, DeepSeek-V2 paper, section 2.1)
and mixture-of-experts MLPs with shared and routed experts (DeepSeekMoE paper).
Builds on fake tensors at full scale (671B DeepSeek-V3 included) for memory measurement.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from labkit.core.config import ModelConfig
from labkit.core.units import check_choice
from labkit.transformer.attention import (ATTENTION_IMPLS, naive_attention, soft_cap,
                                         tiled_attention)
from labkit.transformer.grouped_mm import grouped_linear, grouped_mm  # noqa: F401 - re-exported
from labkit.transformer.loss import chunked_cross_entropy
from labkit.transformer.packing import (Varlen, VarlenAttention, cu_seqlens,  # noqa: F401
                                        document_mask)                     # re-exported


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich, 2019), as LLaMA's and DeepSeek's reference code
    writes it: normalise in fp32, cast back to x's dtype, then scale by the weight. In bf16
    it keeps the normalised x in bf16 (F.rms_norm would keep it in fp32). ``style="gemma"``:
    Gemma's, which scales by (1 + weight) in fp32, then casts; ``"olmo"``: OLMo 2's, which
    scales by the weight in fp32, then casts. Both keep the normalised x in fp32."""

    def __init__(self, dim: int, eps: float, style: str = "llama"):
        super().__init__()
        self.eps, self.style = eps, style
        self.weight = nn.Parameter(torch.zeros(dim) if style == "gemma" else torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if self.style == "olmo":
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding tables (Su et al., 2021), shared by every layer."""

    def __init__(self, dim: int, max_seq: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)  # (S, dim/2)
        angles = torch.cat([angles, angles], dim=-1)                                # (S, dim)
        # non-persistent: rebuilt from the config, never saved in a checkpoint
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        """Rotate x of shape (B, heads, T, dim) by its position along T."""
        T = x.shape[-2]
        return rotate(x, self.cos[:T], self.sin[:T])                               # tables (T, dim)


class PackedRotary(nn.Module):
    """The rotary tables gathered once at ``position_ids`` (B, T): positions restart in each
    document of a packed row."""

    def __init__(self, rope: Rotary, position_ids):
        super().__init__()
        self.cos = rope.cos[position_ids].unsqueeze(1)                             # (B, 1, T, dim)
        self.sin = rope.sin[position_ids].unsqueeze(1)

    def forward(self, x):
        return rotate(x, self.cos, self.sin)


def rotate(x, cos, sin):
    """x * cos + rotate_half(x) * sin, in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


# the attention core every attention layer runs: "sdpa", "naive" or "tiled"
# (labkit.transformer.attention)
_attention = "sdpa"


@contextlib.contextmanager
def use_attention(impl):
    """Run labkit models' attention core as ``impl`` inside the block: "sdpa" (the default),
    "naive" (the (T, T) matrix kept), "tiled" (labkit's online softmax), or a function
    (q, k, v) -> causal attention (``labkit.parallel.context``'s ring). Put the backward
    pass inside it too: blocks that recompute run their forward again there."""
    global _attention
    if not callable(impl):
        check_choice("attention", impl, ATTENTION_IMPLS)
    previous, _attention = _attention, impl
    try:
        yield
    finally:
        _attention = previous


def window_band(T: int, start: int, window: int, device=None) -> torch.Tensor:
    """(T, start + T) bool, True where query i (at position start + i) sees key j: one of its
    last ``window`` positions, itself included (a sliding-window layer)."""
    pos = torch.arange(start, start + T, device=device)[:, None]                # (T, 1)
    j = torch.arange(start + T, device=device)[None, :]                          # (1, start+T)
    return (j <= pos) & (j > pos - window)


def window_mask(batch: int, T: int, window: int, device) -> torch.Tensor:
    """(B, 1, T, T) bool: ``window_band`` of T tokens, one (T, T) matrix expanded over the batch."""
    return window_band(T, 0, window, device).expand(batch, 1, T, T)


def windowed_sdpa(q, k, v, window: int):
    """A sliding-window layer through SDPA as transformers runs it (its default attention):
    SDPA copies the bool mask to a float (B, 1, T, T) one and keeps it for backward, and k and
    v are expanded to every head (transformers turns SDPA's grouped heads off with a mask):
    copies, but for one kv head (a view)."""
    (B, Hkv, T, d), groups = k.shape, q.shape[1] // k.shape[1]
    k, v = (x[:, :, None].expand(B, Hkv, groups, T, d).reshape(B, Hkv * groups, T, d)
            for x in (k, v))                                                    # (B, H, T, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(B, T, window, q.device))


def attention_core(q, k, v, mask=None, softcap: float = 0.0, window: int = 0):
    """Causal softmax(q k^T / sqrt(d)) v through SDPA's fused kernel (no (T, T) matrix is kept),
    or the implementation ``use_attention`` chose.

    q: (B, H, T, d); k, v: (B, Hkv, T, d) with Hkv dividing H (grouped-query attention).
    ``mask``: for packed rows, a dense ``document_mask`` or ``Varlen`` offsets (no mask).
    ``softcap`` > 0 (Gemma 2) soft-caps the scores, which SDPA cannot: "sdpa" then runs the tiled
    core, which keeps what a fused kernel that soft-caps keeps (FlashAttention-2's ``softcap``,
    FlexAttention); "naive" keeps the tanh's (T, T) output too, as transformers' eager attention.
    ``window`` > 0: a sliding-window layer, each query sees its last ``window`` keys. From
    T = window on (where transformers starts masking) SDPA runs ``windowed_sdpa``; the naive
    core adds the band to its causal mask; the tiled core skips the tiles beyond it.
    """
    T = q.shape[2]
    if window and T >= window:
        if mask is not None or callable(_attention):
            raise ValueError(f"sliding-window layers (window {window}) at {T} tokens attend "
                             "through a band mask: no packed rows (doc_ids) and no ring; "
                             f"use a sequence shorter than {window} tokens")
        if _attention == "naive":
            return naive_attention(q, k, v, softcap=softcap, window=window)
        if _attention == "sdpa" and not softcap:
            return windowed_sdpa(q, k, v, window)
        return tiled_attention(q, k, v, softcap=softcap, window=window)
    if mask is not None and _attention != "sdpa":
        raise ValueError(f"attention {_attention!r} runs plain causal rows; packed rows (doc_ids) "
                         f"attend through 'sdpa': leave the attention at 'sdpa' for them")
    if softcap and (mask is not None or callable(_attention)):
        raise ValueError(f"soft-capped attention (attn_softcap={softcap}) runs labkit's naive or "
                         f"tiled core on plain causal rows: no packed rows (doc_ids) and no ring")
    if isinstance(mask, Varlen):
        return VarlenAttention.apply(q, k, v, mask)
    if callable(_attention):
        return _attention(q, k, v)
    if _attention == "naive":
        return naive_attention(q, k, v, softcap=softcap)
    if _attention == "tiled" or softcap:
        return tiled_attention(q, k, v, softcap=softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=k.shape[1] != q.shape[1])


class GroupedQueryAttention(nn.Module):
    """Multi-head (kv_heads == heads), grouped-query or multi-query (kv_heads == 1) attention."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.softcap, self.window = cfg.attn_softcap, cfg.window_of(layer)
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        # q and k normalised before RoPE: each head (Qwen3, Gemma 3) or all heads at once (OLMo 2)
        self.whole = cfg.qk_norm_width == "all"

        def norm(heads):
            width = heads * cfg.head_dim if self.whole else cfg.head_dim
            return RMSNorm(width, cfg.norm_eps, cfg.norm_style) if cfg.qk_norm else nn.Identity()
        self.q_norm, self.k_norm = norm(cfg.heads), norm(cfg.kv_heads)

    def heads_of(self, x, linear, heads: int, norm=None):
        """(B, T, hidden) -> a projection's heads (B, heads, T, d), normalised as the model does
        before RoPE (``norm``: None for v)."""
        B, T, _ = x.shape
        y = linear(x)                                                            # (B, T, heads*d)
        if norm is not None and self.whole:
            y = norm(y)
        y = y.view(B, T, heads, self.head_dim)                                   # (B, T, heads, d)
        if norm is not None and not self.whole:
            y = norm(y)
        return y.transpose(1, 2)

    def forward(self, x, rope: Rotary, mask=None):
        B, T, _ = x.shape
        q = self.heads_of(x, self.wq, self.heads, self.q_norm)                    # (B, H, T, d)
        k = self.heads_of(x, self.wk, self.kv_heads, self.k_norm)                 # (B, Hkv, T, d)
        v = self.heads_of(x, self.wv, self.kv_heads)                              # (B, Hkv, T, d)
        y = attention_core(rope(q), rope(k), v, mask, self.softcap, self.window)  # (B, H, T, d)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))                       # (B, T, hidden)


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention: keys and values come from one small latent.

    Per token the KV cache holds only the latent (kv_lora_rank) and one shared RoPE key
    (qk_rope_dim), instead of 2 x heads x head_dim numbers.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, qk = cfg.heads, cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.hidden, H * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(H * cfg.v_head_dim, cfg.hidden, bias=False)

    def forward(self, x, rope: Rotary, mask=None):
        c, (B, T, _) = self.cfg, x.shape
        H, nope, rdim, vdim = c.heads, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim
        q = self.wq_b(self.q_norm(self.wq_a(x))) if c.q_lora_rank else self.wq(x)
        q = q.view(B, T, H, nope + rdim).transpose(1, 2)                        # (B, H, T, qk)
        q_nope, q_rope = q.split([nope, rdim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([c.kv_lora_rank, rdim], dim=-1)    # (B, T, r), (B, T, rdim)
        kv = self.wkv_b(self.kv_norm(latent)).view(B, T, H, nope + vdim).transpose(1, 2)
        k_nope, v = kv.split([nope, vdim], dim=-1)                                # (B, H, T, nope|v)
        k_rope = rope(k_rope.unsqueeze(1)).expand(B, H, T, rdim)                 # one key head, shared
        q = torch.cat([q_nope, rope(q_rope)], dim=-1)                             # (B, H, T, qk)
        k = torch.cat([k_nope, k_rope], dim=-1)                                   # (B, H, T, qk)
        # the fused kernels want one head width: pad v to qk and drop the padding after
        v = F.pad(v, (0, nope + rdim - vdim))                                     # (B, H, T, qk)
        y = attention_core(q, k, v, mask)[..., :vdim]                             # (B, H, T, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * vdim))                 # (B, T, hidden)


def gelu_tanh(x):
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


GATES = {"silu": F.silu, "gelu_tanh": gelu_tanh}      # ModelConfig.activation -> function


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer, 2020): the dense MLP and the shared experts.
    ``activation="gelu_tanh"`` makes it GeGLU (Gemma); each keeps the same tensors."""

    def __init__(self, hidden: int, ffn: int, activation: str = "silu"):
        super().__init__()
        self.w_gate = nn.Linear(hidden, ffn, bias=False)
        self.w_up = nn.Linear(hidden, ffn, bias=False)
        self.w_down = nn.Linear(ffn, hidden, bias=False)
        self.act = GATES[activation]

    def forward(self, x):
        return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))


class RoutedExperts(nn.Module):
    """E SwiGLU experts stacked into three (E, out, in) weights, run as grouped matmuls on tokens
    sorted by expert (as production MoE kernels hold them); slice e is expert e's weight."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        E, h, f = experts, hidden, ffn
        self.w_gate = nn.Parameter(torch.empty(E, f, h).normal_(std=0.02))     # (E, f, h)
        self.w_up = nn.Parameter(torch.empty(E, f, h).normal_(std=0.02))       # (E, f, h)
        self.w_down = nn.Parameter(torch.empty(E, h, f).normal_(std=0.02))     # (E, h, f)

    def forward(self, x, counts: list[int]):
        """x (N, hidden): the first counts[0] rows go to expert 0, the next counts[1] to 1, ..."""
        gate = grouped_linear(x, self.w_gate, counts)                            # (N, f)
        up = grouped_linear(x, self.w_up, counts)                                # (N, f)
        return grouped_linear(F.silu(gate) * up, self.w_down, counts)           # (N, h)

    def expert(self, e: int, x):
        """Expert e alone on x (..., hidden): a SwiGLU on views of its weights."""
        return F.linear(F.silu(F.linear(x, self.w_gate[e])) * F.linear(x, self.w_up[e]),
                        self.w_down[e])


class MoE(nn.Module):
    """Shared experts for every token plus top_k of routed_experts chosen by a router.

    Tokens are sorted by expert so that each expert's tokens are contiguous rows, which
    ``RoutedExperts`` runs as one grouped matmul per weight. On fake tensors the routing is
    unknown, so tokens are assumed spread evenly over the experts (what a load-balancing loss
    aims at).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, h, f = cfg.routed_experts, cfg.hidden, cfg.moe_ffn
        self.routed_experts, self.top_k = E, cfg.top_k
        self.router = nn.Linear(h, E, bias=False)
        # DeepSeek-V3's balancing rule moves the bias by the experts' load, not by a gradient
        # (top-k has none): frozen, as Hugging Face's buffer e_score_correction_bias
        self.router_bias = (nn.Parameter(torch.zeros(E), requires_grad=False)
                            if cfg.router_bias else None)
        self.experts = RoutedExperts(E, h, f)
        self.shared = SwiGLU(h, cfg.shared_experts * f) if cfg.shared_experts else None

    def route(self, x):
        """(N, hidden) -> expert weights (N, k) and expert ids (N, k)."""
        scores = F.softmax(self.router(x), dim=-1, dtype=torch.float32)         # (N, E)
        choice = scores if self.router_bias is None else scores + self.router_bias
        expert_ids = choice.topk(self.top_k, dim=-1).indices                      # (N, k)
        return scores.gather(-1, expert_ids), expert_ids

    def tokens_per_expert(self, expert_ids) -> list[int]:
        E = self.routed_experts
        if isinstance(expert_ids, FakeTensor):      # no data: balanced routing
            n = expert_ids.numel()
            return [n // E + (e < n % E) for e in range(E)]
        return torch.bincount(expert_ids.flatten(), minlength=E).tolist()

    def forward(self, x):
        B, T, h = x.shape
        x = x.reshape(B * T, h)                                                   # (N, h)
        weights, expert_ids = self.route(x)                                       # (N, k)
        order = expert_ids.flatten().argsort()                                    # (N*k,)
        token = order // self.top_k                                               # token of each slot
        x_sorted = x[token]                                                       # (N*k, h)
        out = self.experts(x_sorted, self.tokens_per_expert(expert_ids))          # (N*k, h)
        y_sorted = out * weights.flatten()[order, None].to(x.dtype)               # (N*k, h)
        y = torch.zeros_like(x).index_add(0, token, y_sorted.to(x.dtype))        # (N, h)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(B, T, h)


def embed_tokens(embed: nn.Module, tokens, cfg: ModelConfig):
    """(B, T) -> (B, T, hidden); Gemma scales the embedding by sqrt(hidden), in its dtype."""
    x = embed(tokens)
    return x * torch.tensor(cfg.hidden ** 0.5, dtype=x.dtype) if cfg.embed_scale else x


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). With
    ``norms="sandwich"`` (Gemma 2/3) each sub-layer's output is normalised before it is added,
    x + post_norm(attn(norm(x))); with ``norms="post"`` (OLMo 2) only the output,
    x + post_norm(attn(x)). A norm a placement lacks is ``nn.Identity``."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden, cfg.norm_eps, cfg.norm_style)       # noqa: E731
        pre_norm = norm if cfg.pre_norms else nn.Identity
        post_norm = norm if cfg.post_norms else nn.Identity
        self.attn_norm = pre_norm()
        self.attn = (LatentAttention(cfg) if cfg.attention == "mla" else
                     GroupedQueryAttention(cfg, layer))
        self.attn_post_norm = post_norm()
        self.mlp_norm = pre_norm()
        self.mlp = (MoE(cfg) if layer >= cfg.dense_layers else
                    SwiGLU(cfg.hidden, cfg.ffn, cfg.activation))
        self.mlp_post_norm = post_norm()

    def forward(self, x, rope: Rotary, mask=None):
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), rope, mask))
        return x + self.mlp_post_norm(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    """Token embedding -> blocks -> final RMSNorm -> LM head; ``forward`` returns the loss.

    ``recompute[i]`` (set by ``labkit.transformer.checkpointing``): 0 / False keeps block i's
    activations; n >= 1 (True = 1) recomputes blocks i .. i+n-1 as one unit from block i's input in
    the backward pass (the blocks it covers are then skipped in the list). ``loss_chunk``: None
    computes the (B*T, vocab) logits at once; n runs the head and the loss n tokens at a time
    (``labkit.transformer.loss``).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.rope = Rotary(cfg.rope_dim, cfg.max_seq, cfg.rope_theta)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, cfg.norm_style)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.recompute = [False] * cfg.layers      # per block: keep activations or recompute
        self.checkpoint_options = {}                # extra torch.utils.checkpoint arguments
        self.loss_chunk = None                      # tokens per chunk of the loss, or None
        self.reset_parameters()

    def reset_parameters(self):
        """Normal(0, 0.02) weights (GPT-2 / LLaMA practice); norms as built (ones; Gemma's
        zeros, which scale by 1 + weight)."""
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
            elif "router_bias" in name or name.endswith(".bias"):
                nn.init.zeros_(p)

    def run_blocks(self, x, first: int, last: int, rope, mask=None):
        """Blocks first .. last - 1 in order: the unit one checkpoint recomputes."""
        for block in self.blocks[first:last]:
            x = block(x, rope, mask)
        return x

    def forward(self, tokens, targets=None, position_ids=None, doc_ids=None, varlen=False):
        """tokens, targets: (B, T) int64. Returns the mean next-token loss, or logits if no targets.

        Packed rows (``labkit.training.batching``) pass ``position_ids`` and ``doc_ids`` (B, T):
        each token then attends only within its document, at its position in that document, through
        one dense (B, 1, T, T) mask, or with ``varlen=True`` document by document (no mask).
        """
        if varlen and doc_ids is None:
            raise ValueError("varlen=True attends within documents: pass doc_ids (B, T) too")
        if tokens.shape[1] > self.cfg.max_seq:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq="
                             f"{self.cfg.max_seq}; build the model with a larger max_seq")
        x = embed_tokens(self.embed, tokens, self.cfg)                            # (B, T, hidden)
        rope = self.rope if position_ids is None else PackedRotary(self.rope, position_ids)
        mask = None
        if doc_ids is not None and varlen:
            mask = Varlen(cu_seqlens(doc_ids))                                    # B*T offsets
        elif doc_ids is not None:        # in the dtype attention computes in (bf16 under autocast)
            dtype = (torch.get_autocast_dtype(x.device.type)
                     if torch.is_autocast_enabled(x.device.type) else x.dtype)
            mask = document_mask(doc_ids, dtype)                                 # (B, 1, T, T)
        i = 0
        while i < len(self.blocks):
            span = int(self.recompute[i])      # 0: keep; n: blocks i .. i+n-1 recompute as one
            if span:
                x = torch.utils.checkpoint.checkpoint(self.run_blocks, x, i, i + span, rope, mask,
                                                      use_reentrant=False,
                                                      **self.checkpoint_options)
            else:
                x = self.run_blocks(x, i, i + 1, rope, mask)
            i += max(span, 1)
        if targets is not None and self.loss_chunk:    # no (B*T, vocab) logits (loss.py)
            if self.cfg.logit_softcap:
                raise ValueError("the chunked loss (loss_chunk) does not soft-cap the logits "
                                 f"(logit_softcap={self.cfg.logit_softcap}): set loss_chunk=None")
            return chunked_cross_entropy(self.norm(x).flatten(0, 1), self.lm_head.weight,
                                         targets.flatten(), self.loss_chunk)
        logits = soft_cap(self.lm_head(self.norm(x)), self.cfg.logit_softcap)      # (B, T, vocab)
        if targets is None:
            return logits
        # the loss in fp32 whatever the compute dtype: log-softmax over a large vocab needs it
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device=None) -> Transformer:
    """A ``Transformer`` with parameters of ``dtype``; call under FakeTensorMode for full scale.

    The default dtype is set while building rather than converting after, because
    ``module.to(dtype)`` cannot swap parameters of fake tensors.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return Transformer(cfg)
    finally:
        torch.set_default_dtype(previous)
