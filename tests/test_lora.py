"""LoRA and QLoRA (lab 06): the frozen model and its adapters, measured against the estimate
on `small`, with every recompute policy and precision on `tiny`, `small` and LLaMA-2-7B, and
a QLoRA fine-tune whose loss goes down."""
import pytest
import torch

import labkit as lk
from labkit.core.units import CATEGORIES
from labkit.quantisation.lora import apply_lora
from labkit.quantisation.quant import QuantLinear
from labkit.quantisation.quant import LoRALinear
from labkit.training.train import bigram_corpus, make_optimizer, train_step
from labkit.transformer.checkpointing import apply_recompute

B, T = 4, 64


def test_apply_lora_adapts_every_linear_of_the_blocks_and_freezes_the_rest():
    cfg = lk.preset("small")
    model = lk.build_model(cfg)
    trainable = apply_lora(model, r=16, weight_format="nf4")
    per_block = 16 * (4 * cfg.hidden + 2 * cfg.heads * cfg.head_dim + 2 * cfg.kv_heads
                      * cfg.head_dim + 3 * (cfg.hidden + cfg.ffn))       # r (in + out) each
    assert trainable == cfg.layers * per_block
    adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(adapters) == 7 * cfg.layers
    assert all(isinstance(m.base, QuantLinear) for m in adapters)
    assert not model.embed.weight.requires_grad and not model.lm_head.weight.requires_grad
    # the packed codes are frozen parameters, not buffers: the tracker counts them as "params"
    codes = adapters[0].base.codes
    assert isinstance(codes, torch.nn.Parameter) and codes.dtype == torch.uint8


def test_nf4_base_bytes_are_the_estimates_frozen_weights():
    model = lk.build_model(lk.preset("small"))
    apply_lora(model, weight_format="nf4")
    stored = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    est = lk.estimate("small", B, T, device="cpu",
                      recipe=lk.Recipe("fp32", trainable="lora", weight_format="nf4"))
    nf4 = [t for t in est.tensors if t.dtype == "nf4"]
    assert [t.nbytes for t in nf4] == [stored]


CASES = [(p, trainable, fmt) for p in ("fp32", "bf16-master")
         for trainable, fmt in (("all", None), ("lora", None), ("lora", "nf4"))]


@pytest.mark.parametrize("precision, trainable, weight_format", CASES)
def test_measured_step_matches_the_estimate_per_category(precision, trainable, weight_format):
    torch.set_num_threads(1)
    m = lk.measure_step("small", B, T, precision, fake=False, device="cpu",
                        trainable=trainable, weight_format=weight_format)
    e = lk.estimate("small", B, T, device="cpu", recipe=lk.Recipe(
        precision, trainable=trainable, weight_format=weight_format))
    assert abs(e.total - m.total) <= 0.01 * m.total
    for c in CATEGORIES:     # each within 1% of itself, or a speck (0.1% of the peak)
        assert abs(getattr(e, c) - getattr(m, c)) <= max(0.01 * getattr(m, c), 0.001 * m.total), c


def test_qlora_holds_a_fraction_of_full_fine_tuning():
    full, qlora = (lk.estimate("llama-2-7b", 1, 2048, recipe=lk.Recipe(
        "bf16-master", trainable=t, weight_format=f)) for t, f in (("all", None), ("lora", "nf4")))
    assert qlora.total < full.total / 8
    assert qlora.grads < 100 * 2**20 and qlora.optimizer < 500 * 2**20


def test_qlora_fine_tune_lowers_the_loss():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("small"))
    apply_lora(model, weight_format="nf4")
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rows = bigram_corpus(model.cfg.vocab_size, B * (T + 1)).view(B, T + 1)      # (B, T + 1)
    frozen = model.embed.weight.clone()
    losses = [train_step(model, opt, rows[:, :-1], rows[:, 1:]).loss for _ in range(30)]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3
    assert torch.equal(model.embed.weight, frozen)


@pytest.mark.parametrize("trainable, weight_format", [("all", None), ("lora", "nf4")])
def test_finetune_trains_a_copy_and_lowers_the_loss(trainable, weight_format):
    from labkit.quantisation.lora import finetune
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("small"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = finetune(model, steps=15, trainable=trainable, weight_format=weight_format)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5       # measured: 8.39 -> 7.43 (LoRA on NF4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="trainable='lora'"):
        finetune(model, trainable="all", weight_format="nf4")


def test_finetune_trains_modules_to_save_beside_the_adapters():
    from labkit.quantisation.lora import finetune
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("small"))
    adapters_only = finetune(model, steps=6)
    with_head = finetune(model, steps=6, modules_to_save=("embed", "lm_head"))
    assert with_head[0] == adapters_only[0] and with_head[-1] != adapters_only[-1]
    with pytest.raises(ValueError, match="trainable='lora'"):
        finetune(model, trainable="all", modules_to_save=("embed",))


