"""The command line prints a readable breakdown, JSON on request, and errors without tracebacks."""
import json
import subprocess
import sys

import labkit as lk
from labkit.__main__ import main


def test_estimate_prints_a_breakdown(capsys):
    assert main(["estimate", "--model", "deepseek-v2-lite", "--seq", "4096", "--precision",
                 "bf16-mixed", "--zero-stage", "2", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    for label in (*lk.CATEGORIES.values(), "total (peak)"):
        assert label in out
    assert "GiB" in out and "ZeRO-2, dp 8" in out


def test_estimate_json_equals_the_library_call(capsys):
    assert main(["estimate", "--model", "llama-2-7b", "--seq", "1024", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["total"] == lk.estimate("llama-2-7b", seq=1024).total


def test_presets_lists_every_preset_with_its_size(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in lk.presets():
        assert name in out
    assert "6,738,415,616" in out


def test_measure_runs_a_step_on_fake_tensors_with_cuda_defaults(capsys):
    assert main(["measure", "--model", "tiny", "--seq", "128", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["total"] == lk.measure_step("tiny", seq=128, fake=True, device="cuda").total
    assert printed["optimizer implementation"] == "foreach"


def test_estimate_explains_the_tensors_at_the_peak_and_the_weight_cache(capsys):
    assert main(["estimate", "--model", "llama-2-7b", "--batch", "4", "--seq", "4096", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "autocast weight cache" in out and "bf16 weight copies (autocast)" in out
    assert "q, k, v and attention output" in out


def test_bad_input_prints_the_fix_without_a_traceback():
    run = subprocess.run([sys.executable, "-m", "labkit", "estimate", "--model", "llama-2-7b",
                          "--tp", "3"], capture_output=True, text=True)
    assert run.returncode != 0
    assert "tp=3 does not divide heads=32" in run.stderr
    assert "Traceback" not in run.stderr


def test_unknown_model_lists_the_presets():
    run = subprocess.run([sys.executable, "-m", "labkit", "estimate", "--model", "gpt-5"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "known presets" in run.stderr
