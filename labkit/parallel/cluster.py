"""Run a function on N local processes (a real ``torch.distributed`` cluster) and collect each rank's result.

``run(fn, N, ...)`` spawns N ranks (gloo on CPU, nccl when CUDA has a GPU per rank), calls
``fn(ctx, ...)`` on each and returns the results in rank order. The process group is passed
in ``ctx.group`` (never a global), so the same ``fn`` also runs under ``torchrun``:

    # one machine, 2 ranks (what CI runs on CPU)
    torchrun --standalone --nproc-per-node 2 -m labkit.parallel.cluster \\
        labkit.parallel.cluster:all_reduce_demo 1024
    # two machines with 8 GPUs each: run on node0 with --node-rank 0, on node1 with --node-rank 1
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-endpoint node0:29500 \\
        -m labkit.parallel.cluster labkit.parallel.cluster:all_reduce_demo 1024

A rank that raises makes ``run`` raise ``RankFailed`` with its traceback at once; a run
past ``timeout_s`` raises ``TimeoutError``; either way every rank is ended before it returns.
"""
from __future__ import annotations

import ast
import datetime
import importlib
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

GRACE_S = 2.0        # how long a terminated rank gets before it is killed


@dataclass
class RankContext:
    """What each rank's function gets: who it is, the group to talk over, where its tensors go."""

    rank: int
    world_size: int
    group: Any                      # the torch.distributed ProcessGroup: collectives take group=ctx.group
    device: torch.device


@dataclass
class Tracked:
    """A rank's result under ``track=True``: the value and the tracker's peak (bytes)."""

    value: Any
    peak: int
    peak_by_category: dict


class RankFailed(RuntimeError):
    """A rank raised (or died); the message holds its traceback."""

    def __init__(self, rank: int, details: str):
        self.rank, self.details = rank, details
        super().__init__(f"rank {rank} failed:\n{details}")


# ---- the demo every test and doc uses ------------------------------------------------------
@dataclass
class ReduceResult:
    rank: int
    total: float


def all_reduce_demo(ctx: RankContext, n: int = 4) -> ReduceResult:
    """Each rank holds n copies of rank + 1; after the all-reduce every rank sums n * W(W+1)/2."""
    t = torch.full((n,), float(ctx.rank + 1), device=ctx.device)   # (n,)
    dist.all_reduce(t, group=ctx.group)
    return ReduceResult(ctx.rank, t.sum().item())


def crash_demo(ctx: RankContext, bad_rank: int = 1) -> ReduceResult:
    """``bad_rank`` fails before the all-reduce, as a rank that runs out of memory would; the
    others wait in the all-reduce for a partner that never comes (a hang without a timeout)."""
    if ctx.rank == bad_rank:
        raise MemoryError(f"rank {ctx.rank} could not allocate its batch (a simulated OOM)")
    return all_reduce_demo(ctx)


# ---- choices made once, in the parent -------------------------------------------------------
def _check_importable(fn: Callable):
    """A rank receives ``fn`` by its module and name (pickled): it must be able to import it.
    A script's own functions qualify (each rank re-imports the script as multiprocessing's
    ``__mp_main__``, hence the ``if __name__ == "__main__":`` guard); a notebook's do not."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    fix = "define it at the top level of a module (e.g. in labkit) and import it from there"
    script = module == "__main__" and getattr(sys.modules["__main__"], "__file__", None)
    if module in (None, "__main__", "__mp_main__") and not script or "<" in name:
        raise ValueError(f"{fn!r} cannot be started in another process ({module}.{name}): {fix}"
                         + ("" if module != "__main__" else
                            " (a script's own top-level functions work, a notebook's do not)"))
    try:
        found = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        found = None
    if found is not fn:
        raise ValueError(f"{module}.{name} is not importable as {fn!r}: {fix}")


def default_backend(world_size: int) -> str:
    """nccl when there is a GPU for every rank, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and world_size <= torch.cuda.device_count() else "gloo"


