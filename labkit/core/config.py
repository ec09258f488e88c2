"""Model configurations: one dataclass for dense, GQA, MLA and MoE transformers, and presets.

The presets are JSON files in ``data/models/`` holding facts from the public model configs
(LLaMA-2, Mistral, DeepSeekMoE, DeepSeek-V2/V3) plus the course's CPU-sized models.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

ATTENTION_KINDS = ("gqa", "mla")
NORM_PLACEMENTS = ("pre", "sandwich", "post")
NORM_STYLES = ("llama", "gemma", "olmo")
QK_NORM_WIDTHS = ("head", "all")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer. Sizes are element counts; no biases but Qwen2's
    on q, k and v (``qkv_bias``); Qwen3 normalises each head's q and k (``qk_norm``); Gemma
    normalises each sub-layer's output as well as its input (``norms="sandwich"``), gates its
    MLP with tanh-approximated GELU and scales the embedding by sqrt(hidden); OLMo 2 normalises
    only the outputs (``norms="post"``), and its q and k over all heads at once.

    Dense models leave the MoE fields at 0; DeepSeek models use MLA attention
    (``attention="mla"``) and an MoE block in every layer after the first ``dense_layers``.
    """

    name: str = "custom"
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 0            # 0: same as heads (multi-head); 1: multi-query
    head_dim: int = 0            # 0: hidden // heads
    ffn: int = 704               # SwiGLU width of the dense MLP
    vocab_size: int = 4096
    max_seq: int = 4096          # longest sequence the RoPE tables cover
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    qkv_bias: bool = False       # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False        # an RMSNorm of each head's q and k before RoPE (Qwen3)
    qk_norm_width: str = "head"  # "all": OLMo 2 normalises the whole q and k projections
    norms: str = "pre"           # "sandwich": sub-layer outputs normalised too (Gemma 2/3);
                                 # "post": only the outputs (OLMo 2)
    activation: str = "silu"     # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    embed_scale: bool = False    # the embedding's output times sqrt(hidden) (Gemma)
    # sliding-window attention (Mistral, Gemma 2/3, OLMo 3): layers attend to the last
    # ``sliding_window`` tokens only, but for every ``global_every``-th layer (0: none), which
    # attends to all (``model.attention_core``; ``kv_cache_bytes`` counts what a windowed cache
    # keeps)
    sliding_window: int = 0
    global_every: int = 0
    # soft-capping (Gemma 2): x -> cap * tanh(x / cap) on each layer's attention scores before
    # the softmax, and on the logits (0: none)
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    norm_style: str = "llama"    # "gemma": RMSNorms scale by (1 + weight) in fp32, then cast;
                                 # "olmo": by the weight in fp32, then cast
    # MLA (DeepSeek-V2/V3): low-rank queries, one compressed latent for keys and values
    attention: str = "gqa"
    q_lora_rank: int = 0         # 0: queries projected straight from hidden
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # MoE (DeepSeekMoE): shared experts always on, top_k of routed_experts per token
    dense_layers: int = -1       # -1: every layer is dense
    moe_ffn: int = 0
    routed_experts: int = 0
    shared_experts: int = 0
    top_k: int = 0
    router_bias: bool = False    # DeepSeek-V3's selection bias
    # documentation only
    published: str = ""
    family: str = ""

    def __post_init__(self):
        # Fill the derived defaults so every consumer reads one resolved value, and remember
        # which were derived, so that ``replace`` derives them again from the new sizes.
        # A value equal to its derivation counts as derived: multi-head attention stays
        # multi-head when heads change.
        derived = []
        if self.kv_heads in (0, self.heads):
            object.__setattr__(self, "kv_heads", self.heads)
            derived.append("kv_heads")
        if self.routed_experts == 0 or self.dense_layers < 0:
            object.__setattr__(self, "dense_layers", self.layers if self.routed_experts == 0 else 0)
            derived.append("dense_layers")
        if self.attention == "gqa" and self.heads > 0 and self.hidden % self.heads == 0 \
                and self.head_dim in (0, self.hidden // self.heads):
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
            derived.append("head_dim")
        object.__setattr__(self, "_derived", tuple(derived))
        validate(self)

    # ---- derived sizes -------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.routed_experts > 0

    @property
    def pre_norms(self) -> bool:
        """Whether each sub-layer's input is normalised (all but OLMo 2's post-norm blocks)."""
        return self.norms != "post"

    @property
    def post_norms(self) -> bool:
        """Whether each sub-layer's output is normalised before the residual add."""
        return self.norms != "pre"

    def window_of(self, layer: int) -> int:
        """Layer ``layer``'s sliding window in tokens (0: it attends to every earlier token)."""
        return self.sliding_window if self.global_every == 0 or (
            layer + 1) % self.global_every else 0

    @property
    def windowed_layers(self) -> int:
        """Layers that attend to the last ``sliding_window`` tokens only."""
        return sum(1 for layer in range(self.layers) if self.window_of(layer))

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys (MLA: the no-RoPE part plus the RoPE part)."""
        return self.qk_nope_dim + self.qk_rope_dim if self.attention == "mla" else self.head_dim

    @property
    def v_dim(self) -> int:
        """Per-head width of values."""
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of each query/key head."""
        return self.qk_rope_dim if self.attention == "mla" else self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed, validated again; sizes that were derived (head_dim
        from hidden / heads, kv_heads from heads, dense_layers) are derived again."""
        unset = {"kv_heads": 0, "head_dim": 0, "dense_layers": -1}
        again = {name: unset[name] for name in self._derived if name not in changes}
        return dataclasses.replace(self, **again, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _positive(cfg: ModelConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}; "
                             f"set {name}= to a size of at least 1")


def validate(cfg: ModelConfig) -> None:
    """Raise ValueError, naming the fix, if the configuration cannot be built."""
    _positive(cfg, "hidden", "layers", "heads", "kv_heads", "ffn", "vocab_size", "max_seq")
    if cfg.attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {cfg.attention!r}; use one of {ATTENTION_KINDS}")
    if cfg.norms not in NORM_PLACEMENTS:
        raise ValueError(f"unknown norms {cfg.norms!r}; use one of {NORM_PLACEMENTS}")
    if cfg.qk_norm_width not in QK_NORM_WIDTHS:
        raise ValueError(f"unknown qk_norm_width {cfg.qk_norm_width!r}; use one of "
                         f"{QK_NORM_WIDTHS}")
    if cfg.norm_style not in NORM_STYLES:
        raise ValueError(f"unknown norm_style {cfg.norm_style!r}; use one of {NORM_STYLES}")
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {cfg.activation!r}; use one of {ACTIVATIONS}")
    if cfg.activation != "silu" and cfg.routed_experts:
        raise ValueError(f"activation={cfg.activation!r}: labkit's routed experts are SwiGLUs; "
                         f"use activation='silu' with routed_experts > 0")
    if cfg.attention == "gqa":
        if cfg.hidden % cfg.heads:
            raise ValueError(f"heads={cfg.heads} does not divide hidden={cfg.hidden}; "
                             f"choose heads among the divisors of {cfg.hidden} "
                             f"or set head_dim explicitly")
        _positive(cfg, "head_dim")
        if cfg.head_dim % 2:
            raise ValueError(f"head_dim={cfg.head_dim} must be even for RoPE")
        if cfg.heads % cfg.kv_heads:
            raise ValueError(f"kv_heads={cfg.kv_heads} does not divide heads={cfg.heads}; "
                             f"each key/value head must serve the same number of query heads")
    else:
        if cfg.qk_norm:
            raise ValueError("qk_norm is for grouped-query attention (Qwen3); MLA normalises its "
                             "latents instead: set qk_norm=False")
        _positive(cfg, "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim")
        if cfg.q_lora_rank < 0:
            raise ValueError(f"q_lora_rank must be 0 (no query compression) or positive, "
                             f"got {cfg.q_lora_rank}")
        if cfg.qk_rope_dim % 2:
            raise ValueError(f"qk_rope_dim={cfg.qk_rope_dim} must be even for RoPE")
        if cfg.v_head_dim > cfg.qk_head_dim:
            raise ValueError("v_head_dim must not exceed qk_nope_dim + qk_rope_dim "
                             "(values are padded to the query width for the fused kernel)")
    if cfg.is_moe:
        _positive(cfg, "moe_ffn", "top_k", "routed_experts")
        if cfg.shared_experts < 0:
            raise ValueError(f"shared_experts must be 0 or more, got {cfg.shared_experts}")
        if cfg.top_k > cfg.routed_experts:
            raise ValueError(f"top_k={cfg.top_k} is larger than routed_experts="
                             f"{cfg.routed_experts}; a token cannot pick more experts than exist")
        if not 0 <= cfg.dense_layers <= cfg.layers:
            raise ValueError(f"dense_layers={cfg.dense_layers} must be between 0 and "
                             f"layers={cfg.layers}")
    elif cfg.top_k or cfg.shared_experts or cfg.moe_ffn:
        raise ValueError("top_k, shared_experts and moe_ffn need routed_experts > 0")
    _validate_attention_span(cfg)


def _validate_attention_span(cfg: ModelConfig) -> None:
    """Sliding windows and soft-capping: numbers >= 0, windows only where layers use them."""
    for name in ("sliding_window", "global_every"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0: none), got {value!r}")
    for name in ("attn_softcap", "logit_softcap"):
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a number >= 0 (0: no soft-capping), got {value!r}")
    for name in ("attn_softcap", "sliding_window"):
        if getattr(cfg, name) and cfg.attention == "mla":
            raise ValueError(f"{name} applies to grouped-query attention (Gemma 2, Mistral); "
                             f"labkit's MLA has none: set {name}=0")
    if cfg.global_every and not cfg.sliding_window:
        raise ValueError(f"global_every={cfg.global_every} says which layers attend beyond a "
                         "sliding window: set sliding_window (tokens) too, or global_every=0")


# ---- presets -----------------------------------------------------------------------
def _preset_folder():
    """The installed package data, or ``data/models`` beside a source checkout of ``labkit``
    (where ``labkit.preset_data`` exists only once the project is installed)."""
    try:
        return resources.files("labkit.preset_data")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "data" / "models"


def _preset_files() -> dict:
    return {f.name[:-5]: f for f in _preset_folder().iterdir() if f.name.endswith(".json")}


def presets() -> list[str]:
    """Names of the model presets, sorted."""
    return sorted(_preset_files())


def preset(name: str, **changes) -> ModelConfig:
    """The preset called ``name``, with optional field ``changes`` (``preset("small", layers=8)``)."""
    files = _preset_files()
    if name not in files:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(files))}")
    fields = json.loads(files[name].read_text())
    unknown = set(changes) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {sorted(unknown)}")
    return ModelConfig(**{**fields, **changes})
