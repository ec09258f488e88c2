"""The planner keeps what fits, says why the rest fails, ranks by a stated time model, and its
top choice's memory matches a fake-tensor run."""
import dataclasses
import json

import pytest

import labkit as lk
from labkit.__main__ import main
from labkit.core.gpus import GPU, GPUS, GiB, gpu, gpu_from_json
from labkit.course import plan as plan_module
from labkit.course.plan import plan
from labkit.predict.layers import lora_targets
from labkit.predict.steptime import step_time

RECOMPUTE_NAMES = ("none", "selective", "full")

SMALL = dict(gpus=1, seq=256)


def small_gpu(gib: float) -> GPU:
    return GPU(f"test-{gib}", int(gib * GiB), 100.0, 300.0, 25.0)


def test_a_7b_full_fine_tune_does_not_fit_one_24_gb_gpu_and_says_why():
    p = plan("llama-2-7b", "rtx-4090-24gb", 1, seq=4096, offload=False, advice=False)
    assert p.fits == []
    why = p.rejected["full, ZeRO-0, dp 1, tp 1, pp 1"]
    # 6,738,415,616 x 16 bytes (bf16-master AdamW) = 100.41 GiB > 0.9 x 24 GiB
    assert why == "model states alone need 100.41 GiB per GPU > 21.59 GiB usable"


def test_qlora_of_a_7b_fits_one_24_gb_gpu():
    p = plan("llama-2-7b", "rtx-4090-24gb", 1, seq=1024, trainable="qlora")
    assert p.fits and p.fits[0].family.trainable == "qlora"
    assert p.fits[0].estimate.total <= p.usable == int(24564 * 2**20 * 0.9)


def test_lora_of_a_7b_fits_one_24_gb_gpu_with_checkpointing():
    """LoRA keeps every layer's activations without recomputation (24 GiB at 2048 tokens): it
    fits a 24 GB card only with full recomputation, as it is run in practice (~14 GiB)."""
    p = plan("llama-2-7b", "rtx-4090-24gb", 1, seq=2048, trainable="lora", top=None)
    assert [k.recipe.recompute for k in p.fits] == ["full"]
    assert p.fits[0].estimate.total == lk.estimate(
        "llama-2-7b", 1, 2048, device="cuda", recipe=p.fits[0].recipe).total <= p.usable


def test_qlora_of_a_70b_fits_one_48_gb_budget_as_in_the_qlora_paper():
    """QLoRA's paper fine-tunes a 65B model on one 48 GB GPU (with gradient checkpointing):
    LLaMA-2-70B at 2048 tokens plans on one 80 GB GPU under 48 GiB."""
    p = plan("llama-2-70b", "a100-80gb", 1, seq=2048, trainable="qlora")
    assert p.fits and p.fits[0].recipe.recompute == "full"
    assert p.fits[0].estimate.total < 48 * 2**30


def test_pruning_keeps_every_recompute_policy_that_fits():
    """The search prunes a larger micro-batch or a weaker policy once one fails; selective can
    keep more than none (LoRA's copies beside the checkpointed core's inputs), so only full
    recomputation's failure rules out the others: the fits are every policy that fits, but
    those a faster, smaller policy of the same layout beats (selective here: slower than none
    and larger)."""
    p = plan("llama-2-7b", "rtx-4090-24gb", 1, seq=1024, trainable=("lora", "qlora"), top=None)
    found = {(k.family.trainable, k.recipe.recompute) for k in p.fits}
    every = {}
    for what, fmt in (("lora", None), ("qlora", "nf4")):
        for policy in ("none", "selective", "full"):
            e = lk.estimate("llama-2-7b", 1, 1024, device="cuda", recipe=lk.Recipe(
                "bf16", trainable="lora", weight_format=fmt, recompute=policy))
            if e.total <= p.usable:
                every[what, policy] = e.total
    assert found <= set(every) and ("lora", "none") in found
    cheaper = {"none": (), "selective": ("none",), "full": ("none", "selective")}
    for what, policy in set(every) - found:       # dropped: a cheaper policy keeps no more
        assert any(every.get((what, q), float("inf")) <= every[what, policy]
                   for q in cheaper[policy]), (what, policy)
    assert ("lora", "selective") in set(every) - found


def test_offload_needs_the_nodes_host_memory_for_its_pinned_states():
    """ZeRO-3-Offload of DeepSeek-V2-Lite keeps 240 GiB of states on the host: not on a 128 GiB
    workstation (the RTX 4090's default node), on a 512 GiB one."""
    p = plan("deepseek-v2-lite", "rtx-4090-24gb", 1, seq=2048, top=1, advice=False)
    assert p.fits == []
    why = p.rejected["full, ZeRO-3-Offload, dp 1, tp 1, pp 1"]
    host = lk.estimate("deepseek-v2-lite", 1, 2048, device="cuda", precision="bf16-master",
                       layout=lk.Layout(zero_stage=3, offload=True)).details["host memory"]
    assert why == (f"{lk.fmt_bytes(host)} of pinned host memory per node (1 rank) > "
                   f"{lk.fmt_bytes(int(128 * GiB * 0.8))} usable (host_ram, --host-ram)")
    big = plan("deepseek-v2-lite", "rtx-4090-24gb", 1, seq=2048, top=1, host_ram=512 * GiB)
    assert big.fits[0].layout.offload and host <= 0.8 * 512 * GiB
    with pytest.raises(ValueError, match="host_ram must be a positive integer"):
        plan("tiny", "a100-80gb", 1, seq=256, host_ram=0)


def test_nothing_fits_advises_more_gpus_found_by_the_same_search():
    p = plan("llama-2-7b", "rtx-4090-24gb", 1, seq=4096, offload=False)
    assert p.fits == [] and p.advice
    assert p.advice[0].startswith("8 x rtx-4090-24gb: full")