# ---- one rank ------------------------------------------------------------------------------
def _init_from_env(backend: str | None, timeout_s: float, store: dist.Store | None = None) -> RankContext:
    """Join the group that RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe (as torchrun sets);
    with ``store``, meet there instead of at a store that rank 0 hosts."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or default_backend(local_world)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # N ranks share the cores: one thread pool each as large as the machine oversubscribes it
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return RankContext(rank, world_size, dist.group.WORLD, device)


def _call(fn, ctx, args, kwargs, track):
    if not track:
        return fn(ctx, *args, **kwargs)
    from labkit.training.track import MemoryTracker
    with MemoryTracker(timeline=False) as mt:
        value = fn(ctx, *args, **kwargs)
    return Tracked(value, mt.peak, dict(mt.peak_by_category))


def _rank_main(rank, world_size, port, backend, timeout_s, fn, args, kwargs, track, conn, where):
    """Runs in the child: join the group, call fn, send ("ok", result) or ("error", traceback)."""
    environ, cwd = where            # the parent's, as spawn would give them (see _start_method)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    if "OMP_NUM_THREADS" not in os.environ:    # share the cores, as torchrun does
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        # the parent hosts the store, as torchrun's agent does: a rank that finishes first (and
        # exits) must not take the store away from one still joining
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        ctx = _init_from_env(backend, timeout_s, store)
        # gloo's handshake can end on one rank before the other: wait until every rank has
        # joined, so that one whose fn returns at once does not exit under a peer still joining
        store.set(f"joined/{rank}", "1")
        store.wait([f"joined/{r}" for r in range(world_size)])
        result = _call(fn, ctx, args, kwargs, track)
        # plain pickle, tensors on the CPU: the parent must not depend on this process staying alive
        message = ("ok", tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, result))
        payload = pickle.dumps(message)
    except BaseException:
        payload = pickle.dumps(("error", traceback.format_exc()))
    conn.send_bytes(payload)
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    # leave now: the interpreter's shutdown can find gloo's threads still running (C++ aborts
    # with "terminate called without an active exception"); the result is already sent
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the parent ----------------------------------------------------------------------------
def _start_method() -> mp.context.BaseContext:
    """A forkserver that has imported torch and labkit once: each rank is a fork of it, ready in
    ~0.1 s instead of ~2 s for a fresh interpreter (spawn). Not plain fork: the parent (Jupyter,
    torch) runs threads, and CUDA cannot be forked. A fork carries the server's environment and
    folder, so each rank is given the parent's (as spawn would); spawn where forkserver is missing."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    # imported once by the server when it starts (once per parent), not by every rank: the
    # first optimizer a rank makes imports torch._dynamo (2.5 s of a 4 s ZeRO step, 2 cores)
    context.set_forkserver_preload([__name__, "labkit.training.measure", "labkit.transformer.model",
                                    "labkit.parallel.data.fsdp", "torch._dynamo"])
    return context