@pytest.mark.parametrize("make, message", [
    (lambda: lk.Recipe("fp32", weight_format="nf4"), "pass trainable='lora'"),
    (lambda: lk.Recipe("fp32", trainable="lora", weight_format="int3"), "unknown weight_format"),
])
def test_bad_lora_recipes_name_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---- LoRA and QLoRA compose with every recompute policy and precision ------------------------
POLICIES = ["none", "selective", "full", "every-2", "sqrt"]


def _measured_and_estimated(cfg, batch, seq, recipe, fake=False):
    torch.set_num_threads(1)
    m = lk.measure_step(cfg, batch, seq, recipe=recipe, fake=fake,
                        device="cuda" if fake else "cpu")
    return m, lk.estimate(cfg, batch, seq, recipe=recipe, device=m.device)


def _assert_within(m, e, tolerance):
    assert e.total == pytest.approx(m.total, rel=tolerance), (e.details["peak moment"], e.moments)
    assert e.saved_activations == pytest.approx(m.saved_activations, rel=tolerance)
    assert e.peak_phase == m.peak_phase


@pytest.mark.parametrize("recompute", POLICIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16-master", "bf16-mixed"])
def test_lora_with_any_recompute_and_precision_matches_the_estimate(precision, recompute):
    # tiny at 1024 tokens: its layers, not its logits, make the peak, so the recomputed layers'
    # moments are what is compared (measured: equal to 4 bytes, the loss's scalar)
    m, e = _measured_and_estimated("tiny", 1, 1024, lk.Recipe(precision, recompute=recompute,
                                                               trainable="lora"))
    _assert_within(m, e, 0.001)


@pytest.mark.parametrize("recompute", POLICIES)
@pytest.mark.parametrize("precision", ["fp32", "bf16-master", "bf16-mixed"])
def test_qlora_with_any_recompute_and_precision_matches_the_estimate(precision, recompute):
    # small (tiny's weights are too small for NF4's blocks of 64 x 256); measured: equal to 4 bytes
    m, e = _measured_and_estimated("small", 1, 1024, lk.Recipe(
        precision, recompute=recompute, trainable="lora", weight_format="nf4"))
    _assert_within(m, e, 0.001)


LLAMA_CASES = [("bf16-master", "full", "nf4"),       # QLoRA, its dequantisation inside recompute
               ("bf16-master", "selective", None),    # LoRA, op-level selective recompute
               ("bf16-mixed", "full", None)]          # LoRA under autocast, full recompute


@pytest.mark.parametrize("precision, recompute, weight_format", LLAMA_CASES)
def test_lora_on_llama_2_7b_matches_the_estimate_on_fake_tensors(precision, recompute,
                                                                   weight_format):
    # 4 of its 32 layers, full width, 2048 tokens; measured: equal to 4 bytes
    m, e = _measured_and_estimated(lk.preset("llama-2-7b", layers=4), 1, 2048, lk.Recipe(
        precision, recompute=recompute, trainable="lora", weight_format=weight_format), fake=True)
    _assert_within(m, e, 0.03)


@pytest.mark.slow
def test_qlora_on_all_of_llama_2_7b_matches_the_estimate():
    # the whole model once (QLoRA, the costliest case: 50-100 s); each case above at 4 blocks
    m, e = _measured_and_estimated("llama-2-7b", 1, 2048, lk.Recipe(
        "bf16-master", recompute="full", trainable="lora", weight_format="nf4"), fake=True)
    _assert_within(m, e, 0.03)


@pytest.mark.parametrize("recompute", ["full", "selective", "sqrt"])
@pytest.mark.parametrize("weight_format", [None, "nf4"])
def test_recomputed_adapters_get_the_gradients_they_get_without_recompute(recompute,
                                                                          weight_format):
    # torch.utils.checkpoint reruns the blocks with their adapters, NF4 dequantisation and
    # autocast in the backward pass: bit for bit the step it replaces
    torch.set_num_threads(1)
    grads = {}
    for policy in ("none", recompute):
        torch.manual_seed(0)
        model = apply_recompute(lk.build_model(lk.preset("small")), policy)
        apply_lora(model, weight_format=weight_format)
        rows = bigram_corpus(model.cfg.vocab_size, 2 * (T + 1)).view(2, T + 1)   # (2, T + 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        grads[policy] = [p.grad for p in model.parameters() if p.requires_grad]
    assert len(grads["none"]) == 7 * 2 * model.cfg.layers                 # A and B of each target
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[recompute]))


