"""The chunked loss equals the full-logits cross-entropy, in value and gradients, holds one
chunk of logits instead of (tokens, vocab) ones, and the estimate predicts its step."""
import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.transformer.loss import chunked_cross_entropy, measure_loss

N, H, V = 100, 32, 500


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()            # (N, h)
    weight = (torch.randn(V, H, generator=g) * 0.1).to(dtype).requires_grad_()     # (V, h)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[3, 50]] = -100                             # ignored, as F.cross_entropy ignores them
    return hidden, weight, targets


def _loss_and_grads(loss_fn, hidden, weight, targets, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(hidden, weight, targets)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def full(hidden, weight, targets):
    """labkit.transformer.model's path: the (N, V) logits, in fp32, then F.cross_entropy."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


@pytest.mark.parametrize("chunk", [1, 7, 32, 100, 1000])      # 7 and 32 do not divide 100
def test_fp32_loss_and_gradients_equal_full_logits(chunk):
    inputs = _inputs()
    want = _loss_and_grads(full, *inputs)
    got = _loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk), *inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [16, 33])
def test_under_autocast_bf16_matmuls_give_the_full_path_within_bf16_rounding(chunk):
    inputs = _inputs()
    want = _loss_and_grads(full, *inputs, autocast=True)
    got = _loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk), *inputs,
                          autocast=True)
    assert got[0].dtype == torch.float32 and abs(got[0] - want[0]) < 1e-4
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype == torch.float32            # the fp32 parameters' gradients
        assert (a - b).abs().max() <= 0.02 * b.abs().max()    # bf16's 8 bits, added per chunk


def test_bf16_inputs_get_bf16_gradients():
    loss, grad_h, grad_w = _loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, 16),
                                           *_inputs(torch.bfloat16))
    assert loss.dtype == torch.float32                  # the softmax is fp32 whatever the inputs
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16


def test_the_model_with_a_chunked_loss_trains_like_the_full_one():
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("tiny"))
    tokens = torch.randint(0, 256, (2, 65))
    grads = []
    for chunk in (None, 24):                           # 24 does not divide 2 x 64 tokens
        model.loss_chunk = chunk
        model.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (full_loss, full_grads), (chunked_loss, chunked_grads) = grads
    torch.testing.assert_close(chunked_loss, full_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(chunked_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---- memory: the tracker's bytes ------------------------------------------------------------
def test_full_logits_hold_two_fp32_copies_at_the_loss_and_three_at_the_start_of_backward():
    n, h, v = 2048, 64, 4096
    peak = measure_loss(n, h, v, fake=False)
    scalars = 8                            # the loss and nll_loss's total weight, fp32
    assert peak.forward == 2 * n * v * 4 + scalars            # logits, log-softmax
    assert peak.backward == 3 * n * v * 4 + scalars           # log-softmax, its and the logits' grads


@pytest.mark.parametrize("chunk", [256, 1000])
def test_a_chunked_loss_holds_one_chunk_of_logits_and_a_log_sum_exp_per_token(chunk):
    n, h, v = 2048, 64, 4096
    peak = measure_loss(n, h, v, chunk, fake=False)
    few_vectors = 32 * chunk + 64          # (chunk,) targets, maxima, sums: not (chunk, vocab)
    forward = chunk * v * 4 + 4 * n                        # one fp32 chunk, the saved lse
    assert forward <= peak.forward <= forward + few_vectors
    backward = forward + (n + v) * h * 4                   # and the gradients of hidden and weight
    assert backward <= peak.backward <= backward + few_vectors
    assert peak.backward < measure_loss(n, h, v, fake=False).backward / 5      # 3 (N, V) copies


def test_at_deepseek_v3s_head_and_8k_tokens_chunks_remove_the_fp32_logits():
    n, h, v, chunk = 8192, 7168, 129280, 1024         # fake tensors: shapes and bytes only
    full_peak, chunked = measure_loss(n, h, v, autocast=True), measure_loss(n, h, v, chunk, autocast=True)
    copies = (n + v) * h * 2                                    # bf16 copies of hidden and head
    assert full_peak.backward == copies + 3 * n * v * 4 + 8       # 11.8 GiB of (N, V) fp32
    # chunked, the most is the head's gradient: bf16 from the chunks, then its fp32 copy
    assert chunked.backward == pytest.approx(n * h * 2 + v * h * (2 + 4), rel=0.001)


# ---- the estimate predicts the step ---------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
@pytest.mark.parametrize("chunk", [256, 1000])
@pytest.mark.parametrize("name, seq", [("tiny", 2048), ("small", 512),
                                       pytest.param("small", 2048, marks=pytest.mark.slow)])
def test_estimate_equals_a_real_cpu_step_with_a_chunked_loss(name, seq, chunk, precision):
    m = lk.measure_step(name, seq=seq, precision=precision, fake=False, loss_chunk=chunk)
    e = lk.estimate(name, seq=seq, precision=precision, device=m.device, loss_chunk=chunk)
    assert e.total == pytest.approx(m.total, rel=0.001), (e.moments, m.as_dict())
    assert abs(e.saved_activations - m.saved_activations) <= 8
    assert e.peak_phase == m.peak_phase


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
@pytest.mark.parametrize("chunk", [None, 1024, 4096])
def test_estimate_equals_a_fake_step_with_deepseek_v3s_vocabulary(chunk, precision):
    # one layer of DeepSeek-V3 and its 129,280-token head, 8k tokens; SGD so the loss decides
    cfg = lk.preset("deepseek-v3").replace(layers=1, dense_layers=1, name="deepseek-v3, 1 layer")
    kw = dict(batch=2, seq=4096, precision=precision, optimizer="sgd", device="cpu",
              loss_chunk=chunk)
    m, e = lk.measure_step(cfg, **kw), lk.estimate(cfg, **kw)
    assert e.total == pytest.approx(m.total, rel=0.001), (e.moments, m.as_dict())
    assert e.peak_phase == m.peak_phase == "backward"


def test_chunks_change_only_the_loss_terms_of_the_estimate():
    full = lk.estimate("deepseek-v3", batch=2, seq=4096, recompute="full", zero_stage=3, dp=64)
    chunked = lk.estimate("deepseek-v3", batch=2, seq=4096, recompute="full", zero_stage=3,
                          dp=64, loss_chunk=1024)
    n, v = 2 * 4096, 129280
    # what backward starts with: the kept log-softmax and two (N, V) fp32 gradients, or one chunk
    # in fp32 and bf16 beside the LM head's bf16 gradients and its input's
    full_start = full.moments["backward: start"] - 3 * n * v * 4
    chunked_start = (chunked.moments["backward: loss chunks"] - 1024 * v * 6
                     - (v + n) * 7168 * 2 - 4 * n - 8)       # minus lse and count
    assert full_start == chunked_start
    assert full.moments["backward: final norm"] == chunked.moments["backward: final norm"]


# ---- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [0, -4, 2.5, True, None])
def test_a_chunk_that_is_not_a_positive_integer_raises(chunk):
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        chunked_cross_entropy(*_inputs(), chunk)


@pytest.mark.parametrize("shapes, message", [
    (((N, H), (V, H + 1), (N,)), "must share h"),
    (((2, N, H), (V, H), (N,)), "flatten"),
    (((N, H), (V, H), (N + 1,)), "one per row of hidden"),
])
def test_shapes_that_do_not_fit_raise(shapes, message):
    h, w, t = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        chunked_cross_entropy(h, w, t.long(), 8)


@pytest.mark.parametrize("make", [
    lambda: lk.Recipe(loss_chunk=0),
    lambda: lk.estimate("tiny", loss_chunk=-1),
    lambda: lk.measure_step("tiny", seq=64, loss_chunk=1.5),
])
def test_a_bad_loss_chunk_raises_naming_none(make):
    with pytest.raises(ValueError, match="None for the full logits"):
        make()


def test_loss_chunk_applies_to_labkits_model_only():
    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = lk.preset("tiny")
            self.table = torch.nn.Embedding(256, 256)

        def forward(self, input_ids, labels):
            loss = F.cross_entropy(self.table(input_ids[:, :-1]).flatten(0, 1), labels[:, 1:].flatten())
            return type("Out", (), {"loss": loss})

    with pytest.raises(ValueError, match="applies to labkit's model only"):
        lk.measure_step(Bigram(), seq=16, precision="fp32", loss_chunk=8)
