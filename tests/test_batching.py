"""Packing wastes least and changes no loss; accumulation changes no gradient and no state."""
import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.batching import (IGNORE, accumulate_gradients, bucket_batches, document_lengths,
                             first_fit_decreasing, make_documents, measure_accumulation,
                             pack_batches, packed_loss_equals_per_document_loss, pad_batches)
from labkit.model import document_mask

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
