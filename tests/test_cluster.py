"""labkit.parallel.cluster: results per rank, a failing rank, a hung rank, no process left behind."""
import os
import signal
import threading
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import cluster_targets as targets
from labkit.parallel import cluster
from labkit.parallel.cluster import RankFailed, ReduceResult, Tracked, all_reduce_demo, run

ROOT = Path(__file__).resolve().parents[1]


# What test modules start beside the tests (conftest.py's start_in_background: the notebook
# runs, the Triton interpreter's cases) are our children too, not ranks.
BACKGROUND = ("run_notebooks.py", "flash_triton_cases.py")


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _in_background(process: psutil.Process) -> bool:
    """A background run or a process it started (a kernel, its ranks), or gone already (a
    background run that ended is a zombie until its test reads its result)."""
    try:
        if process.status() == psutil.STATUS_ZOMBIE:
            return True
        return any(b in _command(p) for p in (process, *process.parents()) for b in BACKGROUND)
    except psutil.NoSuchProcess:
        return True


def no_children_left():
    """No rank of ours is alive: the ranks are forks of multiprocessing's fork server, our
    grandchildren; our children, the server and the resource tracker (one each per interpreter,
    started by the first run and shared by every later one), are not ranks and stay, and
    neither are the background notebook runs (BACKGROUND) with all they start."""
    helpers = {p for p in psutil.Process().children() if not _in_background(p)}
    assert all(any(h in _command(p) for h in ("forkserver", "resource_tracker"))
               for p in helpers), [_command(p) for p in helpers]
    return [_command(p) for p in psutil.Process().children(recursive=True)
            if p not in helpers and not _in_background(p)] == []


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_gives_every_rank_the_sum(world_size):
    n = 8
    expected = n * world_size * (world_size + 1) / 2
    assert run(all_reduce_demo, world_size, n) == [ReduceResult(r, expected) for r in range(world_size)]
    assert no_children_left()


def test_ctx_holds_rank_world_size_group_and_device():
    assert run(targets.report, 2) == [(0, 2, 2, "cpu"), (1, 2, 2, "cpu")]


def test_a_rank_that_raises_fails_the_call_at_once_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run(targets.fail_on_rank, 2, 1, timeout_s=60)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert "rank 1 failed" in str(info.value)
    assert "ZeroDivisionError: boom on rank 1" in str(info.value)
    assert "fail_on_rank" in str(info.value)       # the traceback names the failing frame
    assert elapsed < 10, f"took {elapsed:.1f} s: the failure must not wait for the 60 s timeout"
    assert no_children_left()


def test_a_hung_rank_times_out_naming_it():
    # 8 s: rank 0 must have started and finished by then even on 2 loaded cores (spawning two
    # ranks takes 2 s on a quiet machine, 5 s or more when the cores are busy)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 had not finished"):
        run(targets.sleep_on_rank, 2, 1, 60, timeout_s=8)
    elapsed = time.monotonic() - start
    assert 8 <= elapsed < 8 + 2 * cluster.GRACE_S + 2
    assert no_children_left()


def test_a_rank_that_dies_silently_fails_the_call_with_its_exit_code():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 0 failed:\nexited with code 3"):
        run(targets.exit_on_rank, 2, 0, timeout_s=60)
    assert time.monotonic() - start < 10
    assert no_children_left()


def test_ctrl_c_in_the_parent_ends_every_rank():
    # Python's own Ctrl-C handler: a shell that starts a job in the background (cmd &) leaves
    # SIGINT ignored, and the test would wait for the timeout instead
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run(targets.sleep_on_rank, 2, 1, 60, timeout_s=30)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert no_children_left()


def test_track_returns_each_ranks_peak_bytes():
    n = 1 << 20
    results = run(targets.hold_bytes, 2, n, track=True)
    assert all(isinstance(r, Tracked) for r in results)
    assert [r.value for r in results] == [n, 2 * n]
    assert [r.peak for r in results] == [n, 2 * n]
    assert [r.peak_by_category["other"] for r in results] == [n, 2 * n]


def test_track_sees_the_all_reduce_buffer():
    results = run(all_reduce_demo, 2, 1000, track=True)
    assert [r.value for r in results] == [ReduceResult(0, 3000.0), ReduceResult(1, 3000.0)]
    assert [r.peak for r in results] == [4000 + 4] * 2       # the fp32 buffer and its sum


def local_fn(ctx):
    return ctx.rank


@pytest.mark.parametrize("fn, match", [
    (lambda ctx: 0, "define it at the top level of a module"),
    (local_fn.__get__(1), "define it at the top level of a module"),    # a bound method
])
def test_a_function_spawn_cannot_import_is_refused(fn, match):
    with pytest.raises(ValueError, match=match):
        run(fn, 2)


def test_a_function_defined_in_main_is_refused():
    def fn(ctx):
        return 0
    fn.__module__, fn.__qualname__ = "__main__", "fn"
    with pytest.raises(ValueError, match="define it at the top level of a module"):
        run(fn, 2)


@pytest.mark.parametrize("world_size, timeout_s, match", [
    (0, 10, "world_size must be an int >= 1"),
    (2.0, 10, "world_size must be an int >= 1"),
    (2, 0, "timeout_s must be > 0"),
])
def test_bad_sizes_are_refused(world_size, timeout_s, match):
    with pytest.raises(ValueError, match=match):
        run(all_reduce_demo, world_size, timeout_s=timeout_s)


def test_nccl_without_a_gpu_per_rank_is_refused():
    with pytest.raises(ValueError, match="use backend='gloo'"):
        run(all_reduce_demo, 1024, backend="nccl")


def test_launch_outside_torchrun_says_how_to_start(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="start it with torchrun"):
        cluster.launch(all_reduce_demo, 4)


@pytest.mark.slow
def test_the_same_function_runs_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "labkit.parallel.cluster",
           "labkit.parallel.cluster:all_reduce_demo", "8"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    for rank in range(2):
        assert f"rank {rank} of 2: ReduceResult(rank={rank}, total=24.0)" in out.stdout


def test_a_rank_that_only_lost_its_peer_names_the_peers_error():
    # the race CI met once: rank 0's barrier failed first because rank 1 had died raising
    import multiprocessing
    import pickle

    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.send_bytes(pickle.dumps(("error", "ZeroDivisionError: boom on rank 1")))
    lost = "DistBackendError: ... Check the logs of the remote worker before reporting an error."
    failed = cluster._root_failure(0, lost, {reader: 1}, [])
    assert failed.rank == 1 and "boom on rank 1" in str(failed)
    assert cluster._root_failure(0, "ValueError: its own bug", {}, []).rank == 0


def test_a_rank_that_only_lost_a_silently_dead_peer_names_the_peers_exit_code():
    # the race CI met at e67b1a5: rank 1's barrier failed ("Connection closed by peer") before
    # the parent saw rank 0's pipe close; rank 0 had died without a word (os._exit(3))
    import multiprocessing

    reader, writer = multiprocessing.Pipe(duplex=False)
    dead = multiprocessing.get_context("spawn").Process(target=os._exit, args=(3,))
    dead.start()
    writer.close()                                   # the dead rank's end: EOF, no result
    lost = "RuntimeError: [gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]"
    failed = cluster._root_failure(1, lost, {reader: 0}, [dead])
    assert failed.rank == 0 and "exited with code 3" in str(failed)
