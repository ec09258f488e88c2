"""2:4 sparsity and low-rank factorisation: pruning keeps the 2 largest of every 4, the stored
form round-trips and costs 9 bits per parameter in fp16, a truncated SVD's error is the norm of
the dropped singular values, and the rank for a saving is the largest that fits."""
import pytest
import torch

from labkit.quantisation.compress import (METHODS, compress_2_4, compress_weight, decompress_2_4,
                                          low_rank, prune_2_4, rank_for_saving)
from labkit.quantisation.quant import dequantize, quantize_int8

torch.set_num_threads(1)


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- 2:4 sparsity

def test_pruning_keeps_exactly_the_two_largest_of_every_four():
    w = gaussian(16, 32)
    groups, pruned = w.reshape(16, 8, 4), prune_2_4(w).reshape(16, 8, 4)
    kept = pruned != 0
    assert (kept.sum(dim=-1) == 2).all()
    assert torch.equal(pruned[kept], groups[kept])                         # kept values unchanged
    smallest_kept = groups.abs().masked_fill(~kept, float("inf")).amin(dim=-1)
    largest_dropped = groups.abs().masked_fill(kept, 0).amax(dim=-1)
    assert (smallest_kept > largest_dropped).all()


def test_pruning_needs_groups_of_four_input_features():
    with pytest.raises(ValueError, match="multiple of 4"):
        prune_2_4(torch.ones(8, 6))
    with pytest.raises(ValueError, match="multiple of 4"):
        compress_2_4(torch.ones(8, 6))
    with pytest.raises(ValueError, match=r"\(out, in\)"):
        prune_2_4(torch.ones(16))
    with pytest.raises(ValueError, match="stored as one of"):
        compress_2_4(torch.ones(8, 8), torch.int32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(8, 16), (5, 12)])                  # (5, 12): 15 groups, odd
