"""The command line prints a readable breakdown, JSON on request, and errors without tracebacks."""
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import labkit as lk
from labkit.__main__ import build_parser, main


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


@pytest.mark.parametrize("argv", [["presets"], ["estimate", "--model", "deepseek-v2-lite"],
                                  ["plan", "--model", "llama-2-7b", "--gpu", "a100-80gb",
                                   "--gpus", "8", "--seq", "4096"]])
def test_estimate_plan_and_presets_answer_without_importing_torch(argv):
    # torch's import is most of a command's time (~1.5 s of ~2 s here); only measure needs it
    code = ("import sys; from labkit.__main__ import main; code = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()


def test_measure_runs_a_step_on_fake_tensors_with_cuda_defaults(capsys):
    assert main(["measure", "--model", "tiny", "--seq", "128", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["total"] == lk.measure_step("tiny", seq=128, fake=True, device="cuda").total
    assert printed["optimizer implementation"] == "foreach"


def test_attention_names_the_core_gemma_2s_eager_attention_keeps_the_tanh_of(capsys):
    # transformers runs Gemma 2 eagerly: naive keeps each layer's (T, T) probabilities (fp32 +
    # the bf16 copy under autocast) and the soft-capped scores (bf16), 8 bytes per pair a head
    saved = {}
    for core in ("sdpa", "naive"):
        assert main(["estimate", "--model", "gemma-2-9b", "--seq", "1024", "--attention", core,
                     "--json"]) == 0
        saved[core] = json.loads(capsys.readouterr().out)["saved_activations"]
    cfg = lk.preset("gemma-2-9b")
    kept_k_v = 2 * 1024 * (cfg.heads - cfg.kv_heads) * cfg.head_dim * 2 * cfg.layers  # repeated
    assert saved["naive"] - saved["sdpa"] == (cfg.layers * cfg.heads * 1024 ** 2 * 8 + kept_k_v
                                              - cfg.layers * 1024 * cfg.heads * 4)   # no lse


def test_estimate_explains_the_tensors_at_the_peak_and_the_weight_cache(capsys):
    assert main(["estimate", "--model", "llama-2-7b", "--batch", "4", "--seq", "4096", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "autocast weight cache" in out and "bf16 weight copies (autocast)" in out
    assert "q, k, v and attention output" in out


def test_a_model_may_be_a_hugging_face_config_json(tmp_path, capsys):
    qwen2 = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                 vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(qwen2))
    for model in (tmp_path / "config.json", tmp_path):           # the file, or its folder
        assert main(["estimate", "--model", str(model), "--json"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["total"] == lk.estimate(lk.from_hf_config(qwen2)).total


def test_a_hand_written_moe_config_is_estimated_measured_and_planned(tmp_path, capsys):
    """A Qwen3-MoE that is no preset, its config.json typed by hand, through all three commands."""
    moe = dict(model_type="qwen3_moe", hidden_size=512, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, head_dim=64,
               intermediate_size=1536, moe_intermediate_size=256, num_experts=16,
               num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[], vocab_size=4096, max_position_embeddings=4096,
               tie_word_embeddings=False, torch_dtype="bfloat16")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(moe))
    assert main(["estimate", "--model", str(path), "--seq", "512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == lk.estimate(
        lk.from_hf_config(moe), seq=512).total
    assert main(["measure", "--model", str(path), "--seq", "256"]) == 0
    assert "peak during" in capsys.readouterr().out
    assert main(["plan", "--model", str(path), "--gpu", "H100-80GB", "--gpus", "8",
                 "--seq", "512"]) == 0
    assert "#1" in capsys.readouterr().out


def test_a_model_may_be_a_hub_name_in_the_local_hugging_face_cache(tmp_path, capsys,
                                                                   monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    qwen3 = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
                 tie_word_embeddings=True)
    repo = tmp_path / "models--Qwen--Qwen3-0.6B"          # the cache's layout, nothing fetched
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(qwen3))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert main(["estimate", "--model", "Qwen/Qwen3-0.6B", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["total"] == lk.estimate(lk.from_hf_config(qwen3)).total
    # Qwen3-0.6B's published count (0.44B without the tied embedding)
    assert lk.count_params(lk.from_hf_config(qwen3)).total == 596_049_920
    with pytest.raises(SystemExit) as exit:                                  # not in the cache
        main(["estimate", "--model", "Qwen/Qwen3-8B"])
    assert exit.value.code == 2
    assert "huggingface-cli download Qwen/Qwen3-8B config.json" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--model", "deepseek-v2-lite", "--dp", "2", "--ep", "4"], "(e.g. --dp 4 --ep 4)"),
    (["--model", "llama-2-7b", "--tp", "3"], "--tp 3 does not divide heads=32"),
    (["--model", "llama-2-7b", "--dp", "16", "--replicas", "2"], "set --zero-stage 3 (or 1, 2)"),
    (["--model", "llama-2-7b", "--dp", "8", "--zero-stage", "2", "--param-dtype", "bf16"],
     "set --zero-stage 3"),
    (["--model", "mixtral-8x7b", "--dp", "16", "--ep", "8", "--etp", "2", "--tp", "2"],
     "use --etp 1, or --tp 1"),
])
def test_errors_name_the_command_line_flags_not_python(capsys, argv, words):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Layout(" not in err and "tp=3" not in err, err


def test_estimate_takes_lora_and_says_whether_the_step_fits_a_gpu(capsys):
    argv = ["estimate", "--model", "llama-2-7b", "--precision", "bf16-master", "--recompute",
            "full", "--trainable", "qlora", "--gpu", "rtx-4090-24gb"]
    assert main(argv + ["--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    e = lk.estimate("llama-2-7b", precision="bf16-master", recompute="full", trainable="lora",
                    weight_format="nf4")
    assert printed["total"] == e.total
    assert printed["fits rtx-4090-24gb"].startswith("yes, ")
    full = ["estimate", "--model", "llama-2-7b", "--gpu", "rtx-4090-24gb"]
    assert main(full) == 0 and "fits rtx-4090-24gb: no, " in capsys.readouterr().out


def test_bad_input_prints_the_fix_without_a_traceback():
    run = subprocess.run([sys.executable, "-m", "labkit", "estimate", "--model", "llama-2-7b",
                          "--tp", "3"], capture_output=True, text=True)
    assert run.returncode != 0
    assert "--tp 3 does not divide heads=32" in run.stderr      # the flag, not Python's tp=3
    assert "Traceback" not in run.stderr


def test_unknown_model_lists_the_presets():
    run = subprocess.run([sys.executable, "-m", "labkit", "estimate", "--model", "gpt-5"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "known presets" in run.stderr


def test_measure_real_runs_where_this_machine_can_and_says_where(capsys):
    assert main(["measure", "--model", "tiny", "--seq", "32", "--real", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    here = lk.device().type                     # cuda when present, else cpu
    assert printed["tensors"] == f"real, on {here}"
    assert printed["total"] == lk.measure_step("tiny", seq=32, fake=False).total


def test_every_byte_count_in_the_json_is_an_integer(capsys):
    def numbers(value):
        if isinstance(value, dict):
            return [n for v in value.values() for n in numbers(v)]
        if isinstance(value, list):
            return [n for v in value for n in numbers(v)]
        assert not (isinstance(value, str) and re.fullmatch(r"-?[\d.]+ (B|KiB|MiB|GiB|TiB)", value)), value
        return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []

    for argv in (["estimate", "--model", "deepseek-v2-lite", "--pp", "2", "--dp", "2",
                  "--zero-stage", "3", "--offload"],
                 ["measure", "--model", "tiny", "--seq", "64"]):
        assert main([*argv, "--json"]) == 0
        printed = numbers(json.loads(capsys.readouterr().out))
        assert printed and all(isinstance(n, int) for n in printed), argv
    assert main(["plan", "--model", "tiny", "--gpu", "l4-24gb", "--gpus", "2", "--top", "2",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    memory = [plan["usable"], plan["gpu"]["memory"], *(n for fit in plan["fits"]
                                                       for n in numbers(fit["memory"]))]
    assert all(isinstance(n, int) for n in memory)


def test_a_reader_that_leaves_early_ends_the_output_quietly():
    """`python -m labkit presets | head -1`: the reader is gone before anything is written."""
    reader, writer = os.pipe()
    os.close(reader)
    run = subprocess.run([sys.executable, "-m", "labkit", "presets"], stdout=writer,
                         stderr=subprocess.PIPE, text=True)
    os.close(writer)
    assert run.stderr == "" and run.returncode == 128 + 13        # as a Unix tool killed by SIGPIPE


def test_the_choice_lists_are_labkits_vocabulary():
    from labkit.transformer.checkpointing import RECOMPUTE_POLICIES
    from labkit.core.recipe import PARAM_DTYPES, SCHEDULES
    from labkit.course.plan import OPTIMIZERS as PLANNED, RECOMPUTE, TRAINABLE
    from labkit.core.gpus import GPUS
    from labkit.core.recipe import ATTENTION_IMPLS, DEVICES, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS

    vocabulary = {"--precision": PRECISIONS, "--attention": ATTENTION_IMPLS, "--optimizer": OPTIMIZERS,
                  "--optimizer-impl": OPTIMIZER_IMPLS, "--recompute": RECOMPUTE_POLICIES,
                  "--device": DEVICES, "--schedule": SCHEDULES, "--trainable": TRAINABLE,
                  "--zero-stage": (0, 1, 2, 3), "--param-dtype": PARAM_DTYPES}
    # the planner's policies (no every-k, no sqrt) and optimizers (full fine-tuning's AdamWs)
    searched = {"--recompute": RECOMPUTE, "--optimizer": PLANNED}
    commands = next(a.choices for a in build_parser()._actions if a.dest == "command")
    for command in ("estimate", "measure", "plan"):
        for action in commands[command]._actions:
            option = action.option_strings[-1] if action.option_strings else None
            if action.choices is not None:
                expected = (searched if command == "plan" else {}).get(option, vocabulary.get(option))
                assert tuple(action.choices) == expected, action
            if option == "--gpu":                # a name, or a GPU of one's own as JSON
                assert ", ".join(GPUS) in action.help, action


def test_every_pipeline_schedule_of_the_library_runs_from_the_command_line(capsys):
    for schedule, virtual_stages in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        assert main(["estimate", "--model", "llama-2-7b", "--pp", "4", "--micro-batches", "8",
                     "--schedule", schedule, "--json"]) == 0
        layout = lk.Layout(pp=4, micro_batches=8, schedule=schedule, virtual_stages=virtual_stages)
        assert json.loads(capsys.readouterr().out)["total"] == lk.estimate("llama-2-7b",
                                                                           layout=layout).total


def test_version_comes_from_the_package_and_all_names_the_public_api(capsys):
    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        assert lk.__version__ == tomllib.load(f)["project"]["version"]
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.split()[-1] == lk.__version__
    design = {"preset", "presets", "from_hf_config", "count_params", "estimate", "Recipe",
              "Layout", "measure_step", "MemoryTracker", "kv_cache_bytes", "model_state_bytes",
              "megatron_activation_bytes", "pipeline_bubble", "fmt_bytes", "device"}
    assert design <= set(lk.__all__)
    assert all(hasattr(lk, name) for name in lk.__all__)


@pytest.mark.parametrize("argv, fix", [
    (["estimate", "--model", "gpt-5"], "known presets: deepseek-moe-16b"),
    (["estimate", "--model", "tiny", "--precision", "fp8"], "invalid choice: 'fp8' (choose from"),
    (["plan", "--model", "tiny", "--gpu", "l4-24gb", "--gpus", "2", "--top", "-1"],
     "--top: must be a positive integer, got '-1'"),
    (["estimate", "--model", "tiny", "--recompute", "every-k", "--every", "-1"],
     "--every: must be a positive integer, got '-1'"),
    (["measure", "--model", "no/such/config.json"], "no such file: no/such/config.json"),
    (["estimate", "--model", "tiny", "--optimizer-in-backward", "--dp", "2"],
     "not with --dp 2: drop those"),
])
def test_bad_input_is_one_line_naming_the_fix_and_exit_code_2(capsys, argv, fix):
    try:
        code = main(argv)
    except SystemExit as exit:                  # argparse's own checks exit at once
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and fix in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_measure_real_on_cuda_without_cuda_names_the_device_to_use(capsys):
    assert main(["measure", "--model", "tiny", "--real", "--device", "cuda"]) == 2
    assert "use --device cpu" in capsys.readouterr().err


def test_estimate_and_measure_take_the_same_sequence_lengths(capsys):
    # past the preset's max_seq both size the RoPE tables for the sequence, as plan does
    assert main(["estimate", "--model", "tiny", "--seq", "4096", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert main(["measure", "--model", "tiny", "--seq", "4096", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert abs(est["total"] - measured["total"]) <= 4     # one fp32 scalar, as lab 00 shows
