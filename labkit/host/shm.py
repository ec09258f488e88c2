"""Data-loader shared memory, measured: how batches cross from worker processes to the trainer
through /dev/shm, how much of it they hold, and what a user sees when /dev/shm is too small.

Follows PyTorch's own source (torch 2.13): in a worker, ``default_collate`` stacks the batch
straight into a shared-memory storage (``collate_tensor_fn``: ``elem._typed_storage()._new_shared``)
so that nothing is copied again on the way. ``UntypedStorage._new_shared`` picks the file by the
sharing strategy (``torch.multiprocessing.get_sharing_strategy``), ``"file_descriptor"`` by default
on Linux: ``shm_open`` of a ``/torch_*`` name on /dev/shm, unlinked at once, its descriptor sent to
the main process over a Unix socket (``multiprocessing.reduction.DupFd`` in
``torch/multiprocessing/reductions.py``). So ``ls /dev/shm`` shows no file, yet the tmpfs counts
every page: ``statvfs("/dev/shm")`` is what this module samples. ``"file_system"`` keeps the named
``/dev/shm/torch_*`` file alive with a reference count in its first 64 bytes (ATen's
``RefcountedMapAllocator``, ``map_alloc_alignment = 64``): one page more per batch of whole pages.

How many batches are alive at once: the loader keeps ``num_workers * prefetch_factor`` batches
asked for and not yet received (``_try_put_index``), and the training loop holds the one it works
on. ``for batch in loader`` drops the old batch only after ``next()`` has returned the new one, and
``next()`` asks a worker for a new batch before it returns (``_process_data``), so for a moment one
batch more is alive: measured, the peak lies between ``in_flight + 1`` and ``in_flight + 2``
batches (the second mostly with ``"file_descriptor"``). ``shm_needed`` counts the ``+ 2``. The
loader's queues add a few pages of POSIX semaphores (``sem.*``), the slack the tests allow.

/dev/shm is a tmpfs whose size is set when it is mounted: half of RAM on a host, 64 MiB in a Docker
container unless ``--shm-size`` (or ``--ipc=host``, the host's /dev/shm) says otherwise. Torch
reserves a batch's pages with ``posix_fallocate`` before writing, so a full tmpfs fails cleanly in
the worker (``RuntimeError: unable to allocate shared memory(shm) ...: No space left on device``,
re-raised in the trainer); older releases only truncated the file and the worker died of SIGBUS
("DataLoader worker (pid ...) is killed by signal: Bus error"). ``kernel.shmmax``/``shmall`` limit
System V segments (``shmget``), which this path never uses: raising them changes nothing here.

``reproduce_small_shm`` shows it safely: a child Python runs in a private mount namespace
(``unshare --mount --propagation private``) with a small tmpfs mounted on /dev/shm there only.

    need = shm_needed(8 * 4096 * 8, num_workers=4, prefetch_factor=2)   # int64 token batch
    m = measure_loader_shm(4 * 2**20, num_workers=2, prefetch_factor=2)  # m.peak, m.predicted
    f = reproduce_small_shm(shm_bytes=8 * 2**20, batch_bytes=4 * 2**20)  # f.error names shm
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from dataclasses import asdict, dataclass, field

import torch
from torch.utils.data import DataLoader, Dataset

from labkit.core.units import check_choice, check_positive

PAGE = 4096                      # tmpfs hands out whole pages
REFCOUNT_HEADER = 64             # file_system's refcount (ATen's map_alloc_alignment)
DOCKER_DEFAULT_SHM = 64 * 2**20  # docker run without --shm-size (moby's DefaultShmSize)
NCCL_SHM = 2**30                 # NCCL's troubleshooting guide's example: --shm-size=1g
STRATEGIES = ("file_descriptor", "file_system")
SEMAPHORE_SLACK = 64 * PAGE      # the loader's queues' POSIX semaphores live on /dev/shm too


# ---------------------------------------------------------------- predict

def batch_shm_bytes(batch_bytes: int, strategy: str = "file_descriptor") -> int:
    """Bytes of /dev/shm one batch takes: its storage (plus the refcount header under
    ``file_system``), rounded up to whole 4 KiB pages."""
    check_positive("batch_bytes", batch_bytes)
    check_choice("strategy", strategy, STRATEGIES)
    size = batch_bytes + (REFCOUNT_HEADER if strategy == "file_system" else 0)
    return -(-size // PAGE) * PAGE


def batches_alive(num_workers: int, prefetch_factor: int, held: int = 2) -> int:
    """Batches in /dev/shm at the worst moment: those asked of the workers and not yet received,
    plus ``held`` in the main process (the one in use and the one ``next()`` just returned)."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise ValueError(f"num_workers must be a non-negative integer (0 loads in the main "
                         f"process), got {num_workers!r}")
    check_positive("prefetch_factor", prefetch_factor)
    return num_workers * prefetch_factor + held if num_workers else 0


