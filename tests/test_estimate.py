"""The closed-form estimate reproduces the measured peak of a real (or fake) training step."""
import pytest

import labkit as lk
from labkit.predict.layers import head_saved

GRID = [(precision, recompute, seq) for precision in ("fp32", "bf16-mixed")
        for recompute in ("none", "full") for seq in (512, 2048)]


def _within(name, precision, recompute, seq, fake, tolerance=0.03, batch=1):
    m = lk.measure_step(name, batch=batch, seq=seq, precision=precision, recompute=recompute,
                        fake=fake)
    e = lk.estimate(name, batch=batch, seq=seq, precision=precision, recompute=recompute,
                    device=m.device)
    assert e.total == pytest.approx(m.total, rel=tolerance), (e.moments, m.as_dict())
    assert e.saved_activations == pytest.approx(m.saved_activations, rel=tolerance)
    assert e.peak_phase == m.peak_phase


@pytest.mark.parametrize("precision, recompute, seq", GRID)
@pytest.mark.parametrize("name", ["tiny", "small", "tiny-moe"])
def test_estimate_within_3_percent_of_a_real_cpu_step(name, precision, recompute, seq):
    _within(name, precision, recompute, seq, fake=False)


# Qwen3's shape: an RMSNorm of each head's q and k, heads wider than hidden / heads
QK_NORM = lk.ModelConfig(name="qk-norm", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=96,
                         ffn=768, vocab_size=512, max_seq=1024, qk_norm=True)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed", "bf16-master"])
def test_estimate_follows_the_q_and_k_norms_on_a_real_cpu_step(precision, recompute):
    # measured: saved activations equal to the loss's 4 bytes, totals 0.98-1.01 (as without
    # the norms: their backward's transients are under the MLP's at ffn = 3 x hidden)
    _within(QK_NORM, precision, recompute, 512, fake=False)


# Gemma 3's shape: a norm after each sub-layer too, GeGLU, q and k norms, a scaled tied embedding
GEMMA = QK_NORM.replace(name="gemma-shape", norms="sandwich", norm_style="gemma",
                        activation="gelu_tanh", embed_scale=True, tie_embeddings=True)


@pytest.mark.parametrize("batch, recompute", [(1, "none"), (1, "selective"), (1, "full"),
                                             (4, "full")])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed", "bf16-master"])
def test_estimate_follows_gemmas_sandwich_norms_on_a_real_cpu_step(precision, batch, recompute):
    # measured: totals 0.9855-1.0002; saved activations 0.9996-1.0000 (each Gemma norm's
    # 1 + weight vector, a few KiB a layer, is not counted). With recompute the peak is in the
    # MLP output norm's backward (the rebuilt layer and four fp32 temporaries) or at w_down's
    # gradient, that norm's tensors freed
    _within(GEMMA, precision, recompute, 512, fake=False, batch=batch)


# Gemma 2's shape: Gemma 3's without q and k norms, its attention scores and logits soft-capped
GEMMA2 = GEMMA.replace(name="gemma2-shape", qk_norm=False, attn_softcap=50.0, logit_softcap=30.0)


@pytest.mark.parametrize("attention, recompute", [("naive", "none"), ("naive", "full"),
                                                  ("sdpa", "none")])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed", "bf16-master"])
def test_estimate_follows_gemma2s_soft_capping_on_a_real_cpu_step(precision, attention, recompute):
    # naive (transformers' eager) keeps each layer's (T, T) tanh output and the head its
    # (tokens, vocab) one; "sdpa" soft-caps in the tiled core's tiles, keeping only the head's.
    # measured: totals 0.990-1.000, saved activations 0.9996-0.9998
    m = lk.measure_step(GEMMA2, seq=512, precision=precision, recompute=recompute, fake=False,
                        attention=attention)
    e = lk.estimate(GEMMA2, seq=512, precision=precision, recompute=recompute, device=m.device,
                    attention=attention)
    assert e.total == pytest.approx(m.total, rel=0.02), (e.moments, m.as_dict())
    assert e.saved_activations == pytest.approx(m.saved_activations, rel=0.001)
    assert e.peak_phase == m.peak_phase
    # and the caps are what it counts: without them it is short by exactly the tanh outputs
    plain = lk.estimate(GEMMA2.replace(attn_softcap=0.0, logit_softcap=0.0), seq=512,
                        precision=precision, recompute=recompute, attention=attention)
    per = 4 if precision == "fp32" else 2
    layers = GEMMA2.layers * GEMMA2.heads * 512 * 512 * per if recompute == "none" else 0
    assert e.saved_activations - plain.saved_activations == (
        (layers if attention == "naive" else 0) + 512 * GEMMA2.vocab_size * per)