def _stop(procs):
    """terminate, then kill what is still alive, then join: no rank outlives the call."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def run(fn: Callable, world_size: int, *args, backend: str | None = None, timeout_s: float = 120,
        track: bool = False, **kwargs) -> list:
    """Call ``fn(ctx, *args, **kwargs)`` on ``world_size`` new processes; one result per rank.

    With ``track=True`` each result is a ``Tracked`` with the rank's ``MemoryTracker`` peak.
    Tensors in results come back on the CPU. ``timeout_s`` counts from when every rank has started.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    _check_importable(fn)
    backend = backend or default_backend(world_size)
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"nccl needs a GPU per rank ({world_size} ranks, "
                         f"{torch.cuda.device_count()} GPUs): use backend='gloo' or fewer ranks")

    start = _start_method()
    where = (dict(os.environ), os.getcwd())
    # the ranks' meeting point lives as long as this call (port 0: the system picks a free one)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    port, procs, readers = store.port, [], {}
    results, pending = [None] * world_size, set(range(world_size))
    try:
        for rank in range(world_size):
            reader, writer = start.Pipe(duplex=False)
            p = start.Process(target=_rank_main, name=f"labkit-rank-{rank}", daemon=True,
                              args=(rank, world_size, port, backend, timeout_s, fn, args, kwargs,
                                    track, writer, where))
            p.start()
            writer.close()          # the child holds the only writer: EOF once it is gone
            procs.append(p)
            readers[reader] = rank
        # counted from here: the first start waits for the forkserver's imports (once per
        # parent; tens of seconds on a loaded 2-core machine), which are not the ranks' work
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timeout_s={timeout_s} passed; ranks {sorted(pending)} of "
                                   f"{world_size} had not finished (all ranks were ended)")
            for reader in wait(list(readers), timeout=left):
                rank = readers.pop(reader)
                try:
                    status, value = pickle.loads(reader.recv_bytes())
                except EOFError:    # died without a word: a crash, a kill, or fn failed to import
                    status, value = "error", _silent_exit(procs[rank])
                if status == "error":
                    raise _root_failure(rank, value, readers, procs)
                results[rank] = value
                pending.discard(rank)
        for p in procs:
            p.join(GRACE_S)         # ranks exit by themselves once they have sent their result
        return results
    finally:
        _stop(procs)                # on success, failure, timeout or KeyboardInterrupt


# A rank whose peer died fails in its collective with one of these; the peer's error is the cause
_PEER_LOST = ("DistBackendError", "DistNetworkError", "Connection closed by peer",
              "Connection reset by peer", "Check the logs of the remote worker")


def _silent_exit(process) -> str:
    """What a rank that died without sending a result leaves: its exit code."""
    process.join(GRACE_S)
    return (f"exited with code {process.exitcode} before sending a result (its stderr has the "
            "details)")


def _root_failure(rank: int, details: str, readers: dict, procs: list) -> RankFailed:
    """The first failure's cause: when ``rank`` failed only because a peer died, the peer's
    error if it arrives within GRACE_S (its own exception, or its exit code when it died
    without a word), not the lost connection."""
    deadline = time.monotonic() + GRACE_S
    while readers and any(marker in details for marker in _PEER_LOST):
        ready = wait(list(readers), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for reader in ready:
            peer = readers.pop(reader)
            try:
                status, value = pickle.loads(reader.recv_bytes())
            except EOFError:                    # the peer died silently: that is the cause
                return RankFailed(peer, _silent_exit(procs[peer]))
            if status == "error" and not any(marker in value for marker in _PEER_LOST):
                return RankFailed(peer, value)
    return RankFailed(rank, details)


# ---- under torchrun ------------------------------------------------------------------------
def launch(fn: Callable, *args, backend: str | None = None, timeout_s: float = 600, **kwargs):
    """Call ``fn(ctx, *args, **kwargs)`` in a process that torchrun started; returns its result."""
    if "RANK" not in os.environ:
        raise ValueError("launch() reads RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment: "
                         "start it with torchrun (see this module's docstring), or use run()")
    ctx = _init_from_env(backend, timeout_s)
    try:
        return fn(ctx, *args, **kwargs)
    finally:
        dist.destroy_process_group()


def _load(target: str) -> Callable:
    """'package.module:function' -> the function."""
    module, sep, name = target.partition(":")
    if not sep:
        raise ValueError(f"expected module:function, got {target!r}")
    return getattr(importlib.import_module(module), name)


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text                 # anything that is not a Python literal stays a string


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: torchrun ... -m labkit.parallel.cluster module:function [args ...]")
    result = launch(_load(argv[0]), *map(_literal, argv[1:]))
    # one write per line: print() writes the text and its newline apart, and with unbuffered
    # output (PYTHONUNBUFFERED) two ranks sharing a pipe could run their lines together
    sys.stdout.write(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: {result!r}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
