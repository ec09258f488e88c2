"""The host under a training job, read and never changed (lab 08).

GPU memory is only half of a training job's memory: the host decides how many cores feed the
GPU, whether DataLoader workers can pass batches through /dev/shm, where the container's
out-of-memory line is, and which allocator settings the process starts with. ``host_report``
reads each of these from /proc, /sys and the environment and says what it means and what to do
for LLM training. It only reads: a command that would change a setting is returned as text
in ``Finding.commands`` and never run. The one program it may start is a read-only
``nvidia-smi --query-gpu`` when NVML is not importable.

    report = host_report()                       # this machine
    print(report.text()); report.finding("shm").data["size"]
    report = host_report(root=tmp_path, environ={})   # a fake tree, in the tests

Sources: the kernel's Documentation/admin-guide/mm/transhuge.rst and cgroup-v1/v2 memory
documents; PyTorch's c10/cuda/CUDAAllocatorConfig.h (which variable wins),
aten/src/ATen/MapAllocator.cpp (tensor sharing through POSIX ``shm_open``) and
torch/distributed/run.py (torchrun's OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import glob
import os
import resource
import shutil
import subprocess
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.core.units import check_choice, fmt_bytes
from labkit.host.hostfiles import (V1_NO_LIMIT, cgroup_memory, cpulist_count,  # noqa: F401
                                   disk_space, meminfo, parse_meminfo, read_int, read_text,
                                   usable_cpus)

STATUSES = ("ok", "note", "warn")
UNKNOWN = "unknown"
SMALL_SHM = 1 << 30                 # Docker's default /dev/shm is 64 MiB; a few workers fill it
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version",
              "--format=csv,noheader,nounits"]


# What each finding is and why it matters for training memory: one place to read them all.
ABOUT = {
    "cpu": ("CPU cores", "Cores feed the GPU: DataLoader workers, ZeRO-Offload's optimizer step "
            "and pinned copies run here, and a container's cpuset can hide most of them."),
    "numa": ("NUMA nodes", "On a multi-socket host each NUMA node has its own memory; a rank "
             "whose pinned buffers sit on the far node copies to its GPU over the socket link."),
    "memory": ("Host memory", "Host RAM holds what leaves the GPU: ZeRO-Offload's optimizer "
               "states, a state dict loaded before it moves to the GPU, every pinned buffer."),
    "cgroup": ("Memory cgroup limit", "The container's out-of-memory killer acts at the "
               "cgroup's limit, not at the host's RAM: pinned buffers, DataLoader workers, a "
               "state dict loaded on the CPU and /dev/shm pages all count towards it."),
    "swap": ("Swap", "Swap lets the kernel page host memory out to disk; pinned (page-locked) "
             "buffers never are, and a training process that swaps stalls its GPU."),
    "thp": ("Transparent huge pages", "THP backs memory with 2 MiB pages instead of 4 KiB: "
            "fewer TLB misses on large host buffers, but 'always' can bloat RSS and stall on "
            "compaction."),
    "shm": ("/dev/shm", "DataLoader workers hand batches to the main process as POSIX shared "
            "memory (shm_open, a tmpfs at /dev/shm); when it is full a worker dies with 'Bus "
            "error' or 'No space left on device'. Its pages count against the container."),
    "shmmax": ("kernel.shmmax", "kernel.shmmax caps one System V segment (shmget). PyTorch does "
               "not use System V: tensors shared between processes are POSIX shm_open objects "
               "in /dev/shm (or passed file descriptors), so this does not limit workers."),
    "memlock": ("Locked-memory limit", "RLIMIT_MEMLOCK caps memory a process may mlock() or "
                "register for RDMA: NCCL over InfiniBand/RoCE registers its buffers and fails "
                "when this is small. pin_memory() is pinned by the CUDA driver instead, which is "
                "not documented to count against it."),
    "alloc_conf": ("Allocator settings", "Settings of PyTorch's CUDA caching allocator, read "
                   "once when CUDA starts: expandable_segments, max_split_size_mb, "
                   "garbage_collection_threshold, backend, ..."),
    "launch_blocking": ("CUDA_LAUNCH_BLOCKING", "Makes every kernel launch wait for the kernel "
                        "to finish, so an error is reported at the line that caused it; it "
                        "changes nothing about allocation."),
    "threads": ("CPU threads", "OMP_NUM_THREADS sets torch's intra-op threads per process; "
                "torchrun sets it to 1 when it starts several ranks, and DataLoader workers run "
                "one thread each."),
    "devices_env": ("GPU and NCCL variables", "CUDA_VISIBLE_DEVICES chooses which GPUs a "
                    "process sees (renumbered from 0); NCCL_* variables change how ranks talk, "
                    "and some add buffers."),
    "gpus": ("GPUs", "What the allocator can have: the card's memory, less the CUDA context (a "
             "few hundred MiB) and what other processes hold."),
}


@dataclass
class Finding:
    """One setting of the host: its value, why it matters for training memory, what to do."""

    key: str
    label: str
    value: str | int
    meaning: str
    recommendation: str
    status: str = "ok"                                  # "ok" | "note" | "warn"
    commands: list[str] = field(default_factory=list)   # what a user would run; never run here
    data: dict = field(default_factory=dict)            # the numbers behind value (bytes: int)


@dataclass
class HostReport:
    """Every finding, in a fixed order; ``text()`` for people, ``as_dict()`` for JSON."""

    findings: list[Finding]

    def finding(self, key: str) -> Finding:
        keys = [f.key for f in self.findings]
        check_choice("finding", key, keys)
        return self.findings[keys.index(key)]

    def as_dict(self) -> dict:
        return {"findings": [asdict(f) for f in self.findings]}

    def text(self) -> str:
        width = max(len(f.label) for f in self.findings) + 2
        lines = []
        for f in self.findings:
            lines.append(f"{f.label:<{width}}{str(f.value):<44} [{f.status}]")
            for head, body in (("means: ", f.meaning), ("do:    ", f.recommendation)):
                lines.append(textwrap.fill(body, 100, initial_indent=" " * width + head,
                                           subsequent_indent=" " * (width + 7),
                                           break_on_hyphens=False))
            lines += [f"{'':<{width}}  $ {command}" for command in f.commands]
        return "\n".join(lines)


def _finding(key, value, recommendation, status="ok", commands=(), data=None) -> Finding:
    label, meaning = ABOUT[key]
    return Finding(key, label, value, meaning, recommendation, status, list(commands), data or {})


def _unknown(key: str, what: str) -> Finding:
    return _finding(key, UNKNOWN, f"Could not read {what}: this host (or container) does not "
                    "expose it, so check it where the job runs.", "note")


# ---- one function per finding ----------------------------------------------------------------

def _cpu(affinity: set[int], cpu_count: int | None) -> Finding:
    usable, hidden = len(affinity), bool(cpu_count) and len(affinity) < cpu_count
    return _finding("cpu", f"{usable} usable of {cpu_count or UNKNOWN}",
                    "Plan about (usable cores / ranks per host) threads per rank, DataLoader "
                    "workers included" + ("; a cpuset hides the other cores from this job."
                                          if hidden else "."),
                    "note" if hidden else "ok", data={"usable": usable, "cpu_count": cpu_count})


def _numa(root: Path, host_total: int | None = None) -> Finding:
    nodes = {}
    for path in glob.glob(str(root / "sys/devices/system/node/node[0-9]*")):
        name = Path(path).name
        cpus = read_text(root, f"sys/devices/system/node/{name}/cpulist") or ""
        memory = parse_meminfo(read_text(root, f"sys/devices/system/node/{name}/meminfo")).get("MemTotal", 0)
        nodes[name] = {"cpus": cpus, "cpu_count": cpulist_count(cpus), "memory": memory}
    if not nodes:
        return _unknown("numa", "/sys/devices/system/node")
    nodes = dict(sorted(nodes.items(), key=lambda kv: int(kv[0][4:])))
    listed = "; ".join(f"{n}: cpus {v['cpus']}, {fmt_bytes(v['memory'])}" for n, v in nodes.items())
    on_nodes = sum(v["memory"] for v in nodes.values())
    if host_total and on_nodes < 0.9 * host_total:    # containers and VMs can show partial data
        return _finding("numa", f"{len(nodes)} node{'s' * (len(nodes) > 1)} ({listed})",
                        f"The nodes report {fmt_bytes(on_nodes)} of the host's "
                        f"{fmt_bytes(host_total)}: this container or VM shows partial NUMA "
                        f"data, so bind ranks from the host's own topology (numactl -H there).",
                        "note", ["numactl -H"], {"nodes": nodes})
    if len(nodes) == 1:
        return _finding("numa", f"1 node ({listed})", "Nothing to do: one node, every core is "
                        "as close to memory as any other.", data={"nodes": nodes})
    return _finding("numa", f"{len(nodes)} nodes ({listed})", "Bind each rank's threads and "
                    "memory to the node its GPU hangs off (nvidia-smi topo -m shows which).",
                    "note", ["nvidia-smi topo -m",
                             "numactl --cpunodebind=0 --membind=0 python train.py"],
                    {"nodes": nodes})


def _memory(mem: dict[str, int]) -> Finding:
    if "MemTotal" not in mem:
        return _unknown("memory", "/proc/meminfo")
    total, avail = mem["MemTotal"], mem.get("MemAvailable", mem.get("MemFree", 0))
    low = avail < total // 10
    return _finding("memory", f"{fmt_bytes(total)} ({fmt_bytes(avail)} available)",
                    "Less than 10% available: something else holds the host's memory." if low
                    else "ZeRO-Offload keeps about 12 bytes per parameter of its shard here "
                    "(fp32 master weights and two Adam moments), plus the gradients.",
                    "warn" if low else "ok", data={"total": total, "available": avail})


def _cgroup(root: Path, total: int | None) -> Finding:
    cg = cgroup_memory(root)
    commands = ["docker run --memory=64g ...", "kubernetes: resources.limits.memory"]
    if cg["version"] is None:
        return _finding("cgroup", UNKNOWN, "No memory cgroup found: the host's RAM is the limit "
                        "(or this is not Linux).", "note", data=cg)
    usage = f", {fmt_bytes(cg['usage'])} used" if cg["usage"] is not None else ""
    if cg["limit"] is None:
        return _finding("cgroup", f"no limit (cgroup v{cg['version']}{usage})",
                        "Nothing to do: the host's RAM is the limit.", data=cg)
    value = f"{fmt_bytes(cg['limit'])} (cgroup v{cg['version']}{usage})"
    if cg["usage"] is not None and cg["usage"] > 0.9 * cg["limit"]:
        return _finding("cgroup", value, "Over 90% used: the next host allocation (a checkpoint "
                        "load, more workers) may be OOM-killed; raise the limit or use less "
                        "host memory.", "warn", commands, cg)
    below = total is not None and cg["limit"] < total
    return _finding("cgroup", value, "Budget host memory against this limit"
                    + (", which is below the host's RAM." if below else "."),
                    "note" if below else "ok", commands if below else [], cg)


def _swap(root: Path, mem: dict[str, int]) -> Finding:
    if "SwapTotal" not in mem:
        return _unknown("swap", "/proc/meminfo")
    swappiness = read_int(root, "proc/sys/vm/swappiness")
    total, free = mem["SwapTotal"], mem.get("SwapFree", 0)
    value = (f"{fmt_bytes(total)} ({fmt_bytes(total - free)} used)" if total else "none")
    value += f", vm.swappiness {UNKNOWN if swappiness is None else swappiness}"
    data = {"total": total, "free": free, "swappiness": swappiness}
    if total and swappiness is not None and swappiness > 10:
        return _finding("swap", value, "Never count on swap as offload memory; a low swappiness "
                        "keeps offloaded states in RAM longer.", "note",
                        ["sudo sysctl vm.swappiness=10"], data)
    return _finding("swap", value, "Nothing to do: size host memory for the job without swap.",
                    data=data)


def _thp(root: Path, environ) -> Finding:
    text = read_text(root, "sys/kernel/mm/transparent_hugepage/enabled")
    if text is None or "[" not in text:
        return _unknown("thp", "/sys/kernel/mm/transparent_hugepage/enabled")
    mode = text[text.index("[") + 1:text.index("]")]
    torch_thp = environ.get("THP_MEM_ALLOC_ENABLE", "0") not in ("", "0")
    data = {"mode": mode, "torch_thp": torch_thp}
    if mode == "madvise":
        return _finding("thp", mode, "Good default: programs ask for huge pages where they help. "
                        + ("THP_MEM_ALLOC_ENABLE=1 is set: PyTorch's CPU allocator asks for them "
                           "on large buffers." if torch_thp else "Optional, measure first: "
                           "THP_MEM_ALLOC_ENABLE=1 makes PyTorch's CPU allocator ask for them on "
                           "large buffers: the first allocation can stall on compaction, later "
                           "ones get faster; memory already faulted in gains little (lab 08, "
                           "section 5)."), data=data)    # no command: nothing here needs fixing
    return _finding("thp", mode, "'always' gives every large mapping huge pages whether it "
                    "wants them or not: fine for most training, but watch RSS; 'madvise' lets "
                    "programs choose." if mode == "always" else "'never' turns huge pages off "
                    "for everyone, PyTorch included; 'madvise' lets programs opt in.", "note",
                    ["sudo sh -c 'echo madvise > /sys/kernel/mm/transparent_hugepage/enabled'"],
                    data)


def _shm(root: Path, statvfs) -> Finding:
    try:
        data = disk_space(root / "dev/shm", statvfs)
    except OSError:
        return _unknown("shm", "/dev/shm")
    size, used, free = data["size"], data["used"], data["free"]
    value = f"{fmt_bytes(size)} ({fmt_bytes(used)} used, {fmt_bytes(free)} free)"
    commands = ["docker run --shm-size=16g ...   # or: docker run --ipc=host ...",
                "kubernetes: mount an emptyDir with medium: Memory at /dev/shm"]
    if size < SMALL_SHM:
        return _finding("shm", value, f"Too small for DataLoader workers ({fmt_bytes(size)}; "
                        "Docker's default is 64 MiB): give the container more, or use "
                        "num_workers=0 for tiny jobs.", "warn", commands, data)
    if free < size // 10:
        return _finding("shm", value, "Nearly full: a crashed job's segments may be holding it; "
                        "look at what is in /dev/shm before the next run.", "warn", commands, data)
    return _finding("shm", value, "Large enough for DataLoader workers (each batch in flight "
                    "lives here).", data=data)


def _shmmax(root: Path) -> Finding:
    value = read_int(root, "proc/sys/kernel/shmmax")
    if value is None:
        return _unknown("shmmax", "/proc/sys/kernel/shmmax")
    return _finding("shmmax", value if value < V1_NO_LIMIT else "no limit", "Nothing to do for "
                    "PyTorch; size /dev/shm instead.", data={"bytes": value})


def _memlock(soft: int, hard: int) -> Finding:
    name = lambda n: "unlimited" if n == resource.RLIM_INFINITY else fmt_bytes(n)
    value, data = f"{name(soft)} (hard {name(hard)})", {"soft": soft, "hard": hard}
    if soft == resource.RLIM_INFINITY:
        return _finding("memlock", value, "Nothing to do.", data=data)
    return _finding("memlock", value, "Fine on one host; for multi-node training over "
                    "InfiniBand make it unlimited.", "note",
                    ["ulimit -l unlimited   # up to the hard limit",
                     "docker run --ulimit memlock=-1:-1 ...",
                     "/etc/security/limits.conf: * soft memlock unlimited"], data)


def _changed(settings) -> str:
    """The fields of a settings dataclass that differ from its defaults, as "name=value"."""
    default = asdict(type(settings)())
    return ", ".join(f"{k}={v}" for k, v in asdict(settings).items() if v != default[k]) \
        or "the defaults"


def _alloc_conf(environ) -> Finding:
    """PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF, checked with labkit.host.allocator's parser."""
    old, new = environ.get("PYTORCH_CUDA_ALLOC_CONF"), environ.get("PYTORCH_ALLOC_CONF")
    # torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF first and PYTORCH_ALLOC_CONF only when it is unset
    # (c10/cuda/CUDAAllocatorConfig.h): the old name wins when both are set.
    name = "PYTORCH_CUDA_ALLOC_CONF" if old is not None else "PYTORCH_ALLOC_CONF"
    text = old if old is not None else new
    data = {"PYTORCH_CUDA_ALLOC_CONF": old, "PYTORCH_ALLOC_CONF": new, "used": name}
    if text is None:
        return _finding("alloc_conf", "unset (defaults)", "When batch shapes change from step "
                        "to step (variable-length sequences), expandable_segments:True cuts "
                        "fragmentation (lab 08 measures it); set it before the first CUDA call. "
                        "The CUDA name works on every torch; PYTORCH_ALLOC_CONF only on recent "
                        "ones.", "ok",
                        ["export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"], data)
    try:
        from labkit.host.alloc_conf import parse_alloc_conf  # lazily
    except ImportError:
        data["parsed"] = "not checked (labkit.host.allocator is missing)"
    else:
        try:
            data["parsed"] = _changed(parse_alloc_conf(text))
        except ValueError as error:
            return _finding("alloc_conf", f"{name}={text}", f"Fix it before CUDA starts, where "
                            f"PyTorch's parser raises on it: {error}", "warn",
                            [f"export {name}=expandable_segments:True"], data)
    if old is not None and new is not None and old != new:
        return _finding("alloc_conf", f"{name}={text}", "Both names are set and differ: PyTorch "
                        "uses PYTORCH_CUDA_ALLOC_CONF and ignores PYTORCH_ALLOC_CONF; keep one.",
                        "warn", ["unset PYTORCH_CUDA_ALLOC_CONF"], data)
    return _finding("alloc_conf", f"{name}={text}", f"PyTorch will use: {data['parsed']}.",
                    data=data)


