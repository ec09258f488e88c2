"""labkit's estimate against Hugging Face models' own training steps, measured on fake tensors.

    python benchmarks/hf_models.py [--quick] [--models llama-2-7b,qwen2-7b] [--layers]

For full-size configs typed from the public config.json files (no download), prints the
ratio estimate / measured of the peak and of each category at the peak, and both peak
phases. The estimate is ``labkit.estimate(from_hf_config(cfg), ...)``; the measurement is
``labkit.measure_step(lambda: AutoModelForCausalLM.from_config(cfg), ...)``: transformers'
own modules (SDPA attention, its RMSNorm, rotary embedding, loss and MoE), one steady-state
step on CPU fake tensors (every ratio below is from them, not from a GPU). Target: within 5%
for the dense models.

``--layers`` explains the differences: for one decoder layer of each model it lists the
tensors the forward pass keeps alive (saved for backward, plus the layer's output), by the
operator and the module that made them, in bytes per token, for transformers' layer and
labkit's. What it finds (transformers 5.24, bytes per token per layer; h hidden, H heads):

- pure bf16: transformers' RMSNorm casts x / rms(x) back to bf16 before the weight
  multiply and keeps it in bf16 (2h per norm); ``F.rms_norm`` keeps it in fp32 (4h).
- bf16-mixed: transformers builds a DynamicCache in training too (``use_cache`` defaults to
  True); it holds each layer's keys after RoPE - fp32 under autocast, because cos/sin take
  the fp32 residual stream's dtype - until the forward pass returns: 4 x kv_heads x head_dim
  more at the end of the forward pass, where the peak then falls.
- Mistral v0.1 at seq >= sliding_window: a (B, 1, T, T) mask, copied to a float mask inside
  SDPA per layer (4T in fp32), and keys and values repeated to every head (the GQA path of
  SDPA is off when a mask is given); labkit's windowed layers do the same (0.991-0.996x its
  peak at 4 x 4096; 0.924-0.948 before they did). On CUDA SDPA converts the mask before it
  picks a backend too, and the memory-efficient one keeps it for backward, padded to its
  alignment when T is not a multiple of 8-16 (PyTorch's source; not run on a GPU here).
- DeepSeek (MLA): v is narrower than q and k and transformers does not pad it, so SDPA on
  CPU runs its math path and keeps the fp32 attention probabilities (4 H T); under autocast
  the routed experts run in fp32 (grouped_mm is not autocast-enabled), with no bf16 weight
  copies; the router keeps an fp32 copy of its input (4h).
- Gemma 3 (gemma-3-1b): its sliding-window layers (window 512) get the same mask copy (2T
  bytes per token in bf16, 4T in fp32: 8-16 KiB at T = 4096); its one kv head is repeated as
  a view (no bytes). As labkit's windowed layers: 0.998-1.003x its peak at 4 x 4096 (0.960-0.977
  without them). Its RMSNorms keep x / rms(x) in fp32 for the product with 1 + weight, as
  labkit's Gemma-style norm does (``norm_style="gemma"``).
- Gemma 2 (gemma-2-9b; transformers 5.25): transformers runs it eagerly (SDPA cannot soft-cap
  the scores), so the estimate uses labkit's naive core, which keeps what eager attention
  keeps: the fp32 softmax and its bf16 copy, the tanh of the soft-capped scores (8 bytes per
  pair and head in 16-bit, 12 in fp32) and of the logits: 1.000-1.001x on --quick.
- Phi-3 (phi-3-mini; transformers 5.25): its attention splits the fused qkv projection and keeps
  a concatenation and a clone around RoPE (24,576 bytes per token and layer in bf16), which
  labkit's separate q, k, v projections do not: 0.977x its peak at 4 x 4096 in bf16-master.
- MoE (Mixtral, Qwen3-MoE; transformers 5.25): labkit's MoE keeps each token's gate-weighted
  expert outputs (top_k x h in the compute dtype), which transformers sums without keeping:
  65,536 B/token/layer at Qwen3-30B-A3B's top-8 in fp32, 16% of its layer, so 1.07x its peak
  at 4 x 4096; 32,768 at Mixtral's top-2, 1.00-1.02x.
"""
from __future__ import annotations

