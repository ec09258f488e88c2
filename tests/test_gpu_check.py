"""scripts/gpu_check.py, the one prepared run of labkit's GPU path: without CUDA it says so and
exits 0, and every case it would run is one the estimate takes (a renamed keyword would
otherwise surface only on a GPU machine)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import labkit as lk

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script runs")
def test_without_cuda_it_says_so_and_exits_0():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "no CUDA device" in done.stdout


@pytest.mark.parametrize("case", gpu_check.TRACKER_CASES + gpu_check.ALLOC_CASES,
                         ids=lambda c: c[0] or "default")
def test_every_case_is_one_the_estimate_takes(case):
    _, spec, batch, seq, step = case
    step = {k: v for k, v in step.items() if k != "then"}        # measure_step's alone
    assert lk.estimate(gpu_check.model(spec), batch, seq, device="cuda", **step).total > 0
