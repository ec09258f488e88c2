"""Packing wastes least and changes no loss; accumulation changes no gradient and no state."""
import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.training.batching import (IGNORE, accumulate_gradients, bucket_batches,
                                      document_lengths, first_fit_decreasing, make_documents,
                                      measure_accumulation, pack_batches,
                                      packed_loss_equals_per_document_loss, pad_batches,
                                      packed_gradients, packed_step_memory, packing_inputs)
from labkit.transformer.model import document_mask

HAND = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8]), torch.tensor([9, 10])]


def test_document_lengths_are_seeded_log_normal_and_clipped():
    lengths = document_lengths(2000, max_len=1024, median=256, seed=3)
    assert lengths == document_lengths(2000, max_len=1024, median=256, seed=3)
    assert lengths != document_lengths(2000, max_len=1024, median=256, seed=4)
    assert min(lengths) >= 16 and max(lengths) == 1024          # the tail reaches the clip
    assert sorted(lengths)[1000] == pytest.approx(256, rel=0.1)


def test_padding_statistics_on_a_hand_made_example():
    longest = pad_batches(HAND, batch_size=2)                   # [3, 5] -> 5; [2] -> 2
    assert (longest.tokens, longest.padding) == (10, 2)
    assert longest.nbytes == (2 * 5 + 1 * 2) * 8 * 2             # int64 tokens and targets
    assert pad_batches(HAND, batch_size=2, pad_to=8).padding == 6 + 8
    assert bucket_batches(HAND, batch_size=2).padding == 1      # [2, 3] -> 3; [5]
    first = longest.batches[0]
    assert first.tokens.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert first.targets.tolist() == [[2, 3, IGNORE, IGNORE, IGNORE], [5, 6, 7, 8, IGNORE]]
    assert first.mask_bytes == 0 and first.position_ids is None


def test_packing_restarts_positions_and_numbers_documents_in_each_row():
    assert first_fit_decreasing([3, 5, 2], capacity=8) == [[1, 0], [2]]
    packed = pack_batches(HAND, seq=8, rows_per_batch=2)
    row = packed.batches[0]
    assert row.tokens[0].tolist() == [4, 5, 6, 7, 8, 1, 2, 3]
    assert row.targets[0].tolist() == [5, 6, 7, 8, IGNORE, 2, 3, IGNORE]  # never across documents
    assert row.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert row.doc_ids.tolist() == [[0] * 5 + [1] * 3, [0, 0] + [-1] * 6]
    assert (packed.tokens, packed.padding, row.mask_bytes) == (10, 6, 2 * 8 * 8)
    with pytest.raises(ValueError, match="does not fit in rows of 4"):
        pack_batches(HAND, seq=4)


def test_mask_is_block_diagonal_and_causal():
    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1, -1]]), torch.float32) == 0  # allowed
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert mask.shape == (1, 1, 6, 6) and torch.equal(mask[0, 0], expected)


def test_masked_attention_on_a_packed_row_equals_attention_on_each_document():
    torch.manual_seed(0)
    lengths = [5, 9, 2]
    q, k, v = (torch.randn(1, 4, sum(lengths), 8) for _ in range(3))      # (B, H, T, d)
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids, q.dtype))
    pieces = zip(*(t.split(lengths, dim=2) for t in (q, k, v)))              # per document
    alone = [F.scaled_dot_product_attention(*qkv, is_causal=True) for qkv in pieces]
    torch.testing.assert_close(packed, torch.cat(alone, dim=2))


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_packed_loss_equals_the_per_document_losses_weighted_by_tokens(name):
    torch.manual_seed(0)
    model = lk.build_model(lk.preset(name))
    docs = make_documents(document_lengths(10, max_len=48, median=20, seed=1))
    check = packed_loss_equals_per_document_loss(model, docs, seq=64)
    # equal up to float rounding: the masked kernel sums in another order than the causal one
    assert check.packed == pytest.approx(check.document_mean, rel=1e-5, abs=1e-6)
    leaky = packed_loss_equals_per_document_loss(model, docs, seq=64, isolate=False)
    assert abs(leaky.packed - leaky.document_mean) > 100 * abs(check.packed - check.document_mean)


def test_a_packed_forward_keeps_one_fp32_mask_for_all_layers_not_one_per_layer():
    model = lk.build_model(lk.preset("tiny-moe"))                       # 3 layers
    row = pack_batches(make_documents([20, 30, 14]), seq=64).batches[0]

    def kept(packing):
        with lk.MemoryTracker(model) as mt:
            with mt.phase("forward"):
                # the loss holds what autograd saved
                loss = model(row.tokens, row.targets, **packing)  # noqa: F841
            return mt.by_category["activations"]

    extra = kept(dict(position_ids=row.position_ids, doc_ids=row.doc_ids)) - kept({})
    # one fp32 (B, 1, T, T) mask (and the RoPE tables gathered at the positions), not 3
    assert 4 * 64 * 64 <= extra < 2 * 4 * 64 * 64