# OLMo 2's shape: a norm after each sub-layer only, OLMo-style norms, q and k over all heads
OLMO = QK_NORM.replace(name="olmo-shape", norms="post", norm_style="olmo", qk_norm_width="all")


@pytest.mark.parametrize("batch, recompute", [(1, "none"), (1, "selective"), (1, "full"),
                                             (4, "full")])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed", "bf16-master"])
def test_estimate_follows_olmos_post_norms_on_a_real_cpu_step(precision, batch, recompute):
    # measured: saved activations equal; totals 0.9997-1.0003 (under autocast a recomputed
    # unit's fp32 input is not what its linears keep: their bf16 copies)
    _within(OLMO, precision, recompute, 512, fake=False, batch=batch)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-8bit"])
def test_a_tied_weights_gradient_is_made_three_times_over_in_the_embeddings_backward(optimizer):
    # the LM head's share waits in autograd's buffer, the embedding's is made, then their sum:
    # three (V, h) tensors, the peak when the optimizer holds little (it was 0.773 and 0.830 of
    # gemma-3-1b's whole fp32 step with the one being formed counted alone). Two of its 26
    # blocks: its 262,144 x 1,152 embedding is then a larger share (whole model: 1.0002 both
    # ways, 4-6 s a case on one core; two blocks: 1.0004, 0.1-0.7 s)
    cfg = lk.preset("gemma-3-1b", layers=2)
    m = lk.measure_step(cfg, seq=512, precision="fp32", optimizer=optimizer, fake=True)
    e = lk.estimate(cfg, seq=512, precision="fp32", optimizer=optimizer, device=m.device)
    assert m.peak_phase == e.peak_phase == "backward"
    assert e.total == pytest.approx(m.total, rel=0.001)              # measured: 1.0004


def test_a_tied_embeddings_gradient_counts_from_the_lm_heads_backward():
    # the LM head's backward makes the tied weight's whole gradient: the final norm's moment
    # left it out (326,648 bytes short of this step, where that moment is the peak)
    cfg = lk.preset("small", tie_embeddings=True)
    m = lk.measure_step(cfg, seq=256, precision="fp32", loss_chunk=64, fake=False)
    e = lk.estimate(cfg, seq=256, precision="fp32", loss_chunk=64, device=m.device)
    assert m.peak_phase == e.peak_phase == "backward"
    assert 0 <= m.total - e.total <= 4                  # the loss, 4 bytes, is not counted


@pytest.mark.parametrize("precision, recompute, seq", GRID)
def test_estimate_within_3_percent_of_llama_2_7b_on_fake_tensors(precision, recompute, seq):
    # 4 of its 32 identical blocks at full width: the estimate adds a block's bytes per block, so
    # the whole model teaches nothing more (estimate / measured: 1.0000 at 4 and 32 blocks, each
    # checked case); the slow run checks whole 7B models (mistral-7b below)
    _within(lk.preset("llama-2-7b", layers=4), precision, recompute, seq, fake=True)


# The MoE models with every kind of layer they have but fewer of each: DeepSeek-V2-Lite's dense
# layer and 2 of its 26 MoE layers, DeepSeek-V3's 3 dense layers and 2 of its 58 MoE layers
# (the whole of V3 took 10-21 s a case; at 5 layers estimate / measured is 1.0000 in every case).
# Mistral-7B (GQA, 14336-wide MLP): whole in the two cases at 2048 tokens that differ most
# (fp32 keeping everything, autocast with full recompute), 4 of its 32 blocks in the others.
LAYERS = {"mistral-7b": 4, "deepseek-v2-lite": 3, "deepseek-v3": 5}
WHOLE = {("mistral-7b", "fp32", "none", 2048), ("mistral-7b", "bf16-mixed", "full", 2048)}


