"""The structure of ``labkit.transformer.model``'s layers, written once, as data: the parameter
tensors of each part and the tensors each sub-layer saves for its backward pass.

``count_params`` and ``labkit.estimate`` read only this module (it imports no model).
Korthikanti et al. (2022) count sbh(34 + 5as/h) bytes per GPT-3 layer in fp16; ours differ in
RMSNorm (fp32 statistics), SwiGLU (4 ffn-wide tensors instead of 2), no dropout masks, and
SDPA's fused kernel, which keeps no (T, T) matrix: no 5as/h term. The tiled core
(``labkit.transformer.attention``) keeps what SDPA keeps. The naive core brings the term back: its
(B, H, T, T) probabilities, b a s^2 numbers per layer (Korthikanti: 2 bytes of softmax output,
1 of dropout mask, 2 of dropout output, 5as/h per token and hidden unit), are 4 bytes each in
fp32 and 6 in bf16 or under autocast (the fp32 softmax's output, as Meta's LLaMA code and
transformers' eager attention compute it, and the bf16 copy the next matmul keeps): 6as/h.
It also keeps its repeated key and value heads (4 head-wide tensors per token instead of
2 H + 2 Hkv) and no log-sum-exp.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.config import ModelConfig, preset
from labkit.core.recipe import compute_bytes, state_bytes


# ---- parameters -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Weight:
    """One parameter tensor: a ``fan_in`` -> ``fan_out`` matmul weight, or a vector (fan_in 1).

    ``split`` says how tensor parallelism cuts it: "column" (its outputs), "row" (its inputs),
    "vocab" (embedding and LM head rows) or "replicated". Routed experts are one stacked
    tensor of ``copies`` experts, of which a token passes through ``used``.
    """

    name: str
    fan_in: int
    fan_out: int
    split: str = "column"
    matmul: bool = True
    copies: int = 1
    used: int = 1
    trains: bool = True        # False: no gradient (DeepSeek-V3's router bias)

    @property
    def numel(self) -> int:
        return self.fan_in * self.fan_out * self.copies

    def local(self, tp: int = 1, ep: int = 1) -> int:
        """Elements one tensor-parallel (and expert-parallel) rank holds."""
        return self.numel // (1 if self.split == "replicated" else tp) // (ep if self.copies > 1 else 1)

    def out_width(self, tp: int = 1) -> int:
        """Outputs per token on one tensor-parallel rank, over the copies a token uses."""
        return self.used * (self.fan_out // tp if self.split == "column" else self.fan_out)


def _vector(name: str, width: int) -> Weight:
    return Weight(name, 1, width, split="replicated", matmul=False)


def _swiglu(prefix: str, hidden: int, width: int, copies: int = 1, used: int = 1) -> list[Weight]:
    return [Weight(f"{prefix}.w_gate", hidden, width, "column", copies=copies, used=used),
            Weight(f"{prefix}.w_up", hidden, width, "column", copies=copies, used=used),
            Weight(f"{prefix}.w_down", width, hidden, "row", copies=copies, used=used)]


def attention_weights(c: ModelConfig) -> list[Weight]:
    """GQA's four projections (+ Qwen2's q, k, v biases), or MLA's low-rank ones and norms."""
    H = c.heads
    if c.attention == "gqa":
        ws = [Weight("attn.wq", c.hidden, H * c.head_dim), Weight("attn.wk", c.hidden, c.kv_heads * c.head_dim),
              Weight("attn.wv", c.hidden, c.kv_heads * c.head_dim)]
        if c.qkv_bias:
            ws += [Weight(w.name + ".bias", 1, w.fan_out, "column", matmul=False) for w in ws]
        # OLMo 2: over each whole projection; under tp counted with this rank's heads, its
        # statistics all-reduced (labkit's tensor parallelism refuses it; transformers' tp plan
        # gathers q and k instead)
        if c.qk_norm and c.qk_norm_width == "all":
            ws += [Weight(f"attn.{n}_norm", 1, w.fan_out, "column", matmul=False)
                   for n, w in zip("qk", ws)]
        elif c.qk_norm:      # one weight per head dimension, shared by the heads
            ws += [_vector("attn.q_norm", c.head_dim), _vector("attn.k_norm", c.head_dim)]
        return ws + [Weight("attn.wo", H * c.head_dim, c.hidden, "row")]
    if c.q_lora_rank:    # the down-projections and the latent's norms are replicated over tp
        ws = [Weight("attn.wq_a", c.hidden, c.q_lora_rank, "replicated"),
              _vector("attn.q_norm", c.q_lora_rank),
              Weight("attn.wq_b", c.q_lora_rank, H * c.qk_head_dim)]
    else:
        ws = [Weight("attn.wq", c.hidden, H * c.qk_head_dim)]
    return ws + [Weight("attn.wkv_a", c.hidden, c.kv_lora_rank + c.qk_rope_dim, "replicated"),
                 _vector("attn.kv_norm", c.kv_lora_rank),
                 Weight("attn.wkv_b", c.kv_lora_rank, H * (c.qk_nope_dim + c.v_head_dim)),
                 Weight("attn.wo", H * c.v_head_dim, c.hidden, "row")]