import argparse
import contextlib
import time
import weakref
from collections import defaultdict

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import labkit as lk

import transformers
from transformers import (AutoModelForCausalLM, DeepseekV2Config, Gemma2Config, Gemma3TextConfig,
                          LlamaConfig,
                          MistralConfig, MixtralConfig, Olmo2Config, Phi3Config, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)
import transformers.integrations.moe as hf_moe

transformers.logging.set_verbosity_error()

# ---- the models: facts from their public config.json ----------------------------------------
MODELS = {
    "llama-2-7b": lambda: LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
        rms_norm_eps=1e-5),
    "mistral-7b": lambda: MistralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
        sliding_window=4096, rms_norm_eps=1e-5),
    "qwen2-7b": lambda: Qwen2Config(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
        tie_word_embeddings=False),
    "deepseek-v2-lite": lambda: DeepseekV2Config(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, vocab_size=102400, max_position_embeddings=163840,
        topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40,
                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # the configs.json of Qwen/Qwen3-8B, microsoft/Phi-3-mini-4k-instruct,
    # mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B
    "qwen3-8b": lambda: Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
        tie_word_embeddings=False),
    "phi-3-mini": lambda: Phi3Config(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "gemma-3-1b": lambda: Gemma3TextConfig(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
        sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
        tie_word_embeddings=True),
    # google/gemma-2-9b's config.json: soft-capped scores (50) and logits (30)
    "gemma-2-9b": lambda: Gemma2Config(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "olmo-2-7b": lambda: Olmo2Config(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False),
    "mixtral-8x7b": lambda: MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-5, sliding_window=None),
    "qwen3-30b-a3b": lambda: Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
        tie_word_embeddings=False),
}
DENSE = ("llama-2-7b", "mistral-7b", "qwen2-7b", "qwen3-8b", "phi-3-mini", "gemma-3-1b",
         "gemma-2-9b", "olmo-2-7b")
PRECISIONS = ("fp32", "bf16", "bf16-mixed", "bf16-master")
IMPLS = ("for-loop", "foreach")
SHAPES = [(b, t) for b in (1, 4, 8) for t in (512, 4096)]
QUICK = [("for-loop", 1, 512), ("foreach", 4, 4096)]


@contextlib.contextmanager
def grouped_mm_only_for_bf16():
    """torch's shape function (meta kernel) for ``_grouped_mm`` accepts bf16 only, so
    transformers' default MoE path fails on fake fp32 weights. Route fp32 weights through
    transformers' own fallback op (``transformers::grouped_mm_fallback``, what it runs on CPU
    with torch <= 2.10): it saves the same input and weight for backward."""
    original = hf_moe._can_use_grouped_mm
    hf_moe._can_use_grouped_mm = (lambda x, w, offs:
                                  w.dtype == torch.bfloat16 and original(x, w, offs))
    try:
        yield
    finally:
        hf_moe._can_use_grouped_mm = original


def attention(config) -> tuple[str, str]:
    """(transformers' attention, labkit's core): SDPA's fused kernel, but for Gemma 2, which
    transformers runs eagerly (SDPA cannot soft-cap): labkit's naive core keeps what that keeps."""
    return ("eager", "naive") if config.model_type == "gemma2" else ("sdpa", "sdpa")


def build(config):
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention(config)[0])


# ---- estimate / measured -------------------------------------------------------------------
CATEGORIES = [k for k in lk.Breakdown().as_dict()
              if k not in ("total", "peak_phase", "saved_activations")]


