"""Lab 07's panel: the attention core's memory by implementation, and the KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as w

from labkit.core.config import ModelConfig, preset, presets
from labkit.core.units import check_choice, check_positive, dtype_bytes, fmt_bytes
from labkit.course.panel_reports import PanelResult, model_config
from labkit.course.plot import new_figure, unit_for
from labkit.course.widgets.base import _render
from labkit.predict import kv_cache_bytes
from labkit.transformer.attention import (ATTENTION_IMPLS, CORE_DTYPE, SRAM_PER_SM, TILE, CoreBytes,
                                          KiB, attention_core_bytes, hbm_ratio,
                                          hbm_ratio_all_l2_hits, hbm_ratio_tiles)
from labkit.transformer.generate import attention_kind, mla_reduction


HBM_GPUS = ("A100", "H100 SXM")  # SRAM_PER_SM's GPUs whose HBM-access ratio the panel prints
SEQ_CURVE = [2 ** k for k in range(9, 16)]            # 512 ... 32768: the attention curve's x
CONTEXT_CURVE = [2 ** k for k in range(10, 18)]       # 1024 ... 131072: the cache curve's x


def mha_cache_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    """The KV cache ``cfg`` would need with multi-head attention: 2 x heads x head_dim numbers
    per token and layer (MLA: DeepSeek-V2's baseline, ``generate.mla_reduction``), in bf16;
    windowed layers (Gemma 3) keep their window, as ``kv_cache_bytes`` counts them."""
    if cfg.attention != "mla":
        return kv_cache_bytes(cfg.replace(kv_heads=cfg.heads), batch, context, CORE_DTYPE)
    per_layer = mla_reduction(cfg).mha_per_layer
    return batch * context * cfg.layers * per_layer * dtype_bytes(CORE_DTYPE)


@dataclass
class AttentionResult(PanelResult):
    """The attention panel's result: one layer's core (``core``, and every implementation's
    in ``by_impl``) and the HBM-access ratio at that sequence; the model's KV cache at
    ``context`` beside what multi-head attention would cache."""

    core: CoreBytes | None = None
    by_impl: dict | None = None          # implementation -> CoreBytes at the same shape
    seq: int = 0
    heads: int = 0
    head_dim: int = 0
    hbm: dict | None = None              # GPU -> the same ratio in labkit's fitted blocks
    hbm_tiles: float = 0.0               # standard / FlashAttention HBM accesses, 128-row tiles
    hbm_l2: float = 0.0                  # the same if every re-read of K and V hits L2
    batch: int = 1
    context: int = 0
    kind: str = ""                       # MHA, GQA, MQA or MLA (generate.attention_kind)
    cache: int = 0                       # labkit.kv_cache_bytes(config, batch, context)
    mha_cache: int = 0

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        c, core = self.config, self.core
        by_impl = ", ".join(f"{impl} {fmt_bytes(r.peak)}" for impl, r in self.by_impl.items())
        hbm = ", ".join(f"{ratio:.1f}x {gpu} ({SRAM_PER_SM[gpu].per_sm // KiB} KiB per SM)"
                        for gpu, ratio in self.hbm.items())
        plural = "s" if c.kv_heads > 1 else ""
        heads = (f"{c.kv_heads} kv head{plural} for {c.heads} query heads"
                 if c.attention == "gqa" else
                 f"latent {c.kv_lora_rank} + RoPE key {c.qk_rope_dim} for {c.heads} heads")
        return "\n".join([
            f"{core.impl} attention core, one layer, batch 1, {CORE_DTYPE}, {self.heads} heads "
            f"x {self.head_dim}, seq {self.seq:,}: keeps {fmt_bytes(core.kept_total)} for the "
            f"backward pass beyond q, k, v ({_named(core.kept)})",
            f"forward + backward peak beyond q, k, v: {fmt_bytes(core.peak)} "
            f"({_named(core.at_peak)})",
            f"peak by implementation at this shape: {by_impl}",
            f"HBM reads and writes of one head's forward, standard attention / FlashAttention "
            f"(a count, no L2): {self.hbm_tiles:.1f}x in {TILE}-row tiles (as real kernels); "
            f"labkit's model of blocks fitted to the on-chip memory {hbm}; if every re-read of K "
            f"and V hit L2: {self.hbm_l2:.1f}x",
            f"KV cache of {c.name} ({self.kind}: {heads}), batch {self.batch}, context "
            f"{self.context:,}, {CORE_DTYPE}: {fmt_bytes(self.cache)}; with MHA "
            f"{fmt_bytes(self.mha_cache)} ({self.mha_cache / self.cache:.1f}x)"])


def _named(terms: dict) -> str:
    return ", ".join(f"{name} {fmt_bytes(n)}" for name, n in terms.items())


def attention_report(impl: str, *, seq: int, heads: int, head_dim: int, model: str,
                     context: int, batch: int = 1, kv_heads: int | None = None) -> AttentionResult:
    """One layer's attention core (``attention_core_bytes``) for each implementation, and the
    KV cache of ``model`` (``kv_heads`` changed, if given) at ``context`` tokens; an impossible
    setting is explained in ``.error``."""
    try:
        by_impl = {name: attention_core_bytes(name, seq, heads, head_dim)
                   for name in ATTENTION_IMPLS}
        check_choice("attention implementation", impl, ATTENTION_IMPLS)
        check_positive("context (tokens in the KV cache)", context)
        check_positive("batch", batch)
        cfg = model_config(model, kv_heads=kv_heads)
        cache = kv_cache_bytes(cfg, batch, context, CORE_DTYPE)
    except ValueError as error:
        return AttentionResult(error=str(error))
    return AttentionResult(
        cfg, core=by_impl[impl], by_impl=by_impl, seq=seq, heads=heads, head_dim=head_dim,
        hbm={gpu: hbm_ratio(seq, head_dim, gpu) for gpu in HBM_GPUS},
        hbm_tiles=hbm_ratio_tiles(seq, head_dim), hbm_l2=hbm_ratio_all_l2_hits(seq, head_dim),
        batch=batch,
        context=context, kind=attention_kind(cfg), cache=cache,
        mha_cache=mha_cache_bytes(cfg, batch, context))


def _attention_figure(result: AttentionResult):
    """Left: each core's peak against seq (log-log: slope 2 is T^2), this one marked; right:
    the KV cache and MHA's against context, this context marked."""
    fig, (left, right) = new_figure(9, 3.4, ncols=2)
    for name in ATTENTION_IMPLS:
        peaks = [attention_core_bytes(name, T, result.heads, result.head_dim).peak / 2**20
                 for T in SEQ_CURVE]
        left.plot(SEQ_CURVE, peaks, marker=".", label=name)
    left.scatter([result.seq], [result.core.peak / 2**20], s=120, facecolor="none",
                 edgecolor="black", linewidth=2, zorder=3, label="this setting")
    left.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="MiB",
             title=f"one layer's core, fwd + bwd peak ({result.heads} heads x {result.head_dim})")
    left.legend(frameon=False, fontsize=8)
    cfg, B = result.config, result.batch
    name, scale = unit_for(max(result.mha_cache, mha_cache_bytes(cfg, B, CONTEXT_CURVE[-1])))
    right.plot(CONTEXT_CURVE, [kv_cache_bytes(cfg, B, n, CORE_DTYPE) / scale
                               for n in CONTEXT_CURVE], marker=".", label=result.kind)
    right.plot(CONTEXT_CURVE, [mha_cache_bytes(cfg, B, n) / scale for n in CONTEXT_CURVE],
               marker=".", linestyle="--", color="#999999", label="MHA")
    right.scatter([result.context], [result.cache / scale], s=120, facecolor="none",
                  edgecolor="black", linewidth=2, zorder=3, label="this context")
    right.set(xlabel="context (tokens)", ylabel=name, ylim=(0, None),
              title=f"KV cache, {cfg.name}, batch {B}")
    right.set_xticks([i * 2**15 for i in range(5)], ["0", "32k", "64k", "96k", "128k"])
    right.legend(frameon=False, fontsize=8)
    return fig