def shm_needed(batch_bytes: int, num_workers: int, prefetch_factor: int = 2,
               strategy: str = "file_descriptor") -> int:
    """/dev/shm a DataLoader needs: (num_workers x prefetch_factor + 2) page-rounded batches;
    0 with ``num_workers=0`` (nothing crosses a process boundary)."""
    return batches_alive(num_workers, prefetch_factor) * batch_shm_bytes(batch_bytes, strategy)


def docker_shm_flag(nbytes: int, ranks: int = 1, nccl: bool = False) -> str:
    """A safe ``docker run`` flag for a container of ``ranks`` processes, each with a DataLoader
    keeping ``nbytes`` in /dev/shm (``shm_needed``): twice their sum, plus 1 GiB when the ranks
    talk over NCCL (``nccl``: NCCL creates /dev/shm segments at init and fails to start if they
    do not fit; its troubleshooting guide's example is --shm-size=1g), never below Docker's
    64 MiB default, rounded up to a power of two MiB. A tmpfs size is a cap, not a reservation,
    but the pages in use count against the container's memory limit."""
    check_positive("nbytes", nbytes)
    check_positive("ranks", ranks)
    need = max(2 * ranks * nbytes + (NCCL_SHM if nccl else 0), DOCKER_DEFAULT_SHM)
    mib = 1 << (need - 1).bit_length() >> 20                                # a power of two
    return f"--shm-size={mib // 1024}g" if mib >= 1024 else f"--shm-size={mib}m"


# ---------------------------------------------------------------- measure

def shm_used(path: str = "/dev/shm") -> int:
    """Bytes in use on the file system at ``path`` (statvfs): counts unlinked shm files too."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class _Batches(Dataset):
    """``length`` samples of ``nbytes`` zero bytes each: cheap to make, one per batch."""

    def __init__(self, nbytes: int, length: int):
        self.nbytes, self.length = nbytes, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return torch.zeros(self.nbytes, dtype=torch.uint8)   # (nbytes,), private to the worker


def _set_strategy(strategy: str, worker_id: int) -> None:
    # runs in each worker before its first batch: the main process's strategy is left alone
    torch.multiprocessing.set_sharing_strategy(strategy)


def _loader(batch_bytes, num_workers, prefetch_factor, batches, strategy, timeout_s=60):
    return DataLoader(_Batches(batch_bytes, batches), batch_size=1, num_workers=num_workers,
                      prefetch_factor=prefetch_factor, timeout=timeout_s,
                      worker_init_fn=functools.partial(_set_strategy, strategy))


@dataclass
class LoaderShm:
    """/dev/shm held by a DataLoader while it runs, beside the prediction (bytes)."""

    batch_bytes: int
    num_workers: int
    prefetch_factor: int
    strategy: str
    baseline: int             # in use before the loader started
    peak: int                 # most in use above the baseline, sampled in the background
    per_batch: list = field(default_factory=list)   # in use above baseline as each batch arrived
    named_files: int = 0      # most torch_* names in the directory as a batch arrived
    private: bool = False     # measured on a private tmpfs (no other process's bytes)

    @property
    def batch_shm(self) -> int:
        return batch_shm_bytes(self.batch_bytes, self.strategy)

    @property
    def steady(self) -> int:
        """In flight plus the batch in use: what the loader holds between two batches."""
        return batches_alive(self.num_workers, self.prefetch_factor, held=1) * self.batch_shm

    @property
    def predicted(self) -> int:
        return shm_needed(self.batch_bytes, self.num_workers, self.prefetch_factor, self.strategy)

    @property
    def peak_batches(self) -> float:
        return self.peak / self.batch_shm


def _from_a_child(name: str) -> bool:
    """A ``torch_<pid>_<random>_<n>`` name made by a child of this process (a loader's worker),
    not by another program sharing /dev/shm."""
    parts = name.split("_")
    if len(parts) < 3 or parts[0] != "torch" or not parts[1].isdigit():
        return False
    try:
        stat = Path(f"/proc/{parts[1]}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid()   # field 4: the parent's pid


def _train_step(shm_path: str, hold_s: float, quiet_s: float = 0.1, limit_s: float = 2.0):
    """Stand in for a training step: ``hold_s``, then on until /dev/shm has not grown for
    ``quiet_s`` (the workers have filled the queue; on a busy machine they lag), at most
    ``limit_s``: the regime where the loader keeps ahead of the model."""
    start = time.monotonic()
    time.sleep(hold_s)
    last, since = shm_used(shm_path), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() - start < limit_s:
        time.sleep(0.005)
        now = shm_used(shm_path)
        if now != last:
            last, since = now, time.monotonic()


def _measure_here(batch_bytes, num_workers, prefetch_factor, batches, strategy, shm_path,
                  hold_s) -> LoaderShm:
    """Run the loader in this process and sample ``statvfs(shm_path)`` while it runs."""
    baseline = shm_used(shm_path)
    peak, done = [baseline], threading.Event()
    others = set(os.listdir(shm_path))          # names that were there before are not ours

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], shm_used(shm_path))
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    per_batch, names = [], 0
    try:
        for _batch in _loader(batch_bytes, num_workers, prefetch_factor, batches, strategy):
            per_batch.append(shm_used(shm_path) - baseline)
            # file_descriptor's names live only between shm_open and unlink; file_system's stay
            names = max(names, sum(f not in others and _from_a_child(f)
                                   for f in os.listdir(shm_path)))
            _train_step(shm_path, hold_s)
    finally:
        done.set()
        sampler.join()
    return LoaderShm(batch_bytes, num_workers, prefetch_factor, strategy, baseline,
                     max(peak[0], baseline + max(per_batch, default=0)) - baseline, per_batch,
                     names)


def measure_loader_shm(batch_bytes: int, num_workers: int = 2, prefetch_factor: int = 2,
                       batches: int = 12, strategy: str = "file_descriptor",
                       shm_path: str = "/dev/shm", private: bool = True,
                       hold_s: float = 0.02) -> LoaderShm:
    """Measure /dev/shm held by a DataLoader of ``batch_bytes`` batches.

    With ``private`` (and a usable ``unshare``) it runs in a child process on a private tmpfs,
    so only the loader's bytes count; else in this process on ``shm_path``, where other
    processes' files are noise (compare with a tolerance). The sharing strategy is set in the
    workers only."""
    check_positive("batch_bytes", batch_bytes)
    check_positive("num_workers", num_workers)
    check_positive("prefetch_factor", prefetch_factor)
    check_positive("batches", batches)
    check_choice("strategy", strategy, STRATEGIES)
    if private and namespaces_available()[0]:
        size = 2 * shm_needed(batch_bytes, num_workers, prefetch_factor, strategy) + 16 * 2**20
        args = ["measure", str(batch_bytes), str(num_workers), str(prefetch_factor), str(batches),
                strategy, str(hold_s)]
        run = _run_in_private_shm(size, args, timeout_s=120)
        if run.returncode != 0:
            raise RuntimeError(f"measuring in a private tmpfs failed:\n{run.stderr[-2000:]}")
        return LoaderShm(**json.loads(run.stdout.splitlines()[-1]), private=True)
    return _measure_here(batch_bytes, num_workers, prefetch_factor, batches, strategy, shm_path,
                         hold_s)


# ---------------------------------------------------------------- reproduce, safely

def _unshare_prefix() -> list:
    """A new mount namespace, mounts private to it; as non-root inside a user namespace too."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--propagation", "private"]