def ratio(estimated: int, measured: int, peak: int) -> str:
    """estimate / measured; a category under 1% of the peak on both sides shows as ~0, and
    one that only the estimate has shows its bytes (GiB)."""
    if max(estimated, measured) < 0.01 * peak:
        return "     ~0"
    if measured < 0.01 * peak:
        return f"{'+%.1fG' % (estimated / 2**30):>7}"
    return f"{estimated / measured:7.3f}"


def compare(name: str, precision: str, impl: str, B: int, T: int) -> tuple[str, float]:
    config = MODELS[name]()
    est = lk.estimate(lk.from_hf_config(config), batch=B, seq=T, precision=precision,
                      optimizer_impl=impl, device="cpu", attention=attention(config)[1])
    start = time.perf_counter()
    m = lk.measure_step(lambda: build(config), batch=B, seq=T, precision=precision,
                        optimizer_impl=impl, fake=True)
    seconds = time.perf_counter() - start
    cells = [ratio(getattr(est, c), getattr(m, c), m.total) for c in CATEGORIES]
    row = (f"{name:<17}{precision:<11}{impl:<9}{B:>2} x {T:<5}{m.total / 2**30:9.2f}"
           f"{est.total / 2**30:9.2f}{ratio(est.total, m.total, m.total)} |" + "".join(cells)
           + f" | {m.peak_phase:<9} {est.peak_phase:<9}{seconds:6.1f}")
    return row, est.total / m.total


def table(models, quick: bool) -> list[tuple[str, str, str, int, int, float]]:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; fake tensors; "
          f"peak and categories as estimate / measured")
    header = (f"{'model':<17}{'precision':<11}{'AdamW':<9}{'B x T':<10}{'meas GiB':>9}"
              f"{'est GiB':>9}{'peak':>7} |" + "".join(f"{c[:6]:>7}" for c in CATEGORIES)
              + f" | {'phase m':<9} {'phase e':<9}{'sec':>6}")
    print(header)
    print("-" * len(header))
    misses = []
    for name in models:
        points = QUICK if quick else [(impl, B, T) for impl in IMPLS for B, T in SHAPES]
        for precision in PRECISIONS:
            for impl, B, T in points:
                row, r = compare(name, precision, impl, B, T)
                print(row, flush=True)
                if abs(r - 1) > 0.05:
                    misses.append((name, precision, impl, B, T, r))
    return misses


# ---- what one decoder layer keeps, by operator ---------------------------------------------------
class KeptByOp(TorchDispatchMode):
    """Each new storage made inside ``layer``'s forward, with the operator and the innermost
    module that made it; ``alive()`` sums those still alive (saved for backward, or the
    output) by (operator, dtype). Weights and the layer's input existed before: not new.
    A cast of a weight (autocast's bf16 copy) is told apart: it is per layer, not per token."""

    def __init__(self, model, layer):
        super().__init__()
        self.stack, self.first = [], {}      # storage id -> (weak ref, bytes, key, module)
        self.weights = {p.untyped_storage()._cdata for p in model.parameters()}
        for t in list(model.parameters()) + list(model.buffers()):
            self._note(t, None, None)
        self.hooks = []
        for name, m in layer.named_modules():
            self.hooks.append(m.register_forward_pre_hook(
                lambda *a, name=name: self.stack.append(name or "(layer)")))
            self.hooks.append(m.register_forward_hook(lambda *a: self.stack.pop() and None))

    def _note(self, t, key, module):
        s = t.untyped_storage()
        known = self.first.get(s._cdata)
        if known is None or known[0]() is None:
            self.first[s._cdata] = (weakref.ref(s), s.nbytes(), key, module)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.__name__.split(".")[0]
        if (op == "_to_copy" and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage()._cdata in self.weights):
            op = "_to_copy of a weight"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                dtype = str(t.dtype).replace("torch.", "")
                self._note(t, (op, dtype) if self.stack else None,
                           self.stack[-1] if self.stack else None)
        return out

    def alive(self) -> dict:
        """{(op, dtype): (bytes, modules that made them)} of the layer's tensors still alive."""
        kept = defaultdict(lambda: [0, set()])
        for ref, nbytes, key, module in self.first.values():
            if key is not None and ref() is not None:
                kept[key][0] += nbytes
                kept[key][1].add(module)
        for h in self.hooks:
            h.remove()
        return kept