def test_packing_wastes_less_than_bucketing_which_wastes_less_than_padding():
    docs = make_documents(document_lengths(1000, max_len=1024))
    waste = {b.name: b.waste for b in (pad_batches(docs, 8, pad_to=1024), pad_batches(docs, 8),
                                       bucket_batches(docs, 8), pack_batches(docs, 1024, 8))}
    assert (waste["packing"] < waste["length buckets"] < waste["pad to longest"]
            < waste["pad to max"])
    assert waste["packing"] < 0.01 and waste["pad to longest"] > 0.5


def _gradients(model, micro_batches):
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, micro_batches)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_accumulated_gradients_equal_the_full_batch_gradients(name):
    torch.manual_seed(0)
    model = lk.build_model(lk.preset(name))
    tokens = torch.randint(0, model.cfg.vocab_size, (4, 33))
    x, y = tokens[:, :-1], tokens[:, 1:]
    full = _gradients(model, [(x, y)])
    for k in (2, 4):                                  # equal micro-batches: each loss x 1/k
        micro = _gradients(model, list(zip(x.split(4 // k), y.split(4 // k))))
        for a, b in zip(full, micro):                 # allclose: the sums run in another order
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_ragged_micro_batches_need_weights_by_tokens_not_one_over_k():
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("tiny"))
    docs = make_documents([40, 12, 30, 9])
    whole = pad_batches(docs, 4).batches[0]
    micro = [(b.tokens, b.targets) for b in pad_batches(docs, 2).batches]   # 50 and 37 predictions
    full, accumulated = _gradients(model, [(whole.tokens, whole.targets)]), _gradients(model, micro)
    for a, b in zip(full, accumulated):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)
    for x, y in micro:                                # the naive 1/k scaling
        (model(x, y) / len(micro)).backward()
    assert not torch.allclose(full[0], next(model.parameters()).grad, rtol=1e-3)


def test_optimizer_state_and_gradients_do_not_grow_with_accumulation_steps():
    m = {k: measure_accumulation("tiny", micro_batch=1, steps=k, seq=64) for k in (1, 2, 4)}
    assert m[1].optimizer == m[2].optimizer == m[4].optimizer
    assert m[1].grads == m[2].grads == m[4].grads == 4 * lk.count_params("tiny").total
    token_ids = 8 * (64 + 1)                          # one more micro-batch's int64 tokens
    assert m[4].activations - m[1].activations == 3 * token_ids
    # from the second micro-batch on, the gradients live through the forward pass too
    assert m[4].peak == m[2].peak + 2 * token_ids > m[1].peak


def test_activations_scale_with_the_micro_batch_not_the_batch():
    one_by_four = measure_accumulation("tiny", micro_batch=1, steps=4, seq=64)
    four_by_one = measure_accumulation("tiny", micro_batch=4, steps=1, seq=64)
    assert four_by_one.activations > 3 * one_by_four.activations
    assert four_by_one.peak > one_by_four.peak


def test_buckets_lower_the_average_not_the_largest_batch_and_masks_are_counted_per_step():
    docs = make_documents(document_lengths(400, max_len=512, median=64, seed=0), vocab_size=64)
    padded, buckets = pad_batches(docs, 8, pad_to=512), bucket_batches(docs, 8)
    assert buckets.padding < padded.padding / 10
    assert buckets.largest_batch == padded.largest_batch == 8 * 512   # the longest documents
    packed = pack_batches(docs, 512, rows_per_batch=4)
    assert packed.largest_mask_bytes == 4 * 512 * 512                 # one step's (4, 1, T, T)
    assert packed.mask_bytes == len(packed.batches) * 4 * 512 * 512


# ---- token budgets: a dynamic batch size ------------------------------------------------------
def test_a_token_budget_keeps_every_batch_within_budget_and_every_document_once():
    from labkit.training.batching import budget_batches
    lengths = document_lengths(500, max_len=512, median=64, seed=2)
    docs = make_documents(lengths)
    run = budget_batches(docs, max_tokens=2048)
    assert all(b.tokens.numel() <= 2048 for b in run.batches)
    seen = sorted(tuple(row[:int(n) + 1].tolist()) for b in run.batches
                  for row, n in zip(b.tokens, (b.targets != IGNORE).sum(1)))
    assert seen == sorted(tuple(d.tolist()) for d in docs)  # each document exactly once
    assert run.tokens == sum(lengths)
    sizes = [len(b.tokens) for b in run.batches]            # short documents come many a batch
    assert sizes[0] > 50 and sizes[-1] <= 4
    # a batch closes only when the next (longer) document would break the budget
    for b, nxt in zip(run.batches, run.batches[1:]):
        assert (len(b.tokens) + 1) * nxt.tokens.shape[1] > 2048


def test_a_token_budget_fills_the_planned_peak_where_fixed_batches_do_not():
    from labkit.training.batching import compare_batching
    lengths = document_lengths(1000, max_len=1024, median=128, seed=0)
    fixed, longest, buckets, budget, packed = compare_batching(lengths, max_tokens=8 * 1024)
    assert fixed.largest_batch == budget.largest_batch == packed.largest_batch == 8 * 1024
    assert budget.steps < buckets.steps / 3                  # many short documents a step
    assert budget.utilisation > 0.85 > 0.3 > buckets.utilisation
    assert buckets.utilisation == pytest.approx(sum(lengths) / (buckets.steps * 8 * 1024))


def test_a_bad_budget_raises_and_names_the_fix():
    from labkit.training.batching import budget_batches, compare_batching
    docs = make_documents([10, 40, 20])
    with pytest.raises(ValueError, match="not fit in a budget of 32 positions; raise max_tokens"):
        budget_batches(docs, max_tokens=32)
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
            budget_batches(docs, max_tokens=bad)
    with pytest.raises(ValueError, match="below the longest document"):
        compare_batching([10, 40, 20], max_tokens=32)


# ---- variable-length attention: packed rows without a mask -------------------------------------
def test_cu_seqlens_are_the_document_offsets_with_each_rows_padding_as_a_run():
    from labkit.transformer.model import cu_seqlens
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, 0, 0]])
    assert cu_seqlens(doc_ids) == (0, 2, 5, 6, 12)