def mlp_weights(c: ModelConfig, moe: bool) -> list[Weight]:
    """A dense SwiGLU, or the MoE block: router, stacked routed experts, shared experts."""
    if not moe:
        return _swiglu("mlp", c.hidden, c.ffn)
    ws = [Weight("mlp.router", c.hidden, c.routed_experts, "replicated")]
    if c.router_bias:      # moved by the balancing rule, not trained (``model.MoE``)
        ws.append(Weight("mlp.router_bias", 1, c.routed_experts, "replicated", matmul=False,
                         trains=False))
    ws += _swiglu("mlp.experts", c.hidden, c.moe_ffn, copies=c.routed_experts, used=c.top_k)
    if c.shared_experts:
        ws += _swiglu("mlp.shared", c.hidden, c.shared_experts * c.moe_ffn)
    return ws


def block_weights(c: ModelConfig, moe: bool) -> list[Weight]:
    """Every parameter tensor of a block (an MoE block after the first ``dense_layers``), in the
    model's order: a norm before each sub-layer, after it (OLMo 2), or both (Gemma)."""
    def norm(name: str, present: bool) -> list[Weight]:
        return [_vector(name, c.hidden)] if present else []
    return (norm("attn_norm", c.pre_norms) + attention_weights(c)
            + norm("attn_post_norm", c.post_norms) + norm("mlp_norm", c.pre_norms)
            + mlp_weights(c, moe) + norm("mlp_post_norm", c.post_norms))


def lora_targets(c: ModelConfig, moe: bool) -> list[Weight]:
    """The weights "all-linear" LoRA adapts in a block (``labkit.quantisation.lora``): every linear
    layer but the MoE router; the routed experts are one stacked tensor, not linear layers."""
    return [w for w in block_weights(c, moe)
            if w.matmul and w.copies == 1 and w.name != "mlp.router"]


def lora_weights(c: ModelConfig, moe: bool, r: int) -> list[Weight]:
    """A block's trainable LoRA tensors, in model order: A (in -> r) and B (r -> out) per target.
    Under tp, as Megatron's and PEFT's parallel LoRA: a column-parallel target's B splits its
    outputs (A whole), a row-parallel one's A splits its inputs (B whole)."""
    return [ab for w in lora_targets(c, moe) for ab in
            (Weight(w.name + ".lora_A", w.fan_in, r, "row" if w.split == "row" else "replicated"),
             Weight(w.name + ".lora_B", r, w.fan_out,
                    "column" if w.split == "column" else "replicated"))]


def embedding_weights(c: ModelConfig) -> list[Weight]:
    return [Weight("embed", c.vocab_size, c.hidden, "vocab", matmul=False)]


def head_weights(c: ModelConfig) -> list[Weight]:
    """The final norm and the LM head (none when tied to the embedding)."""
    head = [] if c.tie_embeddings else [Weight("lm_head", c.hidden, c.vocab_size, "vocab")]
    return [_vector("norm", c.hidden)] + head


@dataclass
class ParamCount:
    """Parameter counts. ``active``: used per token (all but the unchosen routed experts),
    embedding and LM head included; published "activated" figures differ on whether they count
    the input embedding (lab 01 compares them)."""

    total: int
    active: int
    by_component: dict[str, int]