@pytest.mark.slow
@pytest.mark.parametrize("precision, recompute, seq", GRID)
@pytest.mark.parametrize("name", list(LAYERS))
def test_estimate_within_3_percent_of_larger_models_on_fake_tensors(name, precision, recompute, seq):
    whole = (name, precision, recompute, seq) in WHOLE
    cfg = lk.preset(name) if whole else lk.preset(name, layers=LAYERS[name])
    _within(cfg, precision, recompute, seq, fake=True)


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_estimate_models_each_adamw_implementation(impl):
    # a short sequence, so that the optimizer step's temporaries decide the peak
    m = lk.measure_step("small", seq=64, precision="fp32", fake=False, optimizer_impl=impl)
    e = lk.estimate("small", seq=64, precision="fp32", optimizer_impl=impl)
    assert m.peak_phase == e.peak_phase == ("backward" if impl == "fused" else "optimizer")
    assert e.total == pytest.approx(m.total, rel=0.01)


def test_foreach_adamw_costs_a_copy_of_the_weights_at_the_peak():
    loop = lk.estimate("llama-2-7b", seq=512, precision="fp32", optimizer_impl="for-loop")
    foreach = lk.estimate("llama-2-7b", seq=512, precision="fp32", optimizer_impl="foreach")
    per_param = (foreach.total - loop.total) / lk.count_params("llama-2-7b").total
    assert 3.5 < per_param < 4.0        # ~4 bytes: sqrt(v) for all parameters at once


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum"])
def test_estimate_matches_sgd_steps(optimizer):
    m = lk.measure_step("small", seq=256, precision="fp32", optimizer=optimizer, fake=False)
    e = lk.estimate("small", seq=256, precision="fp32", optimizer=optimizer)
    assert e.total == pytest.approx(m.total, rel=0.03)


def test_pure_bf16_halves_the_model_states():
    fp32 = lk.estimate("llama-2-7b", precision="fp32").details["model states"]
    bf16 = lk.estimate("llama-2-7b", precision="bf16").details["model states"]
    counters = 4 * 291                    # AdamW's fp32 step count per tensor does not halve
    assert bf16["params"] * 2 == fp32["params"] and bf16["grads"] * 2 == fp32["grads"]
    assert (bf16["optimizer"] - counters) * 2 == fp32["optimizer"] - counters