@functools.lru_cache(maxsize=1)
def namespaces_available() -> tuple:
    """(True, "") when this machine lets us make a private mount namespace with its own tmpfs;
    else (False, why). Asked once per process; mounts nothing outside the namespace."""
    if not sys.platform.startswith("linux"):
        return False, f"private mount namespaces are Linux only (this is {sys.platform})"
    if shutil.which("unshare") is None:
        return False, "util-linux `unshare` is not installed"
    try:
        run = subprocess.run([*_unshare_prefix(), "true"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"`unshare` did not run: {e}"
    if run.returncode != 0:
        return False, f"`{' '.join(_unshare_prefix())}` was refused: {run.stderr.strip()}"
    return True, ""


def _run_in_private_shm(shm_bytes: int, args: list, timeout_s: float):
    """Run ``python -m labkit.host.shm ARGS`` with a tmpfs of ``shm_bytes`` on /dev/shm, in a mount
    namespace of its own; the whole process group is killed on timeout (never hangs)."""
    # the shell refuses to mount unless it really is in another mount namespace than ours
    script = ('[ "$(readlink /proc/self/ns/mnt)" != "$LABKIT_HOST_MNT_NS" ] || '
              '{ echo "not in a private mount namespace" >&2; exit 97; }; '
              f'mount -t tmpfs -o size={shm_bytes},mode=1777 tmpfs /dev/shm && exec "$@"')
    command = [*_unshare_prefix(), "sh", "-c", script, "sh", sys.executable, "-m",
               "labkit.host.shm", *args]
    env = {**os.environ, "LABKIT_HOST_MNT_NS": os.readlink("/proc/self/ns/mnt"),
           "PYTHONPATH": os.pathsep.join(filter(None, [
               str(Path(__file__).resolve().parents[2]),     # the checkout holding labkit/
               os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {timeout_s} s)"
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@dataclass
class ShmFailure:
    """What a DataLoader does on a /dev/shm too small for its batches, and on one that fits."""

    shm_bytes: int
    batch_bytes: int
    num_workers: int
    needed: int               # shm_needed for these batches
    reproduced: bool          # the small tmpfs failed as predicted and the roomy one succeeded
    error_type: str = ""      # the exception the training loop caught
    error: str = ""           # the lines that matter from its message
    fits_ok: bool = False     # the same loader on a tmpfs of ``needed`` bytes finished
    shmmax: int = 0           # kernel.shmmax inside the run: no help, it limits System V only
    command: str = ""         # how the child was started
    reason: str = ""          # why not reproduced


def _trim(message: str) -> str:
    """The first line and the lines naming shared memory (a worker's traceback is long)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    keys = ("shared memory", "shm", "bus error", "no space left")
    keep = lines[:1] + [line for line in lines[1:] if any(k in line.lower() for k in keys)]
    return "\n".join(keep)


def reproduce_small_shm(shm_bytes: int = 8 * 2**20, batch_bytes: int = 4 * 2**20,
                        num_workers: int = 2, prefetch_factor: int = 2,
                        timeout_s: float = 120) -> ShmFailure:
    """Run a DataLoader in a child on a private tmpfs of ``shm_bytes`` (its batches need more),
    capture the error it raises, then run it again on a tmpfs that fits. Changes nothing on
    the host: the mounts live and die with the child's mount namespace."""
    for name, value in (("shm_bytes", shm_bytes), ("batch_bytes", batch_bytes),
                        ("num_workers", num_workers), ("prefetch_factor", prefetch_factor)):
        check_positive(name, value)
    needed = shm_needed(batch_bytes, num_workers, prefetch_factor)
    if shm_bytes >= needed:
        raise ValueError(f"shm_bytes {shm_bytes} fits the {needed} bytes these batches need; "
                         f"pass shm_bytes below {needed} (or larger batches) to see it fail")
    result = ShmFailure(shm_bytes, batch_bytes, num_workers, needed, reproduced=False)
    ok, why = namespaces_available()
    if not ok:
        result.reason = why
        return result
    args = ["load", str(batch_bytes), str(num_workers), str(prefetch_factor)]
    small = _run_in_private_shm(shm_bytes, args, timeout_s)
    roomy = _run_in_private_shm(needed + SEMAPHORE_SLACK, args, timeout_s)
    result.command = shlex.join(small.args)
    report, fits = _report(small), _report(roomy)
    if report is None or fits is None:
        bad = small if report is None else roomy
        result.reason = f"the child printed no report (exit {bad.returncode}): " \
                        f"{bad.stderr.strip()[-1500:]}"
        return result
    result.fits_ok = fits["ok"]
    result.error_type, result.error = report["error_type"], _trim(report["error"])
    result.shmmax = report["shmmax"]
    names_shm = any(k in result.error.lower() for k in ("shared memory", "shm"))
    result.reproduced = not report["ok"] and names_shm and result.fits_ok
    if not result.reproduced:
        result.reason = ("the small tmpfs did not fail" if report["ok"] else
                         "the loader failed without naming shared memory" if not names_shm else
                         "the loader failed on a tmpfs that fits too")
    return result


def _report(run) -> dict | None:
    """The JSON line a child printed last, or None when it printed none (killed, crashed)."""
    try:
        return json.loads(run.stdout.splitlines()[-1])
    except (IndexError, ValueError):
        return None


def _load_once(batch_bytes, num_workers, prefetch_factor) -> dict:
    """The child's side of reproduce_small_shm: iterate, and say what was raised (if anything)."""
    report = {"ok": True, "error_type": "", "error": "",
              "shmmax": int(open("/proc/sys/kernel/shmmax").read())}
    try:
        for _batch in _loader(batch_bytes, num_workers, prefetch_factor, 4 * num_workers *
                              prefetch_factor, "file_descriptor", timeout_s=60):
            time.sleep(0.01)
    except Exception as e:          # what the user's training loop would see
        report.update(ok=False, error_type=type(e).__name__, error=str(e))
    return report


def main(argv=None) -> None:
    """Entry point of the child processes (``python -m labkit.host.shm measure|load ...``)."""
    parser = argparse.ArgumentParser(description="labkit.host.shm child: run a DataLoader here")
    parser.add_argument("what", choices=["measure", "load"])
    parser.add_argument("values", nargs="+")
    ns = parser.parse_args(argv)
    if ns.what == "measure":
        b, w, p, n, strategy, hold = ns.values
        m = _measure_here(int(b), int(w), int(p), int(n), strategy, "/dev/shm", float(hold))
        out = {k: v for k, v in asdict(m).items() if k != "private"}
    else:
        b, w, p = map(int, ns.values)
        out = _load_once(b, w, p)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