def _mla_config():
    return lk.preset("deepseek-v2-lite").replace(
        hidden=64, layers=2, heads=4, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8,
        v_head_dim=16, dense_layers=2, ffn=128, vocab_size=256, max_seq=256)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "mla"])
def test_varlen_attention_gives_the_masked_loss_and_gradients(name):
    torch.manual_seed(0)
    model = lk.build_model(_mla_config() if name == "mla" else lk.preset(name))
    docs = make_documents(document_lengths(12, max_len=60, median=20, seed=1))
    batch = pack_batches(docs, 64, rows_per_batch=3).batches[0]
    runs = {a: packed_gradients(model, batch, a) for a in ("mask", "varlen", "causal")}
    assert not torch.allclose(runs["mask"][0], runs["causal"][0], rtol=1e-4)   # leaks differ
    for a, b in zip(runs["mask"], runs["varlen"]):      # other kernels, other summation order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    check = packed_loss_equals_per_document_loss(model, docs, seq=64, varlen=True)
    assert check.packed == pytest.approx(check.document_mean, rel=1e-5, abs=1e-6)


def test_varlen_attention_drops_the_mask_and_keeps_no_log_sum_exp():
    cfg = lk.preset("tiny")
    model = lk.build_model(cfg)
    batch = pack_batches(make_documents([100, 60, 50, 40, 6]), seq=128, rows_per_batch=2).batches[0]
    B, T = batch.tokens.shape
    mem = {a: packed_step_memory(model, batch, a) for a in ("mask", "varlen", "causal")}
    mask, lse = 4 * B * T * T, 4 * B * cfg.heads * T             # fp32 (B,1,T,T); (B,H,T) a layer
    assert mem["mask"].kept - mem["varlen"].kept == mask + cfg.layers * lse
    assert mem["mask"].peak - mem["varlen"].peak == mask + cfg.layers * lse
    # against plain causal attention: the RoPE tables gathered at the positions and the
    # position ids, less the log-sum-exp varlen recomputes
    tables = 2 * B * T * cfg.head_dim * 4
    assert mem["varlen"].kept - mem["causal"].kept == tables + 8 * B * T - cfg.layers * lse


def test_varlen_needs_document_ids_and_packing_needs_a_known_attention():
    model = lk.build_model(lk.preset("tiny"))
    with pytest.raises(ValueError, match="pass doc_ids"):
        model(torch.zeros(1, 8, dtype=torch.long), varlen=True)
    batch = pack_batches(HAND, seq=8).batches[0]
    with pytest.raises(ValueError, match="attention must be one of mask, varlen, causal"):
        packing_inputs(batch, "flash")
    with pytest.raises(ValueError, match="not packed"):
        packing_inputs(pad_batches(HAND, 2).batches[0])