def test_zero1_with_master_weights_steps_on_fp32_gradient_shards():
    """ZeRO-1 reduce-scatters its whole bf16 bucket before the step (that moment is listed),
    then drops it, as DeepSpeed does: AdamW sees only this rank's fp32 gradient shard."""
    n = lk.count_params("llama-2-7b").total
    est = lk.estimate("llama-2-7b", precision="bf16-master", zero_stage=1, dp=64)
    assert "optimizer step: reduce-scatter" in est.moments
    shard = -(-n // 64)
    # before: the bucket (bf16, padded) and the bf16 shard reduced into; at the step: the fp32
    # gradient shard and foreach AdamW's fp32 temporaries over it
    assert (est.moments["optimizer step: reduce-scatter"] - est.moments["optimizer step"]
            == (2 * shard * 64 + 2 * shard) - (4 * shard + 4 * shard))
    one = {t.name: t.nbytes for t in lk.estimate("llama-2-7b", precision="bf16-master").tensors}
    assert one["fp32 copies of the gradients"] == 4 * n and "gradients" not in one


def test_ddp_buckets_add_a_copy_of_the_gradients_unless_they_are_views():
    n = lk.count_params("llama-2-7b").total
    alone = lk.estimate("llama-2-7b", seq=16, precision="fp32")
    ddp = lk.estimate("llama-2-7b", seq=16, precision="fp32", layout=lk.Layout(dp=8))
    views = lk.estimate("llama-2-7b", seq=16, precision="fp32",
                        layout=lk.Layout(dp=8, gradient_as_bucket_view=True))
    assert ddp.total - alone.total == 4 * n
    assert views.total == alone.total
    with pytest.raises(ValueError, match="DDP's option"):
        lk.Layout(dp=8, zero_stage=1, gradient_as_bucket_view=True)


def test_zero_stage_3_over_4_ranks_holds_a_quarter_of_the_states():
    full = lk.estimate("llama-2-7b", precision="fp32", zero_stage=0, dp=4).details["model states"]
    zero3 = lk.estimate("llama-2-7b", precision="fp32", zero_stage=3, dp=4).details["model states"]
    counters, units = 4 * 291, 4 * 33         # AdamW's step per tensor; per flat ZeRO unit
    assert zero3["params"] * 4 == full["params"] and zero3["grads"] * 4 == full["grads"]
    assert (zero3["optimizer"] - units) * 4 == full["optimizer"] - counters


def test_tensor_parallel_splits_the_weights():
    assert lk.estimate("llama-2-7b", tp=8).params == pytest.approx(
        lk.estimate("llama-2-7b").params / 8, rel=0.001)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), "tp=3 does not divide heads=32"),
    (dict(pp=40), "pp=40 x virtual_stages=1 is larger than layers=32"),
    (dict(seq=-1), "seq must be a positive integer"),
    (dict(batch=0), "batch must be a positive integer"),
    (dict(precision="fp8"), "unknown precision 'fp8'"),
    (dict(optimizer="lion"), "unknown optimizer 'lion'"),
    (dict(recompute="some"), "unknown recompute policy 'some'"),
    (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
    (dict(sp=True), "needs tp > 1"),
])
def test_bad_input_raises_a_value_error_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lk.estimate("llama-2-7b", **kwargs)


def test_kv_cache_of_multi_head_grouped_multi_query_and_latent_attention():
    # 2 (K and V) x layers x kv_heads x head_dim x tokens x 2 bytes
    assert lk.kv_cache_bytes("llama-2-7b", seq=4096) == 2 * 32 * 32 * 128 * 4096 * 2   # 2 GiB
    assert lk.kv_cache_bytes("mistral-7b", seq=4096) == 2 * 32 * 8 * 128 * 4096 * 2    # GQA: 1/4
    mqa = lk.preset("llama-2-7b", kv_heads=1)
    assert lk.kv_cache_bytes(mqa, seq=4096) == 2 * 32 * 1 * 128 * 4096 * 2
    # MLA: the latent (512) and one shared RoPE key (64) per token and layer
    assert lk.kv_cache_bytes("deepseek-v2", seq=4096) == 60 * (512 + 64) * 4096 * 2


def test_a_windowed_layers_cache_stops_at_the_window():
    # gemma-3-1b: 22 of its 26 layers see the last 512 tokens, 4 see all; one kv head of 256
    per_token_layer = 2 * 1 * 256 * 2                       # K and V, bf16
    assert lk.kv_cache_bytes("gemma-3-1b", seq=32768) == (4 * 32768 + 22 * 512) * per_token_layer
    assert lk.kv_cache_bytes("gemma-3-1b", seq=32768, windows=False) == 26 * 32768 * per_token_layer
    assert lk.kv_cache_bytes("gemma-3-1b", seq=512) == 26 * 512 * per_token_layer   # inside it


def test_megatron_formula_and_ours_count_the_same_layer_input():
    # full recompute keeps only each layer's input: 2sbh bytes in fp16 in both
    cfg = lk.preset("llama-2-7b")
    ours = lk.estimate(cfg, seq=2048, precision="bf16", recompute="full")
    megatron = lk.megatron_activation_bytes(2048, 1, 4096, 32, layers=32, recompute="full")
    assert megatron == 32 * 2048 * 4096 * 2
    tokens_and_loss = 8 * 1 * 2049 + 4                  # the int64 batch, the fp32 loss
    head = head_saved(cfg, "bf16").bytes(1, 2048)       # final norm, LM head input, log-softmax
    assert ours.saved_activations == megatron + tokens_and_loss + head