def kept(model, layer, tokens, precision, call) -> dict:
    """What ``layer``'s forward leaves alive once the forward pass (loss included) is done."""
    dtype = {"bf16-mixed": torch.bfloat16}.get(precision)
    mode = KeptByOp(model, layer)
    with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext(), mode:
        loss = call(model, tokens)
        result = mode.alive()
    del loss
    return result


def layers_report(models, B: int = 1, T: int = 4096):
    from labkit.predict.layers import layer_saved  # the estimate's per-layer terms
    from labkit.training.train import param_dtype
    N = B * T
    for name in models:
        config = MODELS[name]()
        cfg = lk.from_hf_config(config)
        index = cfg.dense_layers if cfg.is_moe else 0       # an MoE layer when there is one
        for precision in PRECISIONS:
            previous = torch.get_default_dtype()
            with FakeTensorMode():
                torch.set_default_dtype(param_dtype(precision))
                try:
                    hf = build(config)
                    ours = lk.build_model(cfg.replace(layers=index + 1), param_dtype(precision))
                finally:
                    torch.set_default_dtype(previous)
                tokens = torch.randint(0, cfg.vocab_size, (B, T))
                theirs = kept(hf, hf.model.layers[index], tokens, precision,
                              lambda m, x: m(input_ids=x, labels=x).loss)
                mine = kept(ours, ours.blocks[index], tokens, precision, lambda m, x: m(x, x))
            predicted = layer_saved(cfg, precision, moe=cfg.is_moe, layer=index)

            def split(d):     # (bytes per token, weight copies in MiB)
                copies = sum(v[0] for k, v in d.items() if k[0] == "_to_copy of a weight")
                return (sum(v[0] for v in d.values()) - copies) / N, copies / 2**20

            print(f"\n{name}, {precision}, layer {index} (B={B}, T={T}): kept after the forward "
                  f"pass, bytes per token (weight copies: MiB per layer)")
            for who, (per_token, copies) in (("transformers", split(theirs)),
                                             ("labkit model", split(mine)),
                                             ("labkit estimate", (
                                                 predicted.bytes(B, T, "activations") / N,
                                                 predicted.bytes(B, T, "weight_cache") / 2**20))):
                print(f"  {who:<18}{per_token:10.1f} /token {copies:8.1f} MiB")
            rows = []
            for key in set(theirs) | set(mine):
                (a, ma), (b, mb) = theirs.get(key, (0, set())), mine.get(key, (0, set()))
                if key[0] != "_to_copy of a weight" and abs(a - b) >= N:
                    rows.append((key, a / N, b / N, ma, mb))
            for (op, dtype), a, b, ma, mb in sorted(rows, key=lambda r: -abs(r[1] - r[2])):
                where = lambda modules: ", ".join(sorted(modules)) or "-"      # noqa: E731
                print(f"    {op + ' ' + dtype:<38}{a - b:+10.1f} /token  (transformers {a:9.1f} "
                      f"in {where(ma)}; labkit {b:9.1f} in {where(mb)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="two points per precision: 1 x 512 for-loop, 4 x 4096 foreach")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, among {', '.join(MODELS)}")
    parser.add_argument("--layers", action="store_true",
                        help="list what one decoder layer keeps, transformers vs labkit")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose among {', '.join(MODELS)}")
    with grouped_mm_only_for_bf16():
        if args.layers:
            layers_report(models)
            return
        misses = table(models, args.quick)
    dense = [m for m in misses if m[0] in DENSE]
    print(f"\ncells outside 5%: {len(misses)} ({len(dense)} of them dense models)")
    for name, precision, impl, B, T, r in misses:
        print(f"  {name} {precision} {impl} {B} x {T}: {r:.3f}")


if __name__ == "__main__":
    main()
