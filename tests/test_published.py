"""Runs their authors published as fitting their GPUs fit in the estimate, with the techniques
they used; DeepSeek-V3's own layout (FP8, not modelled) fits in bf16 only with full recompute."""
from dataclasses import replace

import pytest

import labkit as lk
from labkit.course.published import LLAMA_65B, RUNS, deepseek_v3_own_layout

GIB = 2 ** 30


@pytest.mark.parametrize("run", RUNS, ids=[r.name.split(":")[0] for r in RUNS])
def test_each_published_run_fits_its_gpu(run):
    c = run.check()
    assert c["fits"], (run.name, lk.fmt_bytes(c["per_gpu"]), lk.fmt_bytes(c["usable"]))


def test_the_65b_qlora_run_is_near_its_cards_edge_and_fp32_moments_would_cross_it():
    """40.42 GiB of 43.19 usable on a 48 GB RTX A6000; the paper's paged 32-bit AdamW keeps the
    adapters' moments in fp32 (2.98 GiB more: 43.40 GiB), which is why it pages them out."""
    guanaco = RUNS[0]
    c = guanaco.check()
    assert 0.9 * c["usable"] < c["per_gpu"] <= c["usable"]
    adapters = lk.estimate(guanaco.model, guanaco.batch, guanaco.seq, recipe=guanaco.recipe)
    fp32_moments = 2 * adapters.details["model states"]["optimizer"]       # bf16 -> fp32
    assert c["per_gpu"] + fp32_moments / 2 > c["usable"]


def test_llama_65b_has_the_papers_parameter_count():
    assert lk.count_params(LLAMA_65B).total == pytest.approx(65.2e9, rel=0.003)   # Table 2: 65.2B


def test_deepseek_v3s_own_layout_fits_in_bf16_only_with_full_recompute():
    """ZeRO-1 with ep 64 and pp 16: the experts' states sharded over their 2 dp copies (model
    states about 10 GiB per GPU); in bf16 the activations of 16 micro-batches in flight do not
    fit without full recomputation (DeepSeek stores them in FP8 and recomputes less)."""
    rows = {r["recompute"]: r for r in deepseek_v3_own_layout()}
    assert [rows[k]["fits"] for k in ("none", "selective", "full")] == [False, False, True]
    assert 8 * GIB < rows["selective"]["states"] < 12 * GIB
    assert rows["selective"]["activations"] > 0.8 * rows["selective"]["per_gpu"]


def test_fsdp_qlora_of_a_70b_on_two_24_gb_cards_needs_its_cpu_offload():
    """FSDP shards the 70B's NF4 codes and scales over 2 GPUs, about 17 GiB each (labkit's
    NF4), and the step's working set on top crosses a 24 GB card; offloaded, the shards live in
    host memory."""
    run = next(r for r in RUNS if r.name.startswith("ms-swift"))
    kept = replace(run, layout=replace(run.layout, offload=False)).check()
    assert run.check()["fits"] and not kept["fits"]
    est = lk.estimate(run.model, run.batch, run.seq, recipe=run.recipe, layout=run.layout)
    assert 17 * GIB < est.details["host memory"] < 22 * GIB
