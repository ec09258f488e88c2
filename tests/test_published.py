"""Runs their authors published as fitting their GPUs fit in the estimate, with the techniques
they used; DeepSeek-V3's own layout (FP8, not modelled) fits in bf16 only with full recompute."""
from dataclasses import replace

import pytest

import labkit as lk
from labkit.course.published import (HF_QLORA, LLAMA_3_CONTEXT, LLAMA_65B, RUNS,
                                     deepseek_v3_own_layout, hf_longest_context,
                                     longest_sequence, memory_line)

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


def test_at_hf_qloras_longest_sequences_the_estimate_is_81_to_93_percent_of_the_card():
    """A characterisation of a known shortfall (Unsloth's table of Hugging Face's longest QLoRA
    sequence per card, HF's recipe as labkit reads it): where HF runs out the estimate comes to
    81-93% of the card, and no length fits where HF fits none. Its fixed bytes agree with HF's
    line within 5%; per token it is about a fifth short. A fix to the estimate that closes the
    gap should move these bounds."""
    rows = hf_longest_context()
    for r in rows:
        if r["hf"] is None:
            assert r["labkit"] == 0, r
        else:
            assert 0.80 < r["at_hf"] / r["card"] < 0.94, r
            assert r["labkit"] > r["hf"], r
    line = memory_line(rows)
    assert line["labkit"]["fixed"] == pytest.approx(line["hf"]["fixed"], rel=0.05)
    assert 0.75 < line["labkit"]["per_token"] / line["hf"]["per_token"] < 0.82


def test_hfs_fp32_upcasts_cost_the_70b_the_48_gib_card():
    """In HF's recipe (fp32 embeddings, head, norms and adapters) no length of the 70B's QLoRA
    fits 48 GiB; in bf16, on the whole card (no headroom), over 2,048 tokens do."""
    cfg, card = lk.preset("llama-3-70b", max_seq=LLAMA_3_CONTEXT), 48 * GIB
    assert longest_sequence(cfg, card, HF_QLORA) == 0
    assert longest_sequence(cfg, card, replace(HF_QLORA, precision="bf16")) > 2048


def test_the_planners_bf16_qlora_plans_are_longer_than_hfs_on_every_card():
    """The planner plans QLoRA in bf16 within 90% of the card: longer than HF reached on every
    card, and some length even where HF runs out at any. In HF's recipe, 90% of the card stays
    within HF's length only where the estimate at HF's length is over 90%: the 8B's 12 GiB and
    the 70B's 80 GiB."""
    planner = hf_longest_context(replace(HF_QLORA, precision="bf16"), fraction=0.9)
    assert all(r["labkit"] > (r["hf"] or 0) for r in planner)
    hf_recipe = hf_longest_context(fraction=0.9)
    within = {(r["model"], r["card"] // GIB) for r in hf_recipe if r["hf"] and r["labkit"] <= r["hf"]}
    assert within == {("llama-3-8b", 12), ("llama-3-70b", 80)}