def test_advice_gives_the_fewest_gpus_with_offload_and_without():
    """One A100 holds no DeepSeek-V2-Lite step; two do with ZeRO-Offload, whose host share grows
    with the GPUs tried (the advice once kept one GPU's and jumped to 8), four without it (fused
    AdamW: foreach's temporaries do not fit)."""
    p = plan("deepseek-v2-lite", "a100-80gb", 1, seq=4096, top=1)
    assert not p.fits
    offloaded, on_gpus = p.advice[:2]
    assert offloaded.startswith("2 x a100-80gb: full, ZeRO-2-Offload, dp 2, tp 1")
    assert on_gpus.startswith("4 x a100-80gb: full, ZeRO-3, dp 4, tp 1, pp 1, fused AdamW")
    two = plan("deepseek-v2-lite", "a100-80gb", 2, seq=4096, top=1)
    assert two.fits[0].layout.offload and two.advice[0].startswith("4 x a100-80gb")


def test_fused_adamw_is_searched_before_offload_and_only_when_foreach_fits_nowhere():
    """Four A100s: foreach AdamW's step temporaries fit no layout, fused AdamW's absence of them
    does (0.57 s a step modelled, against ZeRO-Offload's 4.79 s); eight: foreach fits, no fused."""
    four = plan("deepseek-v2-lite", "a100-80gb", 4, seq=4096, top=3)
    assert all(k.family.optimizer == "adamw-fused" and not k.layout.offload for k in four.fits)
    assert four.fits[0].recipe.optimizer_impl == "fused" and not four.advice
    eight = plan("deepseek-v2-lite", "a100-80gb", 8, seq=4096, top=3)
    assert all(k.family.optimizer == "adamw" for k in eight.fits)


def test_more_memory_never_removes_a_fitting_layout():
    # offload is a fallback (searched only when nothing else fits), so compare without it
    fitting, best = None, float("inf")
    for gib in (0.05, 0.08, 0.12, 0.2, 0.4, 1.0):
        p = plan("small", small_gpu(gib), top=None, advice=False, offload=False, **SMALL)
        now = {c.label() for c in p.fits}
        if fitting is not None:
            assert fitting <= now, gib
        fitting = now
        with_offload = plan("small", small_gpu(gib), top=1, advice=False, **SMALL)
        if with_offload.fits:         # and the best step time never gets worse
            assert with_offload.fits[0].time.total <= best
            best = with_offload.fits[0].time.total
    assert fitting            # at 1 GiB something fits


def test_the_cheap_bound_never_exceeds_the_estimate():
    from labkit.predict.plan_search import _bound, _Counts
    p = plan("tiny-moe", small_gpu(4), gpus=8, seq=128, top=None, advice=False)
    cfg, counts = lk.preset("tiny-moe"), _Counts(lk.preset("tiny-moe"))
    assert len(p.fits) > 20
    for c in p.fits:
        assert _bound(cfg, c, counts, 128, {}) <= c.estimate.total, c.label()


def test_fits_are_ranked_by_step_time_and_hold_the_usable_memory():
    p = plan("deepseek-v2-lite", "a100-80gb", 8, seq=4096)
    # ranked with data parallel's communication hidden under the compute, as DDP and FSDP run it
    times = [c.time.dp_overlapped for c in p.fits]
    # sorted, but for ties: times within TIE of each other go to the larger micro-batch
    from labkit.predict.plan_search import TIE
    assert len(p.fits) == 10 and all(b >= a * (1 - 2 * TIE) for a, b in zip(times, times[1:]))
    assert times[-1] > times[0]
    assert all(c.estimate.total <= p.usable for c in p.fits)
    # ZeRO-0 replicates 16 bytes per parameter of a 15.7B model: rejected before any estimate
    assert p.rejected["full, ZeRO-0, dp 8, tp 1, pp 1"].startswith("model states alone need")


def test_tp_beyond_a_node_is_rejected_with_the_reason():
    p = plan("llama-2-7b", "h100-80gb", 16, seq=1024, top=1, advice=False)
    assert "must stay inside a node" in p.rejected["full, ZeRO-0, dp 1, tp 16, pp 1"]


def test_top_choice_memory_matches_a_fake_tensor_run_within_3_percent():
    p = plan("small", small_gpu(0.2), verify=1, **SMALL)
    (v,) = p.verified
    assert "measured" in v, v
    assert abs(v["ratio"] - 1) < 0.03


def test_layouts_with_tp_are_not_pretended_verified():
    p = plan("small", small_gpu(0.05), gpus=2, seq=256, top=None, advice=False)
    tp = [c for c in p.fits if c.layout.tp > 1][:1]
    from labkit.course.plan import verify_candidates
    (v,) = verify_candidates(lk.preset("small"), tp, 256, progress=False)
    assert v["result"].startswith("not verifiable on fake tensors here")


@pytest.mark.parametrize("kwargs, fix", [
    (dict(gpus=0), "gpus must be a positive integer"),
    (dict(gpus=12), "choose a multiple of 8"),
    (dict(gpus=8, headroom=1.5), "headroom is a fraction"),
    (dict(gpus=8, trainable="adapters"), "use one of all, lora, qlora"),
])
def test_bad_input_names_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        plan("tiny", "a100-80gb", **{"seq": 128, **kwargs})


def test_an_unknown_gpu_lists_the_names():
    with pytest.raises(ValueError, match="a100-80gb.*labkit.core.gpus.GPU"):
        gpu("a100-81gb")
    assert gpu("h100-80gb") is GPUS["h100-80gb"] and GPUS["h100-80gb"].memory == 81559 * 2**20


def test_a_gpu_of_your_own_needs_bytes():
    with pytest.raises(ValueError, match="memory is bytes"):
        GPU("mine", 24.0, 100.0, 32.0, 12.5)


def test_plan_as_json_round_trips():
    p = plan("deepseek-v2-lite", "a100-80gb", 8, seq=4096, top=3)
    back = json.loads(json.dumps(p.as_dict()))
    assert [c["label"] for c in back["fits"]] == [c.label() for c in p.fits]
    assert back["fits"][0]["memory"]["total"] == p.fits[0].estimate.total
    assert back["rejected"] == p.rejected


