"""A DataLoader's workers hand batches over in /dev/shm: the bytes follow the formula, a tmpfs
that is too small fails with an error naming shared memory, and the host is left unchanged."""
import pytest
import torch

from labkit.host import shm
from labkit.host.shm import (DOCKER_DEFAULT_SHM, SEMAPHORE_SLACK, batch_shm_bytes, docker_shm_flag,
                             measure_loader_shm, namespaces_available, reproduce_small_shm,
                             shm_needed)

MiB, GiB = 2**20, 2**30
TOKENS = 8 * 4096 * 8                  # an LLM batch: 8 x 4096 int64 token ids
IMAGES = 64 * 3 * 224 * 224 * 4        # an image batch: 64 x 3 x 224 x 224 fp32
private = pytest.mark.skipif(not namespaces_available()[0], reason=namespaces_available()[1])


def test_a_batch_takes_whole_pages_and_file_system_adds_a_refcount_header():
    assert batch_shm_bytes(1) == 4096
    assert batch_shm_bytes(4096) == 4096
    assert batch_shm_bytes(4096, "file_system") == 8192       # 4096 + 64 bytes spill a page
    assert batch_shm_bytes(4 * MiB, "file_system") == 4 * MiB + 4096


def test_a_loader_needs_its_in_flight_batches_plus_two():
    assert shm_needed(TOKENS, num_workers=2, prefetch_factor=2) == (2 * 2 + 2) * 262144 == 1572864
    assert shm_needed(4 * MiB, num_workers=4, prefetch_factor=1) == 6 * 4 * MiB
    assert shm_needed(4 * MiB, num_workers=0) == 0             # the main process loads: no shm


def test_claim_23_token_batches_fit_dockers_64_mib_and_image_batches_do_not():
    tokens = shm_needed(TOKENS, num_workers=8, prefetch_factor=2)
    images = shm_needed(IMAGES, num_workers=8, prefetch_factor=2)
    assert tokens == 18 * 262144 == 4718592 < DOCKER_DEFAULT_SHM == 64 * MiB
    assert images == 18 * 38535168 == 693633024                # 9408 whole pages per batch
    assert DOCKER_DEFAULT_SHM < images < 8 * GiB
    # safe sizes: twice every rank's need, + 1 GiB for NCCL, at least Docker's 64 MiB, as a
    # power of two MiB
    assert docker_shm_flag(images) == "--shm-size=2g"                  # 1,323 MiB
    assert docker_shm_flag(images, ranks=8, nccl=True) == "--shm-size=16g"   # 10,584 + 1,024
    assert docker_shm_flag(tokens) == "--shm-size=64m"                 # never below the default
    assert docker_shm_flag(tokens, ranks=8, nccl=True) == "--shm-size=2g"    # 72 + 1,024 MiB
    assert docker_shm_flag(40 * MiB) == "--shm-size=128m"              # 80 MiB -> 128
    assert docker_shm_flag(512 * MiB) == "--shm-size=1g"               # exactly 2 x 512 MiB


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="batch_bytes must be a positive integer"):
        shm_needed(0, 2, 2)
    with pytest.raises(ValueError, match="non-negative integer"):
        shm_needed(MiB, -1, 2)
    with pytest.raises(ValueError, match="prefetch_factor must be a positive integer"):
        shm_needed(MiB, 2, 0)
    with pytest.raises(ValueError, match="use one of file_descriptor, file_system"):
        batch_shm_bytes(MiB, "fd")
    with pytest.raises(ValueError, match="num_workers must be a positive integer"):
        measure_loader_shm(MiB, num_workers=0)
    with pytest.raises(ValueError, match="pass shm_bytes below 25165824"):
        reproduce_small_shm(shm_bytes=64 * MiB, batch_bytes=4 * MiB)


def test_on_the_shared_dev_shm_the_peak_is_near_the_formula():
    # /dev/shm is the machine's: another process's files are noise, so allow a batch either way
    m = measure_loader_shm(4 * MiB, num_workers=2, prefetch_factor=2, private=False, hold_s=0.05)
    assert not m.private and len(m.per_batch) == 12
    assert m.steady - m.batch_shm <= m.peak <= m.predicted + m.batch_shm + SEMAPHORE_SLACK


def test_file_descriptor_shows_no_files_and_file_system_leaves_named_ones():
    before = torch.multiprocessing.get_sharing_strategy()
    fd = measure_loader_shm(MiB, strategy="file_descriptor", batches=6, private=False)
    fs = measure_loader_shm(MiB, strategy="file_system", batches=6, private=False)
    # bytes counted either way; file_descriptor's name lives only from shm_open to unlink (a
    # listing on a loaded machine caught one, once in 12), file_system's stay, one per batch in
    # flight (5 here on a quiet machine)
    assert fd.peak >= 4 * MiB and fs.peak >= 4 * MiB
    assert fd.named_files <= 1 < 2 <= fs.named_files
    assert torch.multiprocessing.get_sharing_strategy() == before   # set in the workers only


def test_without_unshare_nothing_is_reproduced_and_the_reason_says_why(monkeypatch):
    monkeypatch.setattr(shm.shutil, "which", lambda name: None)
    monkeypatch.setattr(shm, "namespaces_available", shm.namespaces_available.__wrapped__)
    f = reproduce_small_shm(shm_bytes=8 * MiB, batch_bytes=4 * MiB)
    assert not f.reproduced and f.error == "" and "unshare" in f.reason


@private
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_on_a_private_tmpfs_the_peak_is_in_flight_plus_one_or_two_batches(strategy):
    m = measure_loader_shm(4 * MiB, num_workers=2, prefetch_factor=2, strategy=strategy)
    assert m.private and m.baseline == 0                        # a fresh tmpfs, only our bytes
    assert m.steady == 5 * m.batch_shm and m.predicted == 6 * m.batch_shm
    assert m.steady <= m.peak <= m.predicted + SEMAPHORE_SLACK
    assert max(m.per_batch) >= 4 * m.batch_shm                  # the queue was full


@pytest.fixture(scope="module")
def failure():
    with open("/proc/self/mountinfo") as f:
        before = f.read()
    result = reproduce_small_shm(shm_bytes=8 * MiB, batch_bytes=4 * MiB, num_workers=2)
    with open("/proc/self/mountinfo") as f:
        after = f.read()
    return result, before, after


@private
@pytest.mark.slow
def test_a_too_small_dev_shm_fails_with_an_error_naming_shared_memory(failure):
    f, _, _ = failure
    assert f.reproduced, f.reason
    assert f.needed == 6 * 4 * MiB > f.shm_bytes
    assert f.error_type == "RuntimeError"
    assert "DataLoader worker process" in f.error and "shared memory" in f.error
    assert "unshare" in f.command and "--propagation private" in f.command


@private
@pytest.mark.slow
def test_the_same_loader_succeeds_when_dev_shm_fits_its_batches(failure):
    assert failure[0].fits_ok


@private
@pytest.mark.slow
def test_claim_22_a_huge_shmmax_does_not_help(failure):
    f = failure[0]
    assert f.shmmax > f.needed and f.reproduced                 # shmmax limits System V, not tmpfs


@private
@pytest.mark.slow
def test_the_host_mount_table_is_unchanged_after_the_reproduction(failure):
    _, before, after = failure
    assert before == after