def test_sequence_parallel_splits_the_replicated_activations_too():
    tp = lk.estimate("llama-2-70b", seq=4096, tp=8)
    tp_sp = lk.estimate("llama-2-70b", seq=4096, tp=8, sp=True)
    assert tp_sp.saved_activations < 0.5 * tp.saved_activations


def test_first_pipeline_stage_keeps_a_micro_batch_per_stage_in_flight():
    one = lk.estimate("llama-2-7b", seq=2048, precision="bf16", pp=1)
    four = lk.estimate("llama-2-7b", seq=2048, precision="bf16", pp=4)
    # 1F1B: the first stage holds 4 micro-batches of its 8 layers = all 32 layers' worth
    assert four.saved_activations == pytest.approx(one.saved_activations, rel=0.05)
    assert four.params == pytest.approx(one.params / 4, rel=0.05)


@pytest.mark.parametrize("name, precision", [
    ("small", "bf16"), ("small", "bf16-master"), ("tiny-moe", "bf16"),
    ("tiny-moe", "bf16-master"), ("tiny", "fp16-mixed"), ("tiny-moe", "fp16-mixed")])
@pytest.mark.parametrize("seq", [64, 512])
def test_estimate_matches_every_precision(name, precision, seq):
    _within(name, precision, "none", seq, fake=False, tolerance=0.01)


def test_autocast_cache_off_removes_the_recomputed_layers_weight_copies_from_the_forward():
    """With full recomputation autocast's cache holds a bf16 copy of every block weight until
    the forward pass ends: LLaMA-2-7B's forward peak (4 of its blocks), measured on fake tensors,
    falls by exactly those bytes (2 x the blocks' matmul weights) with cache_enabled=False, as
    estimated."""
    cfg, forward = lk.preset("llama-2-7b", layers=4), {}
    for cache in (True, False):
        recipe = lk.Recipe("bf16-mixed", recompute="full", autocast_cache=cache)
        e = lk.estimate(cfg, 1, 512, device="cuda", recipe=recipe)
        m = lk.measure_step(cfg, 1, 512, recipe=recipe, fake=True, device="cuda")
        t = m.timeline
        forward[cache] = max(b for b, phase in zip(t.total, t.phase) if phase == "forward")
        # the measured forward ends holding the 4-byte fp32 loss, which the estimate's
        # "forward: loss" moment does not count yet
        assert forward[cache] == e.moments["forward: loss"] + 4
    matmul = 4 * (4 * 4096 * 4096 + 3 * 4096 * 11008)        # q, k, v, o and the MLP's three
    assert forward[True] - forward[False] == 2 * matmul
    with pytest.raises(ValueError, match="autocast_cache is True"):
        lk.Recipe(autocast_cache="no")


def test_master_weights_cost_12_bytes_of_state_and_4_of_fp32_gradients_at_the_step():
    cfg = lk.preset("llama-2-7b", layers=4)                  # 4 of its 32 blocks, full width
    n = lk.count_params(cfg).total
    e = lk.estimate(cfg, seq=64, precision="bf16-master")
    m = lk.measure_step(cfg, seq=64, precision="bf16-master", fake=True)
    assert e.params == m.params == 2 * n
    tensors = 9 * 4 + 3                                      # 9 per layer, embedding, norm, head
    assert e.optimizer == m.optimizer == 12 * n + 4 * tensors  # + one AdamW step counter each
    assert m.other >= 4 * n                                  # the fp32 gradients at the peak


@pytest.mark.parametrize("recompute", ["selective", "every-2", "sqrt"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
@pytest.mark.parametrize("name", ["small", "tiny-moe"])
def test_estimate_follows_every_recompute_policy(name, precision, recompute):
    _within(name, precision, recompute, 1024, fake=False)


def test_selective_recompute_keeps_exactly_the_matmul_and_attention_outputs():
    m = lk.measure_step("small", seq=1024, precision="bf16-mixed", recompute="selective", fake=False)
    e = lk.estimate("small", seq=1024, precision="bf16-mixed", recompute="selective")
    assert abs(e.saved_activations - m.saved_activations) <= 8      # to within a scalar