def test_cli_prints_a_ranked_table_and_the_rejections(capsys):
    assert main(["plan", "--model", "deepseek-v2-lite", "--gpu", "a100-80gb", "--gpus", "8",
                 "--seq", "4096", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert " 1 " in out and "rejected families (" in out and "assumptions:" in out
    assert ("  - 6 families, the nearest full, ZeRO-0, dp 8, tp 1, pp 1, ep 4: model states "
            "alone need 73.17 GiB per GPU > 72.00 GiB usable") in out


def test_rejections_group_by_reason_without_their_numbers():
    p = plan("llama-2-7b", "a100-80gb", 64, seq=2048, top=1, advice=False)
    groups = p.rejected_by_reason()
    assert sum(g["count"] for g in groups) == len(p.rejected)
    assert len(groups) < len(p.rejected)            # dp 4, 2, 1 with tp 16: one reason
    inside = [g for g in groups if "must stay inside a node" in g["reason"]]
    assert len(inside) == 1 and inside[0]["count"] == sum(
        "must stay inside a node" in why for why in p.rejected.values())
    assert inside[0]["reason"].startswith("full: tp # > # GPUs per node")
    assert p.rejected[inside[0]["example"]] == inside[0]["example_reason"]
    assert json.loads(json.dumps(p.as_dict()))["rejected_by_reason"] == groups


def test_a_group_of_rejections_shows_its_nearest_miss_and_keeps_what_differs_apart():
    """DeepSeek-V2-Lite on one 24 GB card: full fine-tuning's states from 29.26 GiB (offloaded)
    to 234 GiB (ZeRO-0) are one reason, shown by the nearest; LoRA's and QLoRA's stay apart."""
    p = plan("deepseek-v2-lite", "rtx-4090-24gb", 1, seq=2048,
             trainable=("all", "lora", "qlora"), advice=False)
    groups = {g["reason"]: g for g in p.rejected_by_reason()}
    states = groups["full: model states alone need # per GPU > # usable"]
    assert states["count"] == 2 and "29.26 GiB" in states["example_reason"]
    assert states["example"] == "full, optimizer offload, dp 1, tp 1, pp 1"
    assert any(r.startswith("LoRA:") for r in groups) and any(r.startswith("QLoRA:") for r in groups)
    assert all(g["reason"].count("#") and "largest: #" not in g["reason"] for g in groups.values())
    qlora = next(g for r, g in groups.items() if r.startswith("QLoRA:"))
    assert "(largest: parameters #, peak in the backward)" in qlora["reason"]
    assert "recompute full (largest" in qlora["reason"]          # no number eats the comma


def test_the_recompute_policies_searched_can_be_chosen():
    both = plan("llama-2-7b", "rtx-4090-24gb", 1, seq=2048, trainable="lora", top=None,
                advice=False)
    full = plan("llama-2-7b", "rtx-4090-24gb", 1, seq=2048, trainable="lora", recompute="full",
                top=None, advice=False)
    assert {k.recipe.recompute for k in full.fits} == {"full"}
    assert [k.label() for k in full.fits] == [k.label() for k in both.fits
                                              if k.recipe.recompute == "full"]
    assert any("recompute full; not searched" in a for a in full.assumptions)
    with pytest.raises(ValueError, match="recompute"):
        plan("tiny", "a100-80gb", 1, seq=128, recompute="sqrt")
    with pytest.raises(ValueError, match="at least one"):
        plan("tiny", "a100-80gb", 1, seq=128, recompute=())


def test_h800_has_deepseeks_links():
    """DeepSeek-V3's report: NVLink 160 GB/s, InfiniBand 50 GB/s per H800; the H100's compute."""
    h800, h100 = GPUS["h800-80gb"], GPUS["h100-80gb"]
    assert (h800.intra_node_gbps, h800.inter_node_gbps) == (160.0, 50.0)
    assert (h800.memory, h800.bf16_tflops) == (h100.memory, h100.bf16_tflops)


def test_a_table_gpu_is_found_whatever_the_case_of_its_name():
    assert gpu("H100-80GB") is gpu("h100-80gb") is GPUS["h100-80gb"]
    with pytest.raises(ValueError, match="unknown GPU 'H100'"):
        gpu("H100")


def test_a_gpu_of_your_own_from_json_text_or_a_file(tmp_path):
    text = ('{"name": "a6000", "memory_gib": 48, "bf16_tflops": 155, "intra_node_gbps": 32, '
            '"inter_node_gbps": 12.5, "host_ram_per_gpu_gib": 64}')
    mine = gpu(text)
    assert mine == GPU("a6000", 48 * GiB, 155, 32, 12.5, 32.0, 64 * GiB)
    (tmp_path / "a6000.json").write_text(text)
    assert gpu(str(tmp_path / "a6000.json")) == mine
    assert plan("llama-2-7b", mine, 1, seq=1024, trainable="qlora", top=1).gpu == mine
    assert mine.host_gbps == 70.4                                   # the default: a DGX H100's
    assert gpu(text[:-1] + ', "host_gbps": 40}').host_gbps == 40
    assert mine.hbm_gbps == 1000 and gpu(text[:-1] + ', "hbm_gbps": 768}').hbm_gbps == 768


def test_an_offloaded_step_pays_the_hosts_adamw_at_its_dram_bandwidth():
    """ZeRO-Offload's CPU step streams 36 bytes per parameter of this rank's trainable shard
    (DeepSpeed's fp32 gradient copy included) through its share of the node's DRAM at 80% of
    the theoretical bandwidth; the frozen base is not stepped; it is never hidden by overlap."""
    h100 = GPUS["h100-80gb"]
    half = dataclasses.replace(h100, host_gbps=h100.host_gbps / 2)
    shape = dict(gpus=8, gpus_per_node=8, active_params=7 * 10**9, hidden=4096, top_k=0,
                 seq=4096, global_batch=8, micro=1, dp=4, tp=2, pp=1, ep=1, zero_stage=3,
                 schedule="1f1b", v=1, recompute="full", lora=False, rank_params=3 * 10**9,
                 rank_expert_params=10**9, stage_layers=32, stage_moe_layers=0)
    kept = step_time(h100, offload=False, **shape)
    a, b = step_time(h100, offload=True, **shape), step_time(half, offload=True, **shape)
    shard = (3 * 10**9 + 10**9) / 4                     # this tp rank's share, over dp 4
    assert a.host_step == pytest.approx(36 * shard / (70.4e9 * 0.8), rel=1e-12)
    assert b.host_step == pytest.approx(2 * a.host_step, rel=1e-12)
    assert a.offload == b.offload > 0 and kept.offload == kept.host_step == 0
    assert (a.compute, a.dp, a.tp) == (kept.compute, kept.dp, kept.tp)
    assert a.total - kept.total == pytest.approx(a.offload + a.host_step, rel=1e-12)
    assert a.overlapped - kept.overlapped == pytest.approx(a.offload + a.host_step, rel=1e-12)
    frozen = step_time(h100, offload=True, **{**shape, "lora": True}, frozen_params=10**10)
    assert frozen.host_step == a.host_step              # LoRA's base is gathered, not stepped
    one = step_time(h100, offload=True, **{**shape, "zero_stage": 1})
    assert one.host_step == a.host_step and one.offload < a.offload   # stage 3 gathers more


def test_host_bandwidth_is_the_nodes_shared_by_its_ranks():
    p = plan("deepseek-v2-lite", "rtx-4090-24gb", 1, seq=2048, host_ram=512 * GiB, top=1)
    wide = plan("deepseek-v2-lite", "rtx-4090-24gb", 1, seq=2048, host_ram=512 * GiB, top=1,
                host_gbps=4 * 51.2)                      # one card alone on a workstation's DRAM
    assert p.fits[0].layout.offload and wide.fits[0].layout == p.fits[0].layout
    assert wide.fits[0].time.host_step == pytest.approx(p.fits[0].time.host_step / 4)
    with pytest.raises(ValueError, match="host_gbps is the node's DRAM bandwidth"):
        plan("tiny", "a100-80gb", 1, host_gbps=float("nan"))


@pytest.mark.parametrize("text, fix", [
    ('{"name": "x", "memory_gib": 48}', "it needs"),
    ('{"name": "x", "memory_gib": 48, "bf16_tflops": 1, "intra_node_gbps": 1, '
     '"inter_node_gbps": 1, "memory": 5}', "it needs"),
    ('{"name": "x", "memory_gib": "48", "bf16_tflops": 1, "intra_node_gbps": 1, '
     '"inter_node_gbps": 1}', "memory_gib must be a positive finite number"),
    ('{"name": "x", "memory_gib": 48, "bf16_tflops": "fast", "intra_node_gbps": 1, '
     '"inter_node_gbps": 1}', "bf16_tflops must be a positive finite number"),
    ('{"name": 48', "does not parse"),
    ("missing.json", "no GPU file"),
])
def test_a_bad_gpu_json_names_the_fix(text, fix):
    with pytest.raises(ValueError, match=fix):
        gpu(text)


def test_cli_takes_several_trainables_a_headroom_and_a_gpu_as_json(capsys):
    mine = ('{"name": "a6000", "memory_gib": 48, "bf16_tflops": 155, "intra_node_gbps": 32, '
            '"inter_node_gbps": 12.5}')
    assert main(["plan", "--model", "llama-2-70b", "--gpu", mine, "--gpus", "1", "--seq", "2048",
                 "--trainable", "lora", "qlora", "--recompute", "full", "--headroom", "0.05",
                 "--json"]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["gpu"]["name"] == "a6000" and back["usable"] == int(48 * GiB * 0.95)
    assert back["fits"][0]["label"].startswith("QLoRA") and "LoRA, one GPU per replica, dp 1" \
        in back["rejected"]
    assert {f["recipe"]["recompute"] for f in back["fits"]} == {"full"}


def test_advice_names_a_recompute_policy_the_filter_left_out():
    p = plan("llama-2-7b", "rtx-4090-24gb", 1, seq=4096, trainable="lora", recompute="none")
    assert not p.fits and p.advice[0].startswith("recompute full on this GPU (only none searched)")
    assert any("recompute none" in a and "LoRA/QLoRA" in a for a in p.assumptions)


@pytest.mark.parametrize("text, fix", [
    ('{"name": "x", "memory_gib": Infinity, "bf16_tflops": 1, "intra_node_gbps": 1, '
     '"inter_node_gbps": 1}', "holds Infinity"),
    ('{"name": "x", "memory_gib": 8, "bf16_tflops": NaN, "intra_node_gbps": 1, '
     '"inter_node_gbps": 1}', "holds NaN"),
    ('{"name": "x", "memory_gib": 8, "bf16_tflops": 1e999, "intra_node_gbps": 1, '
     '"inter_node_gbps": 1}', "positive finite number"),
    ('{"name": "x", "memory_gib": 1e-12, "bf16_tflops": 1, "intra_node_gbps": 1, '
     '"inter_node_gbps": 1}', "finite number of GiB"),
    ('{"name": "x", "memory": 8, "bf16_tflops": 1, "intra_node_gbps": 1, '
     '"inter_node_gbps": 1}', r"unknown key\(s\) \['memory'\].*missing \['memory_gib'\]"),
])
def test_a_gpu_json_with_no_finite_figure_names_the_fix(text, fix):
    with pytest.raises(ValueError, match=fix):
        gpu(text)


def test_a_gpu_file_is_read_whatever_its_suffix(tmp_path):
    path = tmp_path / "MY_GPU"
    path.write_text('{"name": "mine", "memory_gib": 24, "bf16_tflops": 100, '
                    '"intra_node_gbps": 32, "inter_node_gbps": 12.5}')
    assert gpu(str(path)).memory == 24 * GiB
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="not UTF-8"):
        gpu(str(path))
    with pytest.raises(ValueError, match="is a string"):
        gpu_from_json(123)


@pytest.mark.parametrize("command", ["estimate", "measure", "plan", "presets", "doctor"])
def test_every_commands_help_prints(capsys, command):
    assert exit_code([command, "--help"]) == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fix", [
    (["--gpu", "{bad"], "does not parse"),
    (["--gpu", "h100-80gb", "--headroom", "1"], "fraction"),
    (["--gpu", "h100-80gb", "--recompute", "sqrt"], "invalid choice"),
    (["--gpu", "h100-80gb", "--host-gbps", "nan"], "GB/s as a positive number"),
    (["--gpu", "h100-80gb", "--host-gbps", "0"], "GB/s as a positive number"),
])
def test_cli_bad_gpu_or_headroom_exits_2_naming_the_fix(capsys, argv, fix):
    assert exit_code(["plan", "--model", "tiny", "--gpus", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert fix in err and "Traceback" not in err


def test_cli_host_ram_is_gib_per_node(capsys):
    assert main(["plan", "--model", "deepseek-v2-lite", "--gpu", "rtx-4090-24gb", "--gpus", "1",
                 "--seq", "2048", "--top", "1", "--host-ram", "512", "--json"]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["fits"][0]["layout"]["offload"] is True
    assert any("512.00 GiB of host memory" in a for a in back["assumptions"])
    assert main(["plan", "--model", "deepseek-v2-lite", "--gpu", "rtx-4090-24gb", "--gpus", "1",
                 "--seq", "2048", "--top", "1", "--host-ram", "512", "--host-gbps", "204.8",
                 "--json"]) == 0
    wide = json.loads(capsys.readouterr().out)
    assert wide["fits"][0]["time"]["host_step"] == pytest.approx(
        back["fits"][0]["time"]["host_step"] * 51.2 / 204.8)


def exit_code(argv) -> int:
    """main's exit code, argparse's own (SystemExit) included."""
    try:
        return main(argv)
    except SystemExit as done:
        return done.code


def test_cli_unknown_gpu_exits_2_listing_the_names(capsys):
    assert exit_code(["plan", "--model", "tiny", "--gpu", "tpu", "--gpus", "8"]) == 2
    assert "h100-80gb" in capsys.readouterr().err


@pytest.mark.slow
def test_deepseek_v3_on_2048_gpus_returns_ranked_layouts():
    p = plan("deepseek-v3", "h100-80gb", 2048, seq=4096)
    assert len(p.fits) == 10
    assert all(c.estimate.total <= p.usable for c in p.fits)
    assert all(c.layout.pp > 1 for c in p.fits)     # 671B needs its layers split


def test_zero3_over_dp_is_verified_by_fsdp2_on_a_fake_group_within_3_percent():
    """A ZeRO-3 layout is what FSDP2 runs: its rank's peak on a fake process group of dp ranks
    lands within 3% of the planner's estimate (FSDP2 holds about 1.4 MiB more on small whatever
    the sequence: at 256 tokens that is 3.1%, at 1024 1.2%)."""
    from labkit.course.plan import verify_candidates
    p = plan("small", "a100-80gb", 4, gpus_per_node=4, seq=1024, top=None)
    zero3 = [k for k in p.fits if (k.layout.zero_stage, k.layout.tp, k.layout.pp, k.layout.ep,
                                   k.layout.offload) == (3, 1, 1, 1, False)]
    assert zero3, "no ZeRO-3 layout of small fits 4 GPUs"
    (v,) = verify_candidates(lk.preset("small"), zero3[:1], 1024)
    assert v["result"].startswith("FSDP2 on a fake group of 4")
    assert abs(v["ratio"] - 1) < 0.03


def test_advice_from_a_part_of_a_node_tries_whole_nodes_after_it():
    # 3 GPUs used to try 6 and then 12, which spans nodes of 8, and the advice crashed
    assert [plan_module._twice_the_gpus(n, 8) for n in (1, 3, 4, 6, 8, 16)] == [2, 6, 8, 8, 16, 32]
    p = plan("llama-2-7b", "a100-80gb", 3, seq=2048, global_batch=4)
    assert not p.fits and p.advice and "8 x" in p.advice[0]


def test_lora_of_a_70b_model_on_8_gpus_shards_its_frozen_base_with_fsdp_or_splits_it():
    """The commonest large fine-tuning layout: LoRA with FSDP on 8 x 80 GB (replicas cannot
    hold the 128 GiB base). Checked on fake tensors: FSDP2 over 8, 24.48 GiB vs 23.80 estimated
    then (+2.8%), 24.45 GiB (+0.1%) since FSDP2's held all-gather outputs are counted. Split
    by tp 4 (NeMo's and Megatron's way) the activations fit without recomputation: faster."""
    p = plan("llama-2-70b", "a100-80gb", 8, seq=2048, trainable="lora", top=None)
    fsdp = next(k for k in p.fits if k.family.zero_stage == 3)
    assert fsdp.layout == lk.Layout(dp=8, zero_stage=3) and fsdp.recipe.recompute == "full"
    assert fsdp.label().startswith("LoRA, frozen base sharded (FSDP2), dp 8")
    assert fsdp.estimate.total < p.usable and fsdp.time.dp > 0      # the base is gathered
    # FSDP2's peak: the last block's copy-out beside two all-gather outputs (24.48 GiB measured)
    assert fsdp.estimate.details["peak moment"] == "forward: gather of layer 79"
    assert "model states alone" in p.rejected["LoRA, one GPU per replica, dp 8"]
    assert not any(k.family.zero_stage == 3 and k.recipe.recompute == "none" for k in p.fits)
    best = p.fits[0]
    assert best.label().startswith("LoRA, base split by tp 4, dp 2")
    assert best.recipe.recompute == "none" and best.time.tp > 0
    assert best.layout == lk.Layout(dp=2, tp=4, sp=True)           # the split reaches the estimate
    assert best.time.total < fsdp.time.total and best.time.overlapped < fsdp.time.overlapped
    assert all(k.layout.schedule != "zb-h1" for k in p.fits)      # no weight-gradient work


def test_overlap_hides_dp_pp_and_ep_under_compute_but_not_tp():
    from labkit.predict.steptime import StepTime
    t = StepTime(compute=1.0, bubble=0.1, dp=0.5, tp=0.2, pp=0.1, ep=0.3, offload=0.05)
    assert t.total == pytest.approx(2.25) and t.overlapped == pytest.approx(1.35)
    slow = StepTime(compute=1.0, bubble=0.0, dp=2.0, tp=0.0, pp=0.0, ep=0.4, offload=0.0)
    assert slow.overlapped == pytest.approx(1.0 + 1.4)     # only the compute's length is hidden


def test_the_plan_says_whether_its_first_layout_stays_first_with_overlap():
    # DeepSeek-V3 on 2,048 H800s: a layout whose all-to-all crosses nodes overtakes #1 (tp 8)
    # once pp's and ep's traffic hides under the compute too
    p = plan("deepseek-v3", "h800-80gb", 2048, seq=4096, advice=False)
    k = int(p.overlap.split("#")[1].split()[0])
    assert "becomes first" in p.overlap and k > 1
    assert p.fits[k - 1].time.dp_overlapped > p.fits[0].time.dp_overlapped   # slower with dp's alone
    assert p.fits[k - 1].time.overlapped < 0.99 * p.fits[0].time.overlapped    # faster with
    assert p.overlap in p.text() and p.as_dict()["overlap"] == p.overlap
    kept = plan("llama-2-70b", "h100-80gb", 16, seq=4096, advice=False)
    assert "#1 stays first" in kept.overlap
    assert all(k.time.overlapped >= 0.99 * kept.fits[0].time.overlapped for k in kept.fits)


def test_qlora_of_a_70b_on_two_24_gb_cards_offloads_its_fsdp_sharded_base():
    """FSDP-QLoRA, as Answer.AI and ms-swift run it: sharded over 2 cards the NF4 base still
    leaves no room for the step; with the shards in host memory it fits."""
    p = plan("llama-2-70b", "rtx-4090-24gb", 2, seq=2048, trainable=("qlora",),
             host_ram=128 * GiB)
    best = p.fits[0]
    assert best.layout == lk.Layout(dp=2, zero_stage=3, offload=True)
    assert best.recipe.weight_format == "nf4" and best.recipe.recompute == "full"
    assert "GiB usable" in p.rejected["QLoRA, frozen base sharded (FSDP2), dp 2"]


def test_lora_trains_on_a_base_split_by_tp_pp_or_ep_and_qlora_over_dp_only():
    from labkit.predict.plan_search import _families
    families, _ = _families(lk.preset("deepseek-v2-lite"), 16, 8, ("lora", "qlora"), False)
    split = {(f.trainable, f.tp, f.pp, f.ep, f.dp) for f in families if f.zero_stage == 0}
    assert ("lora", 2, 1, 1, 8) in split and ("lora", 1, 2, 2, 8) in split
    assert ("lora", 8, 2, 1, 1) in split and not any(tp > 8 for _, tp, *_ in split)
    assert {s for s in split if s[0] == "qlora"} == {("qlora", 1, 1, 1, 16)}    # replicas
    assert all(tp * pp * dp == 16 and dp % ep == 0 for _, tp, pp, ep, dp in split)
    p = plan("deepseek-v2-lite", "a100-80gb", 16, seq=2048, trainable="lora", top=None)
    ep = [k for k in p.fits if k.family.ep > 1]
    assert ep and all(k.layout.ep == k.family.ep and k.layout.dp == k.family.dp for k in ep)


def test_qlora_pays_for_dequantising_its_nf4_weights_before_every_matmul():
    """bitsandbytes dequantises each NF4 weight of the blocks (about 2.7 bytes of GPU memory
    traffic) before the forward, the recomputed forward and the backward matmul, at 80% of
    the GPU's memory bandwidth; the embedding, head, norms and routers stay bf16."""
    a100 = GPUS["a100-80gb"]
    shape = dict(gpus=1, gpus_per_node=8, active_params=7 * 10**9, hidden=4096, top_k=0,
                 seq=2048, global_batch=4, micro=1, dp=1, tp=1, pp=1, ep=1, zero_stage=0,
                 offload=False, schedule="1f1b", v=1, lora=True, rank_params=0,
                 rank_expert_params=0, stage_layers=32, stage_moe_layers=0)
    lora = step_time(a100, recompute="full", **shape)
    nf4 = {r: step_time(a100, recompute=r, nf4_params=7 * 10**9, **shape)
           for r in ("none", "selective", "full")}
    slow = step_time(dataclasses.replace(a100, hbm_gbps=1000), recompute="full",
                     nf4_params=7 * 10**9, **shape)
    per_pass = 4 * 7 * 10**9 * (0.5 + 1 / 64 + 12 / 64 + 2) / (2039e9 * 0.8)   # 4 micro-batches
    assert nf4["none"].dequant == pytest.approx(2 * per_pass, rel=1e-12)     # forward, backward
    assert nf4["selective"].dequant == nf4["none"].dequant    # selective keeps matmul outputs
    assert nf4["full"].dequant == pytest.approx(3 * per_pass, rel=1e-12)     # and the recompute
    assert slow.dequant == pytest.approx(nf4["full"].dequant * 2039 / 1000, rel=1e-12)
    assert lora.dequant == 0 and nf4["full"].compute == lora.compute
    assert nf4["full"].total - lora.total == pytest.approx(nf4["full"].dequant)
    assert nf4["full"].overlapped - lora.overlapped == pytest.approx(nf4["full"].dequant)


def test_a_planned_qlora_step_dequantises_the_blocks_linears_only():
    p = plan("llama-2-7b", "a100-80gb", 2, seq=2048, trainable=("lora", "qlora"), top=None)
    c = lk.preset("llama-2-7b")
    targets = c.layers * sum(w.numel for w in lora_targets(c, False))   # no embedding or head
    for k in p.fits:
        m, passes = k.micro_batches, 3 if k.recipe.recompute == "full" else 2
        expected = passes * m * targets * (0.5 + 1 / 64 + 12 / 64 + 2) / (2039e9 * 0.8)
        assert k.time.dequant == pytest.approx(expected if k.recipe.weight_format else 0)
    assert {k.family.zero_stage for k in p.fits if k.recipe.weight_format} >= {0, 3}


def test_long_sequences_are_planned_with_context_parallelism():
    """Llama-3-8B at 64k tokens on 16 H100s: the fastest layouts split each sequence over cp
    ranks (ring attention), each keeping seq / cp tokens, the model states sharded over dp x cp
    by ZeRO; layouts without cp fit too (tp 8 with sequence parallelism), slower."""
    p = plan("llama-3-8b", "h100-80gb", 16, seq=65536, global_batch=16, top=None, advice=False)
    assert p.fits[0].layout.cp > 1 and any(k.layout.cp == 1 for k in p.fits)
    best = p.fits[0]
    long = dataclasses.replace(lk.preset("llama-3-8b"), max_seq=65536)   # RoPE's tables too
    again = lk.estimate(long, best.micro_batch, 65536, recipe=best.recipe, layout=best.layout)
    assert again.total == best.estimate.total <= p.usable
    assert best.time.cp > 0 and f"cp {best.layout.cp}" in best.label()
    flat = next(k for k in p.fits if k.layout.cp == 1)
    assert flat.time.dp_overlapped > best.time.dp_overlapped
    assert flat.time.overlapped > best.time.overlapped
    assert "cp (ring attention)" in p.text()


def test_cp_is_searched_only_where_each_rank_keeps_enough_tokens():
    from labkit.predict.plan_search import CP_MIN_TOKENS, context_degrees
    assert context_degrees(4096, 2048) == [1]                  # DeepSeek-V3's 4k: no cp
    assert context_degrees(65536, 16) == [1, 2, 4, 8, 16]
    assert context_degrees(65536, 64)[-1] == 65536 // CP_MIN_TOKENS
    assert context_degrees(8194, 8) == [1]                   # 2 cp must divide seq
    assert context_degrees(8192, 8) == [1, 2]


def test_the_rings_traffic_per_layer_is_stated():
    """cp ranks pass each layer's K/V block cp - 1 hops forward and backward and its gradient
    cp hops: (2 (cp - 1) + cp) blocks of b (s / cp) x kv_width / tp bf16 numbers per
    micro-batch (tp splits the heads); the gradients are averaged over dp x cp ranks."""
    h100 = gpu("h100-80gb")
    shape = dict(gpus=8, gpus_per_node=8, active_params=10**9, hidden=4096, top_k=0,
                 seq=32768, global_batch=1, micro=1, dp=1, pp=1, ep=1, zero_stage=1,
                 offload=False, schedule="1f1b", v=1, recompute="none", lora=False,
                 rank_params=10**9, rank_expert_params=0, stage_layers=32,
                 stage_moe_layers=0)
    block = 32768 // 8 * 2 * 8 * 128 * 2
    link = h100.intra_node_gbps * 1e9
    t = step_time(h100, cp=8, tp=1, kv_width=2 * 8 * 128, **shape)
    assert t.cp == pytest.approx(32 * (2 * 7 + 8) * block / link)
    split = step_time(h100, cp=4, tp=2, kv_width=2 * 8 * 128, **shape)
    assert split.cp == pytest.approx(32 * (2 * 3 + 4) * (2 * block) / 2 / link)
    assert step_time(h100, tp=1, **shape).cp == 0
    assert t.dp > 0 and step_time(h100, tp=1, **shape).dp == 0   # averaged over the 8 cp ranks


def test_the_ring_hides_only_under_attention():
    from labkit.predict.steptime import StepTime
    t = StepTime(compute=1.0, bubble=0.0, dp=0.0, tp=0.0, pp=0.0, ep=0.0, offload=0.0,
                 cp=0.5, attention=0.2)
    assert t.total == pytest.approx(1.7) and t.overlapped == pytest.approx(1.5)


def test_attention_flops_are_in_the_step_time():
    """PaLM's 12 L H d s per token, halved by the causal mask: at 64k tokens Llama-3-8B's
    attention outnumbers its 6 N D; full recompute runs it once more, selective does not."""
    from labkit.predict.steptime import attention_forward_flops
    c = lk.preset("llama-3-8b")
    assert attention_forward_flops(c, 4096) == 4096**2 * 32 * 32 * 256
    h100 = gpu("h100-80gb")
    shape = dict(gpus=8, gpus_per_node=8, active_params=7 * 10**9, hidden=4096, top_k=0,
                 seq=65536, global_batch=8, micro=1, dp=8, tp=1, pp=1, ep=1, zero_stage=1,
                 offload=False, schedule="1f1b", v=1, lora=False, rank_params=7 * 10**9,
                 rank_expert_params=0, stage_layers=32, stage_moe_layers=0,
                 attention_flops=attention_forward_flops(c, 65536))
    none, selective, full = (step_time(h100, recompute=r, **shape) for r in RECOMPUTE_NAMES)
    assert none.attention > none.compute
    assert selective.attention == none.attention and full.attention == pytest.approx(4 / 3 * none.attention)


def test_8bit_adamw_is_searched_when_asked_and_advised_when_it_alone_fits():
    """LLaMA-2-7B on four 24 GB cards, no offload: AdamW's 12 bytes of state per parameter
    fit no layout; 8-bit AdamW's 6 (its moments 1 byte each) do, and the advice says so."""
    alone = plan("llama-2-7b", "rtx-4090-24gb", 4, seq=2048, offload=False, top=1)
    assert alone.fits == [] and any(a.startswith("8-bit AdamW on these 4 GPUs") for a in alone.advice)
    both = plan("llama-2-7b", "rtx-4090-24gb", 4, seq=2048, offload=False,
                optimizer=("adamw", "adamw-8bit"), top=3, advice=False)
    assert both.fits and all(k.recipe.optimizer == "adamw-8bit" for k in both.fits)
    k = both.fits[0]
    assert "8-bit AdamW" in k.label() and "8-bit AdamW" in both.text()
    again = lk.estimate("llama-2-7b", k.micro_batch, 2048, recipe=k.recipe, layout=k.layout)
    assert again.total == k.estimate.total <= both.usable


def test_adamw_ranks_before_8bit_adamw_on_a_tie_and_8bit_is_never_offloaded():
    p = plan("llama-2-7b", "a100-80gb", 2, seq=2048, optimizer=("adamw", "adamw-8bit"),
             top=None, advice=False)
    first = {}
    for i, k in enumerate(p.fits):
        first.setdefault((k.label().replace(", 8-bit AdamW", ""), k.recipe.optimizer), i)
    pairs = [(i, first[name, "adamw-8bit"]) for (name, o), i in first.items()
             if o == "adamw" and (name, "adamw-8bit") in first]
    assert pairs and all(a < b for a, b in pairs)
    assert not any(k.layout.offload and k.recipe.optimizer == "adamw-8bit" for k in p.fits)
    with pytest.raises(ValueError, match="optimizer"):
        plan("llama-2-7b", "a100-80gb", 2, optimizer="adam")


def test_attention_covers_the_ring_or_the_rest_not_both():
    """Overlapped, the ring hides under attention; dp, pp and ep under what it left."""
    from labkit.predict.steptime import StepTime
    t = StepTime(compute=0.0, bubble=0.0, dp=10.0, tp=0.0, pp=0.0, ep=0.0, offload=0.0,
                 cp=10.0, attention=10.0)
    assert t.total == pytest.approx(30.0) and t.overlapped == pytest.approx(20.0)


def test_an_8bit_adamw_plan_is_verified_with_8bit_adamw():
    p = plan("small", "rtx-4090-24gb", 1, seq=512, optimizer="adamw-8bit", verify=1)
    [v] = p.verified
    assert "8-bit AdamW" in v["label"] and v["ratio"] == pytest.approx(1, abs=0.01)


def test_family_candidates_time_a_layout_the_search_never_ranks():
    """DeepSeek-V3's own layout (ZeRO-1, pp 16, ep 64) on 2,048 H800s: every member of its
    family is timed, fastest first, with its own layout and no estimate; DeepSeek's batch of
    15,360 gives each pipeline more micro-batches."""
    from labkit.predict.plan_search import Family, family_candidates
    own = Family("all", dp=128, zero_stage=1, offload=False, tp=1, pp=16, ep=64)
    found = family_candidates(lk.preset("deepseek-v3"), GPUS["h800-80gb"], 2048, own, seq=4096,
                              recompute=("full",))
    assert found and all(k.family == own and k.estimate is None for k in found)
    assert [k.time.total for k in found] == sorted(k.time.total for k in found)
    assert all((k.layout.pp, k.layout.ep, k.recipe.recompute) == (16, 64, "full") for k in found)
    more = family_candidates(lk.preset("deepseek-v3"), GPUS["h800-80gb"], 2048, own, seq=4096,
                             batch=15_360, recompute=("full",))
    assert max(k.micro_batches for k in more) > max(k.micro_batches for k in found)


def test_family_candidates_given_the_usable_memory_keep_only_layouts_that_fit():
    """Timed only, DeepSeek's layout is fastest under ZB-H1, whose deferred weight gradients
    hold each recomputed micro-batch's linear inputs: 99.84 GiB against 71.68 usable. Given
    ``usable``, each candidate is estimated and only those that fit are kept."""
    from labkit.predict.plan_search import Family, family_candidates
    own = Family("all", dp=128, zero_stage=1, offload=False, tp=1, pp=16, ep=64)
    c, gpu = lk.preset("deepseek-v3"), GPUS["h800-80gb"]
    timed = family_candidates(c, gpu, 2048, own, seq=4096, recompute=("full",))
    usable = plan("deepseek-v3", "h800-80gb", 2048, seq=4096, top=1).usable
    fitting = family_candidates(c, gpu, 2048, own, seq=4096, recompute=("full",), usable=usable)
    assert timed[0].layout.schedule == "zb-h1"
    assert lk.estimate(c, 1, 4096, recipe=timed[0].recipe, layout=timed[0].layout).total > usable
    assert fitting and all(k.estimate.total <= usable for k in fitting)
    assert [k.time.total for k in fitting] == sorted(k.time.total for k in fitting)
    assert {k.label() for k in fitting} < {k.label() for k in timed}


def test_hsdp_is_searched_where_the_data_ranks_span_nodes_and_keeps_the_gathers_inside():
    """Across nodes the planner also tries ZeRO inside a node's data ranks, replicated across
    (HSDP): a larger shard per GPU, for ZeRO-3's all-gathers on NVLink instead of the network."""
    from labkit.predict.plan_search import _families
    from labkit.predict.steptime import step_time
    families, _ = _families(lk.preset("llama-2-7b"), 32, 8, ("all",), False)
    hsdp = {(f.zero_stage, f.tp, f.dp, f.replicas) for f in families if f.replicas > 1}
    assert (3, 1, 32, 4) in hsdp and (3, 2, 16, 4) in hsdp and not any(t == 8 for _, t, *_ in hsdp)
    shape = dict(gpus=32, gpus_per_node=8, active_params=6.5 * 10**9, hidden=4096, top_k=0,
                 seq=4096, global_batch=32, micro=1, dp=32, tp=1, pp=1, ep=1, zero_stage=3,
                 offload=False, schedule="1f1b", v=1, recompute="none", lora=False,
                 rank_params=6.5 * 10**9, rank_expert_params=0, stage_layers=32,
                 stage_moe_layers=0)
    a100 = GPUS["a100-80gb"]
    assert step_time(a100, **shape, replicas=4).dp < step_time(a100, **shape).dp / 2
    p = plan("llama-2-7b", "a100-40gb", 32, seq=4096)
    assert "inside 4 replicas of 8 (HSDP)" in p.fits[0].label()
    assert p.fits[0].layout.replicas == 4 and p.fits[0].layout.shard_ranks == 8
