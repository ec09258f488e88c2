"""The host's files, read defensively: a missing or odd file is None, never an exception.

/proc/meminfo, the CPU affinity, disk space and the cgroup's memory limit (v1 and v2), from a
root that the tests replace with a fake tree. ``labkit.host.system`` turns them into findings."""
from __future__ import annotations

import os
from pathlib import Path

# cgroup v1 says "no limit" with the largest page-aligned long (9223372036854771712 with 4 KiB
# pages, a little less with 64 KiB pages); anything this large is no limit.
V1_NO_LIMIT = 2 ** 60


def read_text(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_int(root: Path, rel: str) -> int | None:
    text = read_text(root, rel)
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def parse_meminfo(text: str | None) -> dict[str, int]:
    """/proc/meminfo (or a NUMA node's meminfo) as bytes by field name."""
    out = {}
    for line in (text or "").splitlines():
        words = line.replace(":", " ").split()
        if len(words) >= 3 and words[-1] == "kB" and words[-2].isdigit():
            out[words[-3]] = int(words[-2]) * 1024
    return out


def meminfo(root="/") -> dict[str, int]:
    """/proc/meminfo under ``root`` as bytes by field name ({} where it cannot be read)."""
    return parse_meminfo(read_text(Path(root), "proc/meminfo"))


def usable_cpus(cpu_count: int | None = None) -> set[int]:
    """The cores this process may run on: its affinity (a cpuset hides the others)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range((os.cpu_count() if cpu_count is None else cpu_count) or 1))  # macOS: all


def disk_space(path, statvfs=os.statvfs) -> dict[str, int]:
    """Size, used and free bytes (free: what an unprivileged user may still write) of the
    filesystem holding ``path``; raises OSError where it cannot be read."""
    st = statvfs(str(path))
    return {"size": st.f_blocks * st.f_frsize, "used": (st.f_blocks - st.f_bfree) * st.f_frsize,
            "free": st.f_bavail * st.f_frsize}


def cpulist_count(text: str) -> int:
    """CPUs in a kernel cpulist: "0-3,8-11" -> 8; "" -> 0."""
    count = 0
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """(v1 memory path, v2 path) of this process, from /proc/self/cgroup."""
    v1 = v2 = None
    for line in (read_text(root, "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            v1 = parts[2]
        elif len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
    return v1, v2


def parse_limit(text: str | None) -> int | None:
    """A cgroup limit in bytes; None for v2's "max", v1's huge "no limit" value, or no file."""
    return int(text) if text and text.isdigit() and int(text) < V1_NO_LIMIT else None


def cgroup_memory(root="/") -> dict:
    """The memory cgroup's limit, usage and swap limit in bytes (None: no limit or unreadable).

    v1 first (a hybrid host mounts both and puts the memory controller in v1); inside a
    container's cgroup namespace the process's own cgroup is the mount root, so that is tried
    after the path /proc/self/cgroup names.
    """
    root = Path(root)
    v1, v2 = cgroup_paths(root)
    for version, base, files, path in (
            (1, "sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                         "memory.memsw.limit_in_bytes"), v1),
            (2, "sys/fs/cgroup", ("memory.max", "memory.current", "memory.swap.max"), v2)):
        for where in dict.fromkeys((f"{base}/{path.strip('/')}".rstrip("/"), base)) if path else ():
            limit = read_text(root, f"{where}/{files[0]}")
            if limit is not None:
                return {"version": version, "path": path, "limit": parse_limit(limit),
                        "usage": read_int(root, f"{where}/{files[1]}"),
                        "swap_limit": parse_limit(read_text(root, f"{where}/{files[2]}"))}
    return {"version": None, "path": v2 or v1, "limit": None, "usage": None, "swap_limit": None}
