"""What a block holds at the peak of its naive attention core's backward pass (the softmax's
backward), for the estimate's moment of that backward (``moments``)."""
from __future__ import annotations

from dataclasses import replace

from labkit.core.config import ModelConfig
from labkit.predict.layers import (SOFT_CAPPED_SCORES, Dtypes, Saved, Term, _attention_saved,
                                   _norm, attention_weights)


def naive_backward_alive(c: ModelConfig, precision: str, tp: int = 1, sp: bool = False) -> Saved:
    """What a block holds when its naive attention core's backward peaks, in the softmax's
    backward: the attention norm and the projections' input, q and the repeated k, the
    gradient of the repeated v (v itself freed), the fp32 probabilities (their bf16 copy freed)
    and their two gradients dP and dS (B, H, T, T) in fp32. The MLP's
    saved tensors and the attention output are freed by then."""
    d, split = Dtypes.of(precision), (tp if sp else 1)
    H = c.heads // tp
    width = c.head_dim if c.attention == "gqa" else c.qk_head_dim
    softmax = 4                                            # bytes of P, dP, dS: fp32 softmax
    terms = [Term("attention RMSNorm", "fp32" if d.stream == 4 else "fp32 + bf16",
                  _norm(c, c.hidden, d.stream) / split)] if c.pre_norms else []
    for t in _attention_saved(c, d, tp, split, "naive"):
        if t.per_pair and t.name != SOFT_CAPPED_SCORES:      # the tanh's output: kept as it is
            terms += [replace(t, per_pair=H * softmax),
                      Term("gradients of the probabilities and scores (dP, dS)",
                           "fp32", per_pair=2 * H * softmax,
                           category="other")]
        elif t.name.startswith("q, "):          # v and wo's input freed, v's gradient formed
            terms.append(Term("q, k (repeated) and the gradient of v", d.name,
                              3 * H * width * d.compute))
        elif not t.name.startswith("un-padded"):
            terms.append(t)
    if d.mixed:
        copies = 2 * sum(w.local(tp) for w in attention_weights(c) if w.matmul and
                         w.name != "attn.wo")
        terms.append(Term("bf16 copies of the q, k, v projections (autocast)", "bf16",
                          per_layer=copies, category="weight_cache"))
    return Saved(terms)