def _component(weight: Weight) -> str:
    name = weight.name
    if name.startswith("attn."):
        return "attention"
    for prefix, component in (("mlp.router", "router"), ("mlp.experts", "routed experts"),
                              ("mlp.shared", "shared experts"), ("mlp.", "dense mlp"),
                              ("embed", "embedding"), ("lm_head", "lm head")):
        if name.startswith(prefix):
            return component
    return "norms"


def count_params(cfg: ModelConfig | str) -> ParamCount:
    """Exact parameter count of the model ``labkit.transformer.model`` builds, by component."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    weights = (embedding_weights(c) + head_weights(c)
               + [w for i in range(c.layers) for w in block_weights(c, i >= c.dense_layers)])
    parts = dict.fromkeys(("embedding", "attention", "dense mlp", "router", "shared experts",
                           "routed experts", "norms", "lm head"), 0)
    for w in weights:
        parts[_component(w)] += w.numel
    parts = {k: v for k, v in parts.items() if v or k in ("embedding", "attention")}
    total = sum(parts.values())
    idle = sum(w.numel - w.numel // w.copies * w.used for w in weights if w.copies > 1)
    return ParamCount(total, total - idle, parts)


# ---- what autograd saves, per sub-layer -------------------------------------------------------
@dataclass(frozen=True)
class Term:
    """A named kind of tensor and its bytes: per token (x B*T), per position (x T), per layer,
    per (query, key) pair of a sequence (x B*T*T: naive attention's matrices)."""

    name: str
    dtype: str
    per_token: float = 0
    per_position: float = 0
    per_layer: float = 0
    category: str = "activations"
    per_pair: float = 0
    from_seq: int = 0         # counted from this sequence length on (a sliding window's mask)

    def bytes(self, batch: int, seq: int) -> int:
        if seq < self.from_seq:
            return 0
        return round(self.per_token * batch * seq + self.per_position * seq + self.per_layer
                     + self.per_pair * batch * seq * seq)


class Saved(list):
    """The terms one layer keeps for backward; ``bytes(batch, seq)`` adds them up."""

    def bytes(self, batch: int, seq: int, category: str | None = None) -> int:
        return sum(t.bytes(batch, seq) for t in self if category in (None, t.category))

    @property
    def per_token(self) -> float:
        """Bytes per token, the terms counted from a sequence length on included."""
        return sum(t.per_token for t in self)

    @property
    def per_layer(self) -> float:
        return sum(t.per_layer for t in self)


@dataclass(frozen=True)
class Dtypes:
    """Bytes of each kind of tensor under a precision."""

    compute: int      # matmul outputs, attention (bf16 under autocast)
    stream: int       # the residual stream (the weights' dtype)
    mixed: bool       # autocast: each linear saves its own low-precision copy of its input

    @classmethod
    def of(cls, precision: str) -> "Dtypes":
        return cls(compute_bytes(precision), state_bytes(precision).weights,
                   state_bytes(precision).weight_cache > 0)

    @property
    def name(self) -> str:
        return "fp32" if self.compute == 4 else "bf16"

    @property
    def stream_name(self) -> str:
        return "fp32" if self.stream == 4 else "bf16"

    def linear_inputs(self, consumers: int, width: float) -> float:
        """Saved inputs of ``consumers`` linears reading one tensor of ``width`` per token."""
        return consumers * width * 2 if self.mixed else width * self.compute


def _rmsnorm(width: float, input_bytes: int, frozen: bool = False) -> float:
    """``labkit.transformer.model.RMSNorm`` keeps x in fp32 (x itself, or its fp32 copy), rstd
    (fp32), and the normalised x in x's dtype for the weight's product: 8w + 4 in fp32,
    6w + 4 in bf16. A frozen weight needs no gradient, so autograd keeps no normalised x: 4w + 4."""
    return 4 * width + 4 + (0 if frozen else input_bytes * width)


def _norm(c: ModelConfig, width: float, input_bytes: int, frozen: bool = False) -> float:
    """``_rmsnorm`` in the model's norm style: Gemma's and OLMo 2's keep the normalised x in
    fp32 (for the fp32 product with the weight), whatever x's dtype."""
    return _rmsnorm(width, input_bytes if c.norm_style == "llama" else 4, frozen)


def attention_core_saved(d: Dtypes, heads: int, kv_heads: int, head_dim: int,
                          attention: str, mla: bool = False, softcap: bool = False) -> list[Term]:
    """What the attention core keeps, with its output. SDPA and the tiled core: q, k, v (kv
    heads), their output and one fp32 log-sum-exp per row. Naive: k and v repeated to every
    head, the (T, T) probabilities of each head (fp32 4 bytes; 16-bit 4 for the fp32 softmax + 2
    for the bf16 copy its matmul with v keeps), and no output of its own: wo's
    input is a copy (MLA's: its un-padded part, a term of its own). ``softcap`` (Gemma 2): the
    naive core keeps the tanh's (T, T) output too; fused and tiled cores recompute it."""
    cdt, qkv = d.name, ("q, k, padded v" if mla else "q, k, v")
    if attention != "naive":
        return [Term(f"{qkv} and attention output", cdt,
                     (2 * heads + 2 * kv_heads) * head_dim * d.compute),
                Term("attention log-sum-exp", "fp32", 4 * heads)]
    probability = 4 if d.compute == 4 else 6        # fp32 softmax + the 16-bit copy v takes
    kept = f"{qkv} (one per head)" if mla else "q, repeated k and v, and wo's input"
    return [Term(kept, cdt, (3 if mla else 4) * heads * head_dim * d.compute),
            Term("attention probabilities (T x T per head)",
                 "fp32" if d.compute == 4 else "fp32 + bf16", per_pair=heads * probability)] + (
        [Term(SOFT_CAPPED_SCORES, cdt, per_pair=heads * d.compute)] if softcap else [])


def _window_saved(c: ModelConfig, d: Dtypes, H: int, Hkv: int, attention: str,
                  window: int) -> list[Term]:
    """From seq = ``window`` on, a sliding-window layer through SDPA (``model.windowed_sdpa``)
    keeps SDPA's float copy of its (B, 1, T, T) mask and k and v repeated to every head (a
    view of one kv head: no bytes)."""
    if not window or attention != "sdpa" or c.attn_softcap:
        return []
    repeated = [Term("k and v repeated to every head (transformers' choice with a mask)", d.name,
                     2 * (H - Hkv) * c.head_dim * d.compute, from_seq=window)] if Hkv > 1 else []
    return [Term("sliding-window mask, SDPA's float copy (B x T x T)", d.name, per_pair=d.compute,
                 from_seq=window)] + repeated


def _attention_saved(c: ModelConfig, d: Dtypes, tp: int, sp: int, attention: str = "sdpa",
                     frozen: bool = False, window: int = 0) -> Saved:
    """The attention sub-layer after its norm: projections' inputs, (Qwen3) the q and k norms,
    and the core's q, k, v, output and log-sum-exp (or, naive, its probabilities).

    Heads are split over ``tp`` ranks; inputs replicated on each rank are split over ``sp``.
    """
    H, cdt = c.heads // tp, d.name
    # under autocast the q and k norms' fp32 weights make q and k fp32: RoPE casts nothing
    # (Gemma's and OLMo's norms cast their output back to the input's bf16)
    cast = d.compute != 4 and not (c.qk_norm and d.mixed and c.norm_style == "llama")
    rope = Term("RoPE cos/sin cast to the compute dtype", cdt,
                per_position=4 * c.rope_dim * d.compute if cast else 0)
    if c.attention == "gqa":
        Hkv = max(1, c.kv_heads // tp)
        whole = c.qk_norm_width == "all"       # OLMo 2: one norm over all of this rank's heads
        norms = [Term(f"q and k RMSNorms ({'all heads' if whole else 'per head'})",
                      "fp32" if d.compute == 4 or frozen or c.norm_style != "llama"
                      else "fp32 + bf16",
                      _norm(c, (H + Hkv) * c.head_dim, d.compute, frozen) + 4 if whole else
                      (H + Hkv) * _norm(c, c.head_dim, d.compute, frozen))] if c.qk_norm else []
        return Saved([
            # with sp the input is all-gathered once (in bf16 under autocast) for q, k and v
            Term("input of wq, wk, wv", cdt, d.linear_inputs(3 if sp == 1 else 1, c.hidden) / sp),
            *norms, *attention_core_saved(d, H, Hkv, c.head_dim, attention,
                                          softcap=bool(c.attn_softcap)), rope,
            *_window_saved(c, d, H, Hkv, attention, window)])
    qk, r = c.qk_head_dim, c.kv_lora_rank
    low_rank = d.linear_inputs(2, c.hidden)                                  # into wq(_a), wkv_a
    if c.q_lora_rank:
        low_rank += _rmsnorm(c.q_lora_rank, d.compute) + d.linear_inputs(1, c.q_lora_rank)
    # in fp32 the norm keeps its input: a view of the whole (latent + rope key) projection
    low_rank += _rmsnorm(r, d.compute) + (4 * c.qk_rope_dim if d.compute == 4 else 0)
    low_rank += d.linear_inputs(1, r)                                        # into wkv_b
    return Saved([
        Term("low-rank q and kv path (replicated over tp)", cdt, low_rank / sp),
        *attention_core_saved(d, H, H, qk, attention, mla=True),
        Term("un-padded attention output into wo", cdt, H * c.v_head_dim * d.compute), rope])


def _swiglu_saved(width: int, d: Dtypes) -> float:
    return 4 * width * d.compute                                             # gate, silu, up, product


def _mlp_saved(c: ModelConfig, d: Dtypes, moe: bool, tp: int, sp: int, etp: int = 1) -> Saved:
    """The MLP sub-layer after its norm (a dense SwiGLU or the MoE block); under expert tensor
    parallelism (``etp``) the experts keep etp x the rows, each 1/etp of the ffn wide."""
    cdt = d.name
    if not moe:
        return Saved([Term("input of w_gate, w_up", cdt,
                           d.linear_inputs(2 if sp == 1 else 1, c.hidden) / sp),
                      Term("SwiGLU gate, silu, up, product", cdt, _swiglu_saved(c.ffn // tp, d))])
    k, E, shared = c.top_k, c.routed_experts, c.shared_experts
    sorted_tokens = 2 * d.linear_inputs(1, k * c.hidden) if d.mixed else k * c.hidden * d.compute
    return Saved([
        Term("input of router and shared experts", cdt, d.linear_inputs(1 + 2 * (shared > 0), c.hidden) / sp),
        Term("router softmax", "fp32", 4 * E),
        Term("expert ids, sort order, token index", "int64", 3 * 8 * k),
        Term("gate weights, sorted", d.stream_name, d.stream * k),
        Term("tokens sorted by expert", cdt, etp * sorted_tokens),
        Term("routed experts' SwiGLUs", cdt, etp * k * _swiglu_saved(c.moe_ffn // (tp * etp), d)),
        Term("experts' outputs and their gate-weighted copy", f"{cdt} + {d.stream_name}",
             k * c.hidden * (d.compute + d.stream)),
        Term("shared experts' SwiGLU", cdt, _swiglu_saved(shared * c.moe_ffn // tp, d))])


def _matmul_outputs(c: ModelConfig, d: Dtypes, moe: bool, tp: int, lora_rank: int = 0) -> Saved:
    """What the ``selective`` policy keeps besides the block's input: every matmul's output
    and fused attention's output (padded to the query width under MLA) and log-sum-exp. With
    LoRA adapters each adapter's two matmuls too: x A^T (r wide) and its update (out wide)."""
    H = c.heads // tp
    matmuls = sum(w.out_width(tp) for w in attention_weights(c) + mlp_weights(c, moe) if w.matmul)
    attention_out = H * c.qk_head_dim
    adapters = sum(lora_rank + w.out_width(tp) for w in lora_targets(c, moe)) if lora_rank else 0
    return Saved([Term("matmul and attention outputs", d.name,
                       (matmuls + attention_out) * d.compute),
                  Term("attention log-sum-exp", "fp32", 4 * H),
                  *([Term("LoRA adapters' x A^T and updates", d.name, adapters * d.compute)]
                    if lora_rank else [])])


def weight_copies(c: ModelConfig, moe: bool, tp: int = 1, ep: int = 1) -> int:
    """Bytes of autocast's bf16 copies of a block's matmul weights on one rank."""
    return 2 * sum(w.local(tp, ep) for w in block_weights(c, moe) if w.matmul)


# the linears that read a block's first norm: in the model's first block under LoRA their input
# (the frozen embedding's output, normalised) needs no gradient
READ_THE_BLOCK_INPUT = ("attn.wq", "attn.wk", "attn.wv", "attn.wq_a", "attn.wkv_a")


def lora_weight_copies(c: ModelConfig, moe: bool, r: int, first: bool = False,
                       weight_format: str | None = None, tp: int = 1, ep: int = 1,
                       sp: bool = False) -> int:
    """Bytes of the bf16 weight copies a LoRA block keeps under autocast. None is cached
    (autocast caches only leaf weights that train; the adapters reach their matmuls as views,
    A^T), but a matmul whose input needs a gradient keeps its weight's copy for it: every frozen
    matmul weight but an NF4 one (``quant.QuantLinear`` dequantises it again in backward), and
    each adapter's A and B. In the model's first block the linears reading the first norm keep
    neither their weight's copy nor A's. One tp (and ep) rank's share. Under sp a column
    target's frozen weight is cast again in its backward (``parallel.tensor.GatheredLinears``)
    and its A, a leaf there, is cached by autocast in every block."""
    targets = lora_targets(c, moe)
    gathered = {w.name for w in targets if w.split == "column"} if sp and tp > 1 else set()
    skip = set(READ_THE_BLOCK_INPUT) if first and not gathered else set()
    frozen = sum(w.local(tp, ep) for w in block_weights(c, moe) if w.matmul and w not in targets)
    if weight_format is None:
        frozen += sum(w.local(tp) for w in targets if w.name not in skip | gathered)
    adapters = sum(w.local(tp) for w in lora_weights(c, moe, r)
                   if w.name.removesuffix(".lora_A") not in skip)
    return 2 * (frozen + adapters)


def layer_saved(c: ModelConfig, precision: str, moe: bool = False, tp: int = 1,
                recompute: str = "none", sp: bool = False, ep: int = 1, lora_rank: int = 0,
                first: bool = False, attention: str = "sdpa", layer: int = 0,
                weight_format: str | None = None, etp: int = 1) -> Saved:
    """What one transformer block keeps for its backward pass, per tensor-parallel rank.

    ``recompute``: "none" keeps everything, "full" only the block's input, "selective" the
    input plus the matmul and attention outputs. With sequence parallelism (``sp``) the
    tensors every rank would hold whole (norms, the residual stream, the inputs of
    column-parallel projections) are split over the ranks too. Under autocast the bf16
    weight copies are a term of their own (category "weight_cache"). ``lora_rank`` > 0: the
    block is frozen with rank-``lora_rank`` adapters (``labkit.quantisation.lora``) on weights
    stored as ``weight_format`` (None or "nf4"), with any recompute policy and precision
    (autocast: ``lora_weight_copies``; "selective": the adapters' matmul outputs too);
    ``first``: it is the model's first block. ``attention``: the core
    (``labkit.transformer.attention``); "naive" keeps its (T, T) probabilities. ``layer``: its
    index, the first by default (a sliding-window layer's mask: ``_window_saved``). ``ep``: the
    ranks the routed experts are split over (ep x etp); ``etp`` > 1: each expert's rows are
    gathered over etp ranks, each holding 1/etp of its ffn width.
    """
    d, split = Dtypes.of(precision), (tp if sp else 1)
    block_input = Saved([Term("block input (residual stream)", d.stream_name,
                              c.hidden * d.stream / split)])
    if recompute == "full":
        return block_input
    if recompute == "selective":
        return Saved(block_input + _matmul_outputs(c, d, moe, tp, lora_rank))
    copies = 0 if not d.mixed else (
        lora_weight_copies(c, moe, lora_rank, first, weight_format, tp, ep, sp) if lora_rank else
        weight_copies(c, moe, tp, ep))
    # LoRA: frozen norms keep no normalised x; the model's first norm keeps nothing at all
    # (its input, the frozen embedding's output, needs no gradient)
    frozen, norms = lora_rank > 0, 1 if first else 2
    # Gemma's sandwich, OLMo 2: each sub-layer's output (compute dtype) normalised before the add
    dtype = "fp32" if d.compute == 4 or frozen or c.norm_style != "llama" else "fp32 + bf16"
    post = ([Term(f"RMSNorm of the {part}'s output", dtype,
                  _norm(c, c.hidden, d.compute, frozen) / split) for part in ("attention", "MLP")]
            if c.post_norms else [])
    norms *= c.pre_norms                      # OLMo 2 normalises no sub-layer's input
    return Saved([Term("RMSNorm inputs and outputs", "fp32" if d.stream == 4 or frozen
                       else "fp32 + bf16", norms * _norm(c, c.hidden, d.stream, frozen) / split)]
                 + post + _attention_saved(c, d, tp, split, attention, frozen,
                                           c.window_of(layer))
                 + _mlp_saved(c, d, moe, tp, split, etp)
                 + ([Term("bf16 weight copies (autocast)", "bf16", per_layer=copies,
                          category="weight_cache")] if copies else [])
                 # each adapter keeps x A^T (N, r) for B's gradient; a frozen linear keeps
                 # nothing, its input (kept for A's gradient) is the one it kept before
                 + ([Term("LoRA adapters' x A^T", d.name,
                          len(lora_targets(c, moe)) * lora_rank * d.compute)] if frozen else []))


SOFTMAX = "softmax over this rank's vocabulary (vocab-parallel loss)"
MLP_POST_NORM = "RMSNorm of the MLP's output"           # freed first in a layer's backward
SOFT_CAPPED_SCORES = "soft-capped scores, the tanh's output (T x T per head)"


def head_saved(c: ModelConfig, precision: str, tp: int = 1, loss_chunk: int | None = None,
               sp: bool = False, frozen: bool = False) -> Saved:
    """Final norm, the LM head's input, and the fp32 log-softmax over the vocabulary - or, with
    a chunked loss (``labkit.transformer.loss``), one fp32 log-sum-exp per token. Under tensor
    parallelism the head is vocabulary-parallel (``labkit.parallel.tensor.tensor_parallel``): each
    rank keeps the fp32 softmax of its vocab / tp logits; with ``sp`` the final norm and the head's
    input keep only this rank's tokens (the head all-gathers them, and again in its backward pass).
    ``frozen`` (LoRA): the head's weight needs no gradient, so its input is not kept, nor the final
    norm's normalised x. Soft-capped logits (Gemma 2) keep the tanh's output too."""
    d, split = Dtypes.of(precision), (tp if sp else 1)
    if loss_chunk and c.logit_softcap:
        raise ValueError(f"the chunked loss does not soft-cap the logits (logit_softcap="
                         f"{c.logit_softcap}): set loss_chunk=None")
    loss = (Term("log-sum-exp per token and token count (chunked loss)", "fp32 + int64", 4,
                 per_layer=8) if loss_chunk else
            Term(SOFTMAX, "fp32", 4 * c.vocab_size / tp) if tp > 1 else
            Term("log-softmax over the vocabulary", "fp32", 4 * c.vocab_size))
    terms = [Term("final RMSNorm", "fp32" if d.stream == 4 else "fp32 + bf16",
                  _norm(c, c.hidden, d.stream, frozen) / split),
             Term("input of the LM head", d.name,
                  0 if frozen else d.linear_inputs(1, c.hidden) / split), loss]
    if c.logit_softcap:                 # Gemma 2: the tanh keeps its output, the logits' size
        terms.append(Term("soft-capped logits (tanh)", d.name, d.compute * c.vocab_size / tp))
    # a frozen head under sp is cast again in its backward (``parallel.tensor.GatheredLinears``)
    if d.mixed and not (frozen and sp and tp > 1):
        terms.append(Term("bf16 copy of the LM head (autocast)", "bf16",
                          per_layer=2 * c.vocab_size * c.hidden // tp, category="weight_cache"))
    return Saved(terms)