class AttentionPanel:
    """Implementation, seq, heads and head dim -> one layer's attention core: what it keeps
    and its peak, and FlashAttention's HBM-access ratio; model, kv heads, context and batch ->
    the KV cache beside multi-head attention's. Choosing a model loads its heads, head dim
    (MLA: q.k width) and kv heads."""

    def __init__(self, impl: str = "sdpa", seq: int = 4096, model: str = "llama-2-7b",
                 context: int = 4096, batch: int = 1):
        check_choice("attention implementation", impl, ATTENTION_IMPLS)
        cfg = preset(model)
        box = {"layout": w.Layout(width="190px")}
        self.impl = w.Dropdown(options=ATTENTION_IMPLS, value=impl, description="implementation",
                               style={"description_width": "initial"})
        self.seq = w.IntSlider(value=seq, min=512, max=32768, step=512, description="seq")
        self.heads = w.IntSlider(value=cfg.heads, min=1, max=128, description="heads")
        self.head_dim = w.IntSlider(value=cfg.qk_head_dim, min=8, max=256, step=8,
                                    description="head dim")
        self.model = w.Dropdown(options=presets(), value=model, description="model")
        self.kv_heads = w.BoundedIntText(value=cfg.kv_heads, min=1, max=1024,
                                         description="kv heads", **box)
        self.context = w.IntSlider(value=context, min=1024, max=131072, step=1024,
                                   description="context")
        self.batch = w.BoundedIntText(value=batch, min=1, max=1024, description="batch", **box)
        self.output = w.Output()
        self.result: AttentionResult | None = None
        self._syncing = False
        self.model.observe(self._on_model, names="value")
        for control in (self.impl, self.seq, self.heads, self.head_dim, self.kv_heads,
                        self.context, self.batch):
            control.observe(lambda _: self._syncing or self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.impl, self.seq]), w.HBox([self.heads, self.head_dim]),
                              w.HBox([self.model, self.kv_heads]),
                              w.HBox([self.context, self.batch]), self.output])
        self._show_kv_heads(cfg)
        self.update()

    def _show_kv_heads(self, cfg: ModelConfig):
        self.kv_heads.disabled = cfg.attention == "mla"      # MLA caches a latent, no heads

    def _on_model(self, change):
        cfg = preset(change["new"])
        self._syncing = True                     # one update for the model's shape
        self.heads.value, self.head_dim.value = cfg.heads, cfg.qk_head_dim
        self.kv_heads.value = cfg.kv_heads
        self._syncing = False
        self._show_kv_heads(cfg)
        self.update()

    def update(self) -> AttentionResult:
        mla = preset(self.model.value).attention == "mla"
        result = attention_report(self.impl.value, seq=self.seq.value, heads=self.heads.value,
                                  head_dim=self.head_dim.value, model=self.model.value,
                                  context=self.context.value, batch=self.batch.value,
                                  kv_heads=None if mla else self.kv_heads.value)
        self.result = result
        if result.error:
            _render(self.output, result.summary())
        else:
            _render(self.output, result.summary(), _attention_figure(result))
        return result


def attention_panel(**defaults) -> w.VBox:
    """The attention and KV-cache panel of lab 07 (``AttentionPanel`` holds its state and
    callbacks)."""
    return AttentionPanel(**defaults).widget
