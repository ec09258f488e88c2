"""Training-step options: master weights keep the updates bf16 would round away."""
import torch

from labkit.train import MasterWeights, make_optimizer


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
