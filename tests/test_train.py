"""Training-step options: master weights keep the updates bf16 would round away."""
import pytest
import torch

from labkit.training.train import MasterWeights, make_optimizer


def test_master_weights_keep_updates_too_small_for_bf16():
    results = {}
    for master in (False, True):
        w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        opt = make_optimizer([w], "sgd", lr=1e-4, master_weights=master)
        for _ in range(100):
            w.grad = torch.ones_like(w)
            opt.step()
            opt.zero_grad()
        results[master] = w.detach().float()
    assert torch.equal(results[False], torch.ones(4))          # 1 - 1e-4 rounds back to 1
    assert torch.allclose(results[True], torch.full((4,), 0.99), atol=4e-3)


def test_master_weights_live_in_the_optimizer_state():
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = make_optimizer([w], "adamw", master_weights=True)
    w.grad = torch.ones_like(w)
    opt.step()
    state = opt.state[w]
    assert state["master"].dtype == torch.float32
    assert state["exp_avg"].dtype == torch.float32 and isinstance(opt, MasterWeights)


def test_mixed_precision_and_master_weights_follow_the_fp32_loss_curve():
    from labkit.training.train import train
    fp32 = train("tiny", steps=30, precision="fp32", progress=False)
    for precision in ("bf16-mixed", "bf16-master"):
        other = train("tiny", steps=30, precision=precision, progress=False)
        assert abs(other[-1] - fp32[-1]) < 0.02 * fp32[-1]
    assert fp32[-1] < fp32[0] - 1.0


@pytest.mark.slow          # fp16 matmuls are slow on CPUs without fp16 units
def test_fp16_without_loss_scaling_stalls_when_gradients_underflow():
    from labkit.training.train import train
    shrunk = dict(steps=30, loss_factor=1e-3, progress=False)     # AdamW ignores the factor
    fp32 = train("tiny", precision="fp32", **shrunk)
    unscaled = train("tiny", precision="fp16-mixed", **shrunk)
    scaled = train("tiny", precision="fp16-mixed", scaler=torch.amp.GradScaler("cpu"), **shrunk)
    assert unscaled[-1] > fp32[-1] + 0.5                          # gradients lost to underflow
    assert abs(scaled[-1] - fp32[-1]) < 0.01 * fp32[-1]          # loss scaling restores them