def _launch_blocking(environ) -> Finding:
    value = environ.get("CUDA_LAUNCH_BLOCKING")
    if value in (None, "", "0"):
        return _finding("launch_blocking", value or "unset",
                        "Nothing to do: launches are asynchronous (the default).")
    return _finding("launch_blocking", value, "Unset it for training (it makes the CPU wait for "
                    "the GPU at every kernel); set it to 1 only to find which line raised an "
                    "asynchronous CUDA error.", "warn", ["unset CUDA_LAUNCH_BLOCKING"])


def _threads(environ, usable: int) -> Finding:
    import torch
    omp, threads = environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    value = f"OMP_NUM_THREADS={omp or 'unset'}, torch uses {threads}, {usable} usable cores"
    data = {"OMP_NUM_THREADS": omp, "torch_threads": threads, "usable_cores": usable}
    if omp is not None and omp.isdigit() and int(omp) > usable:
        return _finding("threads", value, "More threads than cores: they fight for the CPU; "
                        "use usable cores / ranks per host.", "warn",
                        [f"export OMP_NUM_THREADS={max(1, usable)}"], data)
    return _finding("threads", value, "Keep threads x ranks per host at or under the usable "
                    "cores.", data=data)


def _devices_env(environ) -> Finding:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    nccl = {k: v for k, v in sorted(environ.items()) if k.startswith("NCCL_")}
    value = (f"CUDA_VISIBLE_DEVICES={'unset' if visible is None else repr(visible)}; "
             + (", ".join(f"{k}={v}" for k, v in nccl.items()) or "no NCCL_* variables"))
    hidden = visible is not None and visible.strip() in ("", "-1")
    return _finding("devices_env", value, "This hides every GPU from the process." if hidden else
                    "Nothing to do unless a variable here was left over from another job.",
                    "warn" if hidden else "ok",
                    data={"CUDA_VISIBLE_DEVICES": visible, "nccl": nccl})


