"""Closed-form parameter counts and training memory, derived for ``labkit.model``'s layers.

``count_params`` is exact. ``estimate`` predicts the peak of one steady-state training step
as the largest of a few moments (the loss, the start of backward, each end of the layer
stack's backward, the optimizer step), each a sum of named tensors: what autograd saves
in our layers (listed per sub-layer below), the transient gradients, and the model states.
Korthikanti et al.'s sbh(34 + 5as/h) counts the same things for GPT-3's layers in fp16;
ours differ in RMSNorm (fp32 statistics), SwiGLU (4 ffn-wide tensors instead of 2), no
dropout masks, and SDPA's fused kernel, which keeps no (T, T) matrix: no 5as/h term.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .checkpointing import RECOMPUTE_POLICIES as RECOMPUTE, parse_policy, plan
from .config import ModelConfig, preset
from .papers import model_state_bytes  # noqa: F401  (re-exported: the ZeRO paper's formula)
from .train import OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS, check_choice, default_optimizer_impl
from .units import Breakdown, dtype_bytes



# ---- parameters ------------------------------------------------------------------------
@dataclass
class ParamCount:
    """Parameter counts. ``active``: used per token (all but the unchosen routed experts),
    embedding and LM head included - DeepSeek's published "activated" figures count them."""

    total: int
    active: int
    by_component: dict[str, int]


def _attention_params(c: ModelConfig) -> int:
    if c.attention == "gqa":
        return c.hidden * c.head_dim * (2 * c.heads + 2 * c.kv_heads)            # q, o; k, v
    q = (c.hidden * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.heads * c.qk_head_dim
         if c.q_lora_rank else c.hidden * c.heads * c.qk_head_dim)
    kv = (c.hidden * (c.kv_lora_rank + c.qk_rope_dim) + c.kv_lora_rank
          + c.kv_lora_rank * c.heads * (c.qk_nope_dim + c.v_head_dim))
    return q + kv + c.heads * c.v_head_dim * c.hidden