def test_an_adapter_under_autocast_returns_the_bases_dtype():
    lora = LoRALinear(torch.nn.Linear(64, 32), r=4, alpha=8)
    x = torch.randn(2, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lora(x).dtype == torch.bfloat16            # the base's output's, not x's fp32
    assert lora(x).dtype == torch.float32


def test_combinations_without_meaning_still_name_the_fix():
    with pytest.raises(ValueError, match="stores the frozen weights under trainable adapters"):
        lk.Recipe("bf16-mixed", recompute="full", weight_format="nf4")   # NF4 with nothing to train
    with pytest.raises(ValueError, match=r"would keep every\s+\(T, T\) score matrix"):
        lk.Recipe("bf16-mixed", recompute="selective", trainable="lora", attention="naive")


# ---- LoRA over data parallelism: FSDP2 shards the frozen base -----------------------------------
# small widened to 1024 (6 layers, vocabulary 256): blocks large beside the loss, so that FSDP2's
# gathered, prefetched and held blocks set the peak, as at full size, in about 1.5 s a case
WIDE = lk.preset("small").replace(hidden=1024, ffn=2816, heads=8, kv_heads=8, head_dim=128,
                                  vocab_size=256, layers=6)


def _fsdp2_and_estimate(cfg, dp, batch, seq, recompute, weight_format=None):
    from labkit.parallel.data.fsdp import fake_fsdp2_peak
    measured = fake_fsdp2_peak(cfg, dp, batch, seq, precision="bf16", recompute=recompute,
                               trainable="lora", weight_format=weight_format)
    return measured, lk.estimate(cfg, batch, seq, precision="bf16", recompute=recompute,
                                 trainable="lora", weight_format=weight_format,
                                 layout=lk.Layout(dp=dp, zero_stage=3))


@pytest.mark.parametrize("dp, batch, seq, recompute, moment", [
    (2, 1, 256, "full", "forward: gather of layer 5"),        # two all-gather outputs held
    (8, 4, 512, "full", "backward: recomputing layer 5"),     # gathered, and the next prefetched
    (4, 2, 256, "none", None)])
def test_lora_under_fsdp2_matches_the_estimate(dp, batch, seq, recompute, moment):
    """Measured: -0.31%, +0.01%, -0.15% (without FSDP2's held outputs and prefetch counted, the
    first two were -6.7% and -5.2%)."""
    measured, est = _fsdp2_and_estimate(WIDE, dp, batch, seq, recompute)
    assert est.total == pytest.approx(measured["peak"], rel=0.005), est.details["peak moment"]
    assert moment is None or est.details["peak moment"] == moment
    replica = lk.estimate(WIDE, batch, seq, precision="bf16", recompute=recompute,
                          trainable="lora")
    assert est.total < replica.total            # the frozen base is sharded


@pytest.mark.parametrize("dp, batch, seq, recompute", [(8, 4, 512, "full"), (4, 2, 256, "none")])
def test_qlora_under_fsdp2_matches_the_estimate(dp, batch, seq, recompute):
    """FSDP-QLoRA: FSDP2 shards the NF4 codes and scales (frozen parameters of three dtypes,
    gathered as bytes) with the rest of each block. Measured: +0.01% and -0.44% (and at dp 2,
    full recompute +0.00%, at dp 4 selective -0.73%, left out for CI time); the shards to
    within FSDP2's padding of each parameter."""
    measured, est = _fsdp2_and_estimate(WIDE, dp, batch, seq, recompute, "nf4")
    assert est.total == pytest.approx(measured["peak"], rel=0.01), est.details["peak moment"]
    # FSDP2 pads each parameter's first dimension to a multiple of dp, the estimate each block
    # once: measured 112 bytes apart at dp 2, 339 at dp 8
    assert est.params == pytest.approx(measured["by_category"]["params"], abs=64 * dp)
    lora = lk.estimate(WIDE, batch, seq, precision="bf16", recompute=recompute,
                       trainable="lora", layout=lk.Layout(dp=dp, zero_stage=3))
    assert est.params < 0.4 * lora.params           # NF4 shards beside bf16 ones


@pytest.mark.slow
def test_lora_of_llama_2_7b_under_fsdp2_over_8_matches_the_estimate():
    """Measured 3.81 GiB, estimated to 0.0%; one replica needs 14.04 GiB."""
    measured, est = _fsdp2_and_estimate("llama-2-7b", 8, 1, 2048, "full")
    assert est.total == pytest.approx(measured["peak"], rel=0.005), est.details["peak moment"]
    assert est.total < 0.3 * lk.estimate("llama-2-7b", 1, 2048, precision="bf16",
                                         recompute="full", trainable="lora").total