def gpus() -> tuple[str, list[dict]]:
    """(source, GPUs as {name, total, used, driver}) from NVML, nvidia-smi or torch.cuda."""
    text = lambda v: v.decode() if isinstance(v, bytes) else v    # old pynvml returns bytes
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            driver, found = text(pynvml.nvmlSystemGetDriverVersion()), []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                found.append({"name": text(pynvml.nvmlDeviceGetName(handle)),
                              "total": int(info.total), "used": int(info.used), "driver": driver})
            return "nvml", found
        finally:
            pynvml.nvmlShutdown()
    except Exception:                # no module, no driver, no GPU: try the next source
        pass
    if shutil.which(NVIDIA_SMI[0]):
        try:
            out = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=10).stdout
            rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line]
            return "nvidia-smi", [{"name": n, "total": int(t) << 20, "used": int(u) << 20,
                                   "driver": d} for n, t, u, d in rows]
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    found = torch_gpus()
    return ("torch.cuda", found) if found else ("none", [])


def torch_gpus() -> list[dict]:
    """The GPUs torch itself can use (what ``lk.device()`` picks from), as {name, total, used,
    driver}; [] on a CPU-only build, with no GPU, or with a broken driver."""
    import torch
    try:
        if torch.cuda.is_available():    # properties only: no allocation
            props = map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))
            return [{"name": p.name, "total": p.total_memory, "used": None, "driver": None}
                    for p in props]
    except RuntimeError:             # a broken driver: report no GPU rather than fail
        pass
    return []