def count_params(cfg: ModelConfig | str) -> ParamCount:
    """Exact parameter count of the model ``labkit.model`` builds, by component."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    h, L, moe = c.hidden, c.layers, c.moe_layers
    expert = 3 * h * c.moe_ffn
    parts = {
        "embedding": c.vocab_size * h,
        "attention": L * _attention_params(c),
        "dense mlp": c.dense_layers * 3 * h * c.ffn,
        "router": moe * (c.routed_experts * h + (c.routed_experts if c.router_bias else 0)),
        "shared experts": moe * c.shared_experts * expert,
        "routed experts": moe * c.routed_experts * expert,
        "norms": (2 * L + 1) * h,
        "lm head": 0 if c.tie_embeddings else c.vocab_size * h,
    }
    parts = {k: v for k, v in parts.items() if v or k in ("embedding", "attention")}
    total = sum(parts.values())
    return ParamCount(total, total - moe * (c.routed_experts - c.top_k) * expert, parts)


def _layer_params(c: ModelConfig, moe: bool) -> tuple[int, int]:
    """(parameters of one layer, of them the matmul weights autocast copies) for one device."""
    if moe:
        mlp = (c.routed_experts * c.hidden + 3 * c.hidden * c.moe_ffn * (
            c.routed_experts + c.shared_experts) + (c.routed_experts if c.router_bias else 0))
    else:
        mlp = 3 * c.hidden * c.ffn
    norms = 2 * c.hidden + (c.q_lora_rank + c.kv_lora_rank if c.attention == "mla" else 0)
    total = _attention_params(c) + mlp + 2 * c.hidden
    matmul = total - norms - (c.routed_experts if moe and c.router_bias else 0)
    return total, matmul


# ---- what autograd saves, per sub-layer ------------------------------------------------
@dataclass
class Saved:
    """Bytes a layer keeps for backward: per token (x B*T), per position (x T), per layer."""

    per_token: float = 0
    per_position: float = 0
    per_layer: float = 0

    def __add__(self, other: "Saved") -> "Saved":
        return Saved(self.per_token + other.per_token, self.per_position + other.per_position,
                     self.per_layer + other.per_layer)

    def bytes(self, batch: int, seq: int) -> int:
        return round(self.per_token * batch * seq + self.per_position * seq + self.per_layer)


@dataclass(frozen=True)
class _Dtypes:
    """Bytes per element of each kind of tensor under a precision."""

    compute: int      # matmul outputs, attention (bf16 under autocast)
    stream: int       # the residual stream, weights and gradients (fp32 unless bf16 weights)
    mixed: bool       # autocast: each linear saves its own low-precision copy of its input
    master: bool      # the optimizer keeps fp32 master weights (and fp32 state)

    @classmethod
    def of(cls, precision: str) -> "_Dtypes":
        bf16_weights = precision in ("bf16", "bf16-master")
        return cls(compute=4 if precision == "fp32" else 2, stream=2 if bf16_weights else 4,
                   mixed=precision.endswith("-mixed"), master=precision == "bf16-master")

    @property
    def state(self) -> int:
        """Bytes of one optimizer-state number (the masters' dtype when there are masters)."""
        return 4 if self.master else self.stream

    def linear_inputs(self, consumers: int, width: float) -> float:
        """Saved inputs of ``consumers`` linears reading one tensor of ``width`` per token."""
        return consumers * width * 2 if self.mixed else width * self.compute


def _rmsnorm(width: float) -> float:
    # F.rms_norm computes in fp32: keeps x (or its fp32 copy), x * rstd, and rstd
    return 8 * width + 4


def _attention_saved(c: ModelConfig, d: _Dtypes, tp: int, sp: int) -> Saved:
    """The attention sub-layer after its norm: projections' inputs, q, k, v, output, log-sum-exp.

    Heads are split over ``tp`` ranks; inputs replicated on each rank are split over ``sp``.
    """
    H = c.heads // tp
    rope_tables = 0 if d.compute == 4 else 4 * c.rope_dim * d.compute     # cos, sin for q and k
    if c.attention == "gqa":
        Hkv = max(1, c.kv_heads // tp)
        per_token = (d.linear_inputs(3, c.hidden) / sp                       # into wq, wk, wv
                     + (2 * H + 2 * Hkv) * c.head_dim * d.compute            # q, k, v, output
                     + 4 * H)                                                # log-sum-exp (fp32)
        return Saved(per_token, rope_tables)
    qk, r = c.qk_head_dim, c.kv_lora_rank
    per_token = d.linear_inputs(2, c.hidden)                                 # into wq(_a), wkv_a
    if c.q_lora_rank:
        per_token += _rmsnorm(c.q_lora_rank) + d.linear_inputs(1, c.q_lora_rank)
    # in fp32 the norm keeps its input: a view of the whole (latent + rope key) projection
    per_token += _rmsnorm(r) + (4 * c.qk_rope_dim if d.compute == 4 else 0)
    per_token += d.linear_inputs(1, r)                                       # into wkv_b
    per_token /= sp                                      # the low-rank path is replicated
    per_token += (4 * H * qk * d.compute                                     # q, k, padded v, output
                  + 4 * H                                                    # log-sum-exp
                  + H * c.v_head_dim * d.compute)                            # un-padded output into wo
    return Saved(per_token, rope_tables)


def _swiglu_saved(width: int, d: _Dtypes) -> float:
    return 4 * width * d.compute                                             # gate, silu, up, product


def _mlp_saved(c: ModelConfig, d: _Dtypes, moe: bool, tp: int, sp: int) -> Saved:
    """The MLP sub-layer after its norm (a dense SwiGLU or the MoE block)."""
    if not moe:
        return Saved(d.linear_inputs(2, c.hidden) / sp + _swiglu_saved(c.ffn // tp, d))
    k, E, shared = c.top_k, c.routed_experts, c.shared_experts
    per_token = (d.linear_inputs(1 + 2 * (shared > 0), c.hidden) / sp        # router, shared experts
                 + 4 * E                                                     # router softmax (fp32)
                 + 3 * 8 * k                                                 # expert ids, order, token (int64)
                 + (2 if d.stream == 2 else 4) * k                           # gate weights, sorted
                 + (2 * d.linear_inputs(1, k * c.hidden) if d.mixed          # tokens sorted by expert
                    else k * c.hidden * d.compute)
                 + k * _swiglu_saved(c.moe_ffn // tp, d)                     # the k experts' SwiGLUs
                 + k * c.hidden * d.compute                                  # their stacked outputs
                 + k * c.hidden * d.stream                                   # ... times the gate weights
                 + _swiglu_saved(shared * c.moe_ffn // tp, d))               # the shared experts
    return Saved(per_token)


def _matmul_outputs(c: ModelConfig, d: _Dtypes, moe: bool, tp: int) -> Saved:
    """What the ``selective`` policy keeps besides the block's input: every matmul's output
    and fused attention's output and log-sum-exp; norms and elementwise ops are recomputed."""
    H, h = c.heads // tp, c.hidden
    if c.attention == "gqa":
        attention = 2 * H * c.head_dim + 2 * max(1, c.kv_heads // tp) * c.head_dim  # q, out; k, v
    else:
        q = (c.q_lora_rank + H * c.qk_head_dim) if c.q_lora_rank else H * c.qk_head_dim
        attention = (q + c.kv_lora_rank + c.qk_rope_dim + H * (c.qk_nope_dim + c.v_head_dim)
                     + H * c.qk_head_dim)                                    # ... padded output
    if moe:
        shared = c.shared_experts * c.moe_ffn // tp
        mlp = (c.routed_experts + c.top_k * (2 * c.moe_ffn // tp + h)
               + (2 * shared + h if shared else 0))                          # router, experts
    else:
        mlp = 2 * c.ffn // tp + h                                            # gate, up, down
    return Saved((attention + h + mlp) * d.compute + 4 * H)                  # + wo; lse (fp32)


def layer_saved(c: ModelConfig, precision: str, moe: bool = False, tp: int = 1,
                recompute: str = "none", sp: bool = False) -> Saved:
    """What one transformer block keeps for its backward pass, per tensor-parallel rank.

    ``recompute``: "none" keeps everything, "full" only the block's input, "selective" the
    input plus the matmul and attention outputs. With sequence parallelism (``sp``) the
    tensors every rank would hold whole (norms, the residual stream, the inputs of
    column-parallel projections) are split over the ranks too.
    """
    d, split = _Dtypes.of(precision), (tp if sp else 1)
    block_input = Saved(c.hidden * d.stream / split)
    if recompute == "full":
        return block_input
    if recompute == "selective":
        return block_input + _matmul_outputs(c, d, moe, tp)
    copies = 2 * _layer_params(c, moe)[1] // tp if d.mixed else 0            # autocast weight copies
    return (Saved(2 * _rmsnorm(c.hidden) / split, per_layer=copies)
            + _attention_saved(c, d, tp, split) + _mlp_saved(c, d, moe, tp, split))


def head_saved(c: ModelConfig, precision: str, tp: int = 1) -> Saved:
    """Final norm, the LM head's input, and the fp32 log-softmax over the vocabulary."""
    d = _Dtypes.of(precision)
    copies = 2 * c.vocab_size * c.hidden // tp if d.mixed else 0
    return Saved(_rmsnorm(c.hidden) + d.linear_inputs(1, c.hidden) + 4 * c.vocab_size / tp,
                 per_layer=copies)


# ---- the whole step ------------------------------------------------------------------------
@dataclass
class Estimate(Breakdown):
    """Predicted bytes per device at the step's peak; ``details`` holds every moment's total."""

    moments: dict = field(default_factory=dict)


def _check_layout(c: ModelConfig, batch, seq, dp, tp, pp, zero_stage, sp):
    for name, value in (("batch", batch), ("seq", seq), ("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if c.heads % tp:
        raise ValueError(f"tp={tp} does not divide heads={c.heads}; choose tp among the "
                         f"divisors of {c.heads}")
    if pp > c.layers:
        raise ValueError(f"pp={pp} is larger than layers={c.layers}; a pipeline stage needs "
                         f"at least one layer")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if sp and tp == 1:
        raise ValueError("sequence parallelism (sp=True) splits activations over the tensor-"
                         "parallel group: it needs tp > 1")


def estimate(cfg: ModelConfig | str, batch: int = 1, seq: int = 2048,
             precision: str = "bf16-mixed", optimizer: str = "adamw", recompute: str = "none",
             zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1, sp: bool = False,
             optimizer_impl: str | None = None, device: str = "cpu", every: int = 2) -> Estimate:
    """Predicted peak bytes per device of one steady-state training step, by category.

    ``recompute``: a ``labkit.checkpointing`` policy ("none", "selective", "every-k" with
    ``every``, "sqrt", "full").
    ``optimizer_impl`` is AdamW's implementation ("for-loop", "foreach", "fused"); by
    default what torch picks on ``device``. With ``pp`` > 1 the device reported is the
    busiest stage; with 1F1B the first stage keeps ``pp`` micro-batches of activations.
    """
    c = preset(cfg) if isinstance(cfg, str) else cfg
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    parse_policy(recompute, every)
    impl = optimizer_impl or default_optimizer_impl(device)
    check_choice("optimizer implementation", impl, OPTIMIZER_IMPLS)
    _check_layout(c, batch, seq, dp, tp, pp, zero_stage, sp)
    stages = [_stage(c, s, pp) for s in range(pp)]
    results = [_stage_estimate(c, layers, first, last, batch, seq, precision, optimizer,
                               recompute, every, zero_stage, dp, tp, sp, impl, in_flight)
               for layers, first, last, in_flight in stages]
    return max(results, key=lambda e: e.total)


def _stage(c: ModelConfig, s: int, pp: int):
    """(layer indices, holds the embedding, holds the head, micro-batches in flight) of stage s."""
    per = -(-c.layers // pp)
    layers = list(range(s * per, min(c.layers, (s + 1) * per)))
    return layers, s == 0, s == pp - 1, pp - s          # 1F1B: stage s keeps pp - s in flight


def _stage_estimate(c, layers, first, last, B, T, precision, optimizer, recompute, every,
                    zero_stage, dp, tp, sp, impl, in_flight) -> Estimate:
    d = _Dtypes.of(precision)
    N = B * T
    # -- model states ---------------------------------------------------------------------
    layer_params = [_layer_params(c, i >= c.dense_layers) for i in layers]
    n_params = (sum(p for p, _ in layer_params) + (c.vocab_size * c.hidden if first else 0)
                + ((c.vocab_size * c.hidden if not c.tie_embeddings else 0) + c.hidden
                   if last else 0))
    n_tensors = _param_tensors(c, layers, first, last)
    n_local = n_params // tp                                 # norms replicated: small, ignored
    shard = dp if zero_stage else 1
    params = n_local * d.stream // (dp if zero_stage >= 3 else 1)
    grad_bytes = n_local * d.stream // (dp if zero_stage >= 2 else 1)
    state_per_param = ({"adamw": 2 * d.state, "sgd": 0, "sgd-momentum": d.state,
                        "adamw-8bit": 2}[optimizer] + (4 if d.master else 0))     # + masters
    step_counters = 4 * n_tensors if optimizer.startswith("adamw") else 0
    opt_bytes = n_local * state_per_param // shard + step_counters
    buffers = 2 * c.max_seq * c.rope_dim * 4                                 # RoPE cos, sin
    # -- activations ------------------------------------------------------------------------
    units = plan(len(layers), recompute, every)
    kept = {}            # what each layer keeps: everything, its input, or (inside a unit) nothing
    for u in units:
        kept[u.first] = "selective" if recompute == "selective" else (
            "full" if u.recompute else "none")
        kept.update({i: "nothing" for i in range(u.first + 1, u.last)})
    full = [layer_saved(c, precision, i >= c.dense_layers, tp, "none", sp).bytes(B, T)
            for i in layers]
    saved = [0 if kept[j] == "nothing" else
             layer_saved(c, precision, i >= c.dense_layers, tp, kept[j], sp).bytes(B, T)
             for j, i in enumerate(layers)]
    unit_start = {i: u.first for u in units for i in range(u.first, u.last)}
    act_layers = sum(saved) * in_flight
    # alive the whole step: the token batch (B x (T + 1) int64, inputs and shifted targets)
    # and the loss (one fp32 number)
    batch_and_loss = (8 * B * (T + 1) if first else 0) + (4 if last else 0)
    head = head_saved(c, precision, tp).bytes(B, T) if last else 0
    logits = N * c.vocab_size // tp * 4                                      # one fp32 (N, V)
    grad_stream = N * c.hidden * d.stream
    # -- the moments where the peak can fall ----------------------------------------------------
    moments = {}

    def moment(name, phase, grads=0, activations=0, other=0):
        moments[name] = Estimate(params=params, grads=grads, optimizer=opt_bytes,
                                 activations=batch_and_loss + activations, other=buffers + other,
                                 peak_phase=phase)

    # autocast caches each weight's bf16 copy until the forward pass ends; a recomputed
    # layer saves none of them, so for it the cache is extra
    weight_cache = (2 * sum(m for j, (_, m) in enumerate(layer_params) if kept[j] != "none")
                    // tp if d.mixed else 0)
    if last:
        # forward, at the loss: the logits and their log-softmax (fp32) side by side
        logit_copies = logits + (logits // 2 if d.mixed else 0)
        moment("forward: loss", "forward",
               activations=act_layers + head + weight_cache + logit_copies)
        # backward starts: log-softmax, its gradient and the logits' gradient, all (N, V) fp32
        moment("backward: start", "backward", activations=act_layers + head,
               other=2 * logits)
    head_grads = ((c.vocab_size * c.hidden * d.stream // tp + c.hidden * d.stream)
                  if last else 0)
    layer_moments = {}
    for i in reversed(range(len(layers))):          # backward visits the last layer first
        moe = layers[i] >= c.dense_layers
        below = sum(saved[:i + 1]) * in_flight + sum(saved[i + 1:]) * (in_flight - 1)
        grads = (sum(p for p, _ in layer_params[i + 1:]) * d.stream // tp + head_grads
                 + _first_grad(c, d, moe, tp))
        transient = _layer_backward_transient(c, d, moe, tp, N) + grad_stream
        # a recomputed unit's layers up to this one are rebuilt, beside what they kept ("other")
        a = unit_start[i]
        rebuilt = sum(full[a:i + 1]) - sum(saved[a:i + 1])
        layer_moments[layers[i]] = dict(grads=grads, activations=below, other=rebuilt + transient)
    if layer_moments:
        worst = max(layer_moments, key=lambda i: sum(layer_moments[i].values()))
        moment(f"backward: layer {worst}", "backward", **layer_moments[worst])
    if first:
        # backward ends in the embedding: every other gradient is done, its own is being formed
        embedding_grad = c.vocab_size * c.hidden * d.stream // tp
        moment("backward: embedding", "backward", grads=grad_bytes - embedding_grad,
               other=embedding_grad + grad_stream)
    # with master weights the step swaps each bf16 gradient for an fp32 copy first
    fp32_grads = n_local * 4 // (dp if zero_stage >= 2 else 1) if d.master else 0
    moment("optimizer step", "optimizer", grads=0 if d.master else grad_bytes,
           other=fp32_grads + _optimizer_temporaries(c, optimizer, impl, n_local, d, shard))
    for m in moments.values():
        m.saved_activations = batch_and_loss + act_layers + head
    peak_name = max(moments, key=lambda k: moments[k].total)
    result = moments[peak_name]
    out = Estimate(**{k: getattr(result, k) for k in (
        "params", "grads", "optimizer", "activations", "other", "peak_phase",
        "saved_activations")})
    out.moments = {k: v.total for k, v in moments.items()}
    out.details = {"peak moment": peak_name, "optimizer implementation": impl,
                   "parameters on this device": n_local, "layers on this device": len(layers)}
    return out


def _param_tensors(c: ModelConfig, layers, first, last) -> int:
    """Number of parameter tensors (each gets an AdamW step counter)."""
    per_attn = (4 if c.attention == "gqa" else
                (5 if c.q_lora_rank else 3) + 2)          # linears + norms inside MLA
    count = 0
    for i in layers:
        moe = i >= c.dense_layers
        mlp = (1 + c.router_bias + 3 * (c.routed_experts + (c.shared_experts > 0))
               if moe else 3)
        count += 2 + per_attn + mlp
    return count + (1 if first else 0) + ((2 if not c.tie_embeddings else 1) if last else 0)


def _first_grad(c: ModelConfig, d: _Dtypes, moe: bool, tp: int) -> int:
    """The gradient autograd accumulates first in a block's backward: the MLP's down projection."""
    width = (max(1, c.shared_experts) * c.moe_ffn if moe else c.ffn) // tp
    return c.hidden * width * d.stream


def _layer_backward_transient(c: ModelConfig, d: _Dtypes, moe: bool, tp: int, N: int) -> int:
    """Gradients of activations alive together inside an MLP's backward.

    SwiGLU: the gradients of silu(gate) and up exist while the product's gradient is held.
    MoE: the tokens' gradient gathered back to expert order, the gate-weight product and the
    experts' output gradient (in fp32 under autocast, then its bf16 copy).
    """
    width = (c.shared_experts * c.moe_ffn if moe else c.ffn) // tp
    swiglu = 2 * N * width * d.compute
    if not moe:
        return swiglu
    routed = N * c.top_k * (c.hidden * (2 * d.stream + (2 if d.mixed else 0)) + 4)
    return max(swiglu, routed)


def _optimizer_temporaries(c, optimizer, impl, n_local, d, shard) -> int:
    """Bytes the optimizer step allocates and frees: AdamW's sqrt(v) / bias-correction."""
    if not optimizer.startswith("adamw") or impl == "fused":
        return 0
    if impl == "foreach":
        return n_local * d.state // shard                                    # sqrt(v) for all at once
    largest = max(c.vocab_size * c.hidden, c.hidden * c.ffn)
    return 2 * largest * d.state                                             # sqrt(v), then / bc2


def kv_cache_bytes(cfg: ModelConfig | str, batch: int = 1, seq: int = 4096,
                   dtype: str = "bf16", tp: int = 1) -> int:
    """Bytes of the inference KV cache: per token and layer 2 * kv_heads * head_dim numbers
    (MHA, GQA, MQA), or for MLA the latent plus the shared RoPE key, kv_lora + rope."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    _check_layout(c, batch, seq, 1, tp, 1, 0, False)
    if c.attention == "mla":
        per_token = c.kv_lora_rank + c.qk_rope_dim                             # not split by tp
    else:
        per_token = 2 * max(1, c.kv_heads // tp) * c.head_dim
    return int(batch * seq * c.layers * per_token * dtype_bytes(dtype))