def test_compress_round_trip_is_exact_for_a_pruned_weight(dtype, shape):
    w = prune_2_4(gaussian(*shape)).to(dtype)
    s = compress_2_4(w, dtype)
    assert s.values.dtype == dtype and s.values.shape == (shape[0], shape[1] // 2)
    assert torch.equal(decompress_2_4(s), w.float())


def test_compress_prunes_then_rounds_to_the_stored_dtype():
    w = gaussian(8, 16)
    approx, nbytes = compress_weight("2:4 fp16", w)
    assert torch.equal(approx, prune_2_4(w).half().float())
    assert nbytes == compress_2_4(w).nbytes


def test_metadata_is_a_nibble_of_kept_positions_two_groups_per_byte():
    # group 0 keeps positions 1 and 3 (nibble 1*4+3 = 7), group 1 keeps 0 and 2 (nibble 2)
    w = torch.tensor([[0.0, 5.0, 0.0, -7.0, 1.0, 0.0, 2.0, 0.0]])
    s = compress_2_4(w)
    assert s.metadata.tolist() == [0x72]
    assert s.values.tolist() == [[5.0, -7.0, 1.0, 2.0]]


def test_fp16_nbytes_is_the_hand_count_nine_bits_per_parameter():
    s = compress_2_4(gaussian(8, 16))
    values = 8 * 8 * 2                  # 8 rows x 8 kept values x 2 bytes
    metadata = 8 * 4 // 2               # 8 rows x 4 groups, one nibble each, 2 per byte
    assert s.nbytes == values + metadata == 144
    assert s.bits_per_param == 9.0      # 16 -> 9 bits: 43.75% saved, not 50%


def test_odd_group_count_pads_one_nibble():
    s = compress_2_4(gaussian(5, 12))   # 15 groups -> 8 bytes of metadata
    assert s.metadata.numel() == 8
    assert s.nbytes == 5 * 6 * 2 + 8


def test_int8_values_are_per_row_absmax_codes_of_the_pruned_weight():
    w = gaussian(8, 16)
    s = compress_2_4(w, torch.int8)
    expected = dequantize(quantize_int8(prune_2_4(w), "absmax", "channel"))
    assert torch.equal(decompress_2_4(s), expected)
    assert s.nbytes == 8 * 8 + 16 + 8 * 4           # codes + metadata + fp32 row scales
    big = compress_2_4(gaussian(64, 1024), torch.int8)
    assert big.bits_per_param == pytest.approx(5 + 32 / 1024)   # 8 -> 5 bits + the scales


# ----------------------------------------------------------------------------- low rank

def test_an_exactly_rank_3_matrix_is_recovered_at_rank_3():
    w = gaussian(40, 3, seed=1) @ gaussian(3, 30, seed=2)
    f = low_rank(w, 3, torch.float32)
    assert f.a.shape == (3, 30) and f.b.shape == (40, 3)
    assert ((f.dense() - w).norm() / w.norm()).item() < 1e-5


@pytest.mark.parametrize("rank", [1, 8, 20])
def test_low_rank_error_is_the_norm_of_the_dropped_singular_values(rank):
    w = gaussian(48, 32)
    s = torch.linalg.svdvals(w.double())
    expected = (s[rank:].pow(2).sum().sqrt() / w.double().norm()).item()
    f = low_rank(w, rank, torch.float32)
    assert ((f.dense() - w).norm() / w.norm()).item() == pytest.approx(expected, rel=1e-5)


def test_low_rank_bytes_are_rank_times_out_plus_in():
    f = low_rank(gaussian(64, 32), 8)                       # fp16 factors by default
    assert f.a.dtype == f.b.dtype == torch.float16
    assert f.nbytes == 8 * (64 + 32) * 2 == 1536
    assert f.bits_per_param == 6.0


def test_low_rank_rejects_bad_ranks():
    w = gaussian(16, 8)
    for rank in (0, -1, 9, 2.5):
        with pytest.raises(ValueError, match="rank"):
            low_rank(w, rank)


@pytest.mark.parametrize("out,inp,saving,rank", [
    (256, 256, 0.25, 96),               # floor(0.375 d)
    (4096, 4096, 0.25, 1536),
    (100, 100, 0.25, 37),               # 37.5 -> 37
    (100, 100, 0.0, 50),                # break-even: r (out + in) = out in
    (4096, 11008, 0.25, 2238),          # floor(0.75 * 4096 * 11008 / 15104)
    (256, 256, 0.5, 64),
])
def test_rank_for_saving_is_the_largest_rank_that_fits(out, inp, saving, rank):
    assert rank_for_saving(out, inp, saving) == rank
    assert rank * (out + inp) <= (1 - saving) * out * inp < (rank + 1) * (out + inp)


def test_rank_for_saving_rejects_impossible_savings():
    for saving in (1.0, -0.1, 25):
        with pytest.raises(ValueError, match="saving"):
            rank_for_saving(64, 64, saving)
    with pytest.raises(ValueError, match="even rank 1"):
        rank_for_saving(4, 4, 0.9)


# ----------------------------------------------------------------------------- one layer

def test_compress_weight_stores_what_each_method_promises():
    w = gaussian(256, 256)
    dense_fp16 = 256 * 256 * 2
    approx, nbytes = compress_weight("low-rank 25% fp16", w)
    assert nbytes == 96 * 512 * 2 == 0.75 * dense_fp16
    assert approx.dtype == torch.float32 and approx.shape == w.shape
    assert torch.linalg.matrix_rank(approx).item() == 96
    assert compress_weight("2:4 fp16", w)[1] == dense_fp16 * 9 // 16
    assert compress_weight("low-rank 50% fp32", w)[1] == 64 * 512 * 4
    for method in METHODS:
        approx, _ = compress_weight(method, w)
        assert approx.shape == w.shape


def test_compress_weight_names_the_methods_it_knows():
    with pytest.raises(ValueError, match="2:4 fp16"):
        compress_weight("2:8 fp16", gaussian(8, 8))
    with pytest.raises(ValueError, match="low-rank 25% fp16"):
        compress_weight("low-rank 25% int8", gaussian(8, 8))