def _gpus(probe: bool) -> Finding:
    import torch
    source, found = gpus() if probe else ("not probed", [])
    build = f"torch {torch.__version__}, " + (f"CUDA {torch.version.cuda} build"
                                              if torch.version.cuda else "CPU-only build")
    data = {"source": source, "gpus": found, "torch": torch.__version__,
            "cuda": torch.version.cuda}
    if not found:
        return _finding("gpus", f"no GPU ({build})", "The labs run on the CPU; GPU-only cells "
                        "say so and skip." if probe else "GPUs were not probed.",
                        "note" if probe else "ok", data=data)
    listed = "; ".join(f"{g['name']} {fmt_bytes(g['total'])}"
                       + (f" ({fmt_bytes(g['used'])} used)" if g["used"] is not None else "")
                       for g in found)
    return _finding("gpus", f"{len(found)} via {source}: {listed}", "Memory another process "
                    f"already holds on a GPU is memory this job cannot have ({build}).",
                    data=data)


def host_report(root="/", environ=None, *, statvfs=os.statvfs, affinity=None, cpu_count=None,
                memlock=None, probe_gpus=True) -> HostReport:
    """Read the host under ``root`` and ``environ`` (default os.environ); change nothing.

    The keyword arguments replace what is not a file (the process's CPU affinity, cpu count,
    RLIMIT_MEMLOCK as (soft, hard), statvfs, the GPU probe) so tests can build any host.
    """
    root = Path(root)
    environ = dict(os.environ if environ is None else environ)
    cpu_count = os.cpu_count() if cpu_count is None else cpu_count
    affinity = usable_cpus(cpu_count) if affinity is None else set(affinity)
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK) if memlock is None else memlock
    mem = meminfo(root)
    return HostReport([
        _cpu(affinity, cpu_count), _numa(root, mem.get("MemTotal")), _memory(mem), _cgroup(root, mem.get("MemTotal")),
        _swap(root, mem), _thp(root, environ), _shm(root, statvfs), _shmmax(root),
        _memlock(*memlock), _alloc_conf(environ), _launch_blocking(environ),
        _threads(environ, len(affinity)), _devices_env(environ), _gpus(probe_gpus),
    ])
