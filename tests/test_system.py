"""The host report reads cgroup v1 and v2, THP, NUMA, /dev/shm and the environment from any
tree, says what each means, and writes nothing: not under /proc, /sys or anywhere else."""
import json
import os
import resource
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from labkit.__main__ import main
from labkit.host.system import NVIDIA_SMI, STATUSES, cgroup_memory, cpulist_count, host_report

sys.path.insert(0, str(Path(__file__).parent))
from readonly_audit import programs, run_audited, writes_outside  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
V1_UNLIMITED = 9223372036854771712          # what cgroup v1 prints for "no limit" (4 KiB pages)
MEMINFO = "MemTotal:       33554432 kB\nMemFree: 1 kB\nMemAvailable:   16777216 kB\n" \
          "SwapTotal:             0 kB\nSwapFree:              0 kB\n"
V1_CGROUP = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"


def statvfs_of(size: int, used: int):
    """A statvfs result for a tmpfs of ``size`` bytes with ``used`` bytes in it (4 KiB blocks)."""
    return lambda path: SimpleNamespace(f_frsize=4096, f_blocks=size // 4096,
                                        f_bfree=(size - used) // 4096,
                                        f_bavail=(size - used) // 4096)


def fake_host(tmp_path, files=None, environ=None, **kwargs):
    """A host tree under tmp_path: a 32 GiB machine in a cgroup v1 with no limit, unless
    ``files`` (path -> text, None to delete) says otherwise; then its report."""
    tree = {"proc/meminfo": MEMINFO, "proc/self/cgroup": V1_CGROUP,
            "sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": str(V1_UNLIMITED),
            "sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes": str(300 * MiB),
            "sys/kernel/mm/transparent_hugepage/enabled": "always [madvise] never",
            "sys/devices/system/node/node0/cpulist": "0-7",
            "sys/devices/system/node/node0/meminfo": "Node 0 MemTotal:  33554432 kB\n",
            "proc/sys/kernel/shmmax": "18446744073692774399", "proc/sys/vm/swappiness": "60",
            **(files or {})}
    for rel, text in tree.items():
        if text is not None:
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text + "\n")
    options = dict(statvfs=statvfs_of(16 * GiB, 0), affinity={0, 1, 2, 3, 4, 5, 6, 7},
                   cpu_count=8, memlock=(8 * MiB, 8 * MiB), probe_gpus=False)
    return host_report(tmp_path, environ={} if environ is None else environ,
                       **{**options, **kwargs})


# ---- cgroup memory: v1 and v2, limited and not ----------------------------------------------

def test_cgroup_v1_unlimited_value_is_reported_as_no_limit(tmp_path):
    f = fake_host(tmp_path).finding("cgroup")
    assert f.status == "ok" and f.value == "no limit (cgroup v1, 300.00 MiB used)"
    assert f.data == {"version": 1, "path": "/process_api/abc", "limit": None,
                      "usage": 300 * MiB, "swap_limit": None}


def test_cgroup_v1_limit_below_host_ram_is_a_note_with_the_docker_flag(tmp_path):
    f = fake_host(tmp_path, {"sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes":
                             str(8 * GiB)}).finding("cgroup")
    assert f.data["limit"] == 8 * GiB and f.status == "note"
    assert f.value == "8.00 GiB (cgroup v1, 300.00 MiB used)"
    assert "docker run --memory=64g ..." in f.commands


def test_cgroup_v1_over_90_percent_used_warns(tmp_path):
    base = "sys/fs/cgroup/memory/process_api/abc/"
    f = fake_host(tmp_path, {base + "memory.limit_in_bytes": str(GiB),
                             base + "memory.usage_in_bytes": str(GiB - 10 * MiB)}).finding("cgroup")
    assert f.status == "warn" and "OOM-killed" in f.recommendation


def test_cgroup_v1_in_a_namespace_is_read_at_the_mount_root(tmp_path):
    # inside a container the cgroup named in /proc/self/cgroup is the mount's root
    f = fake_host(tmp_path, {"sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": None,
                             "sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes": None,
                             "sys/fs/cgroup/memory/memory.limit_in_bytes": str(4 * GiB)}
                  ).finding("cgroup")
    assert f.data["limit"] == 4 * GiB and f.data["usage"] is None


def test_cgroup_v2_memory_max_is_read_at_the_process_path(tmp_path):
    job = "sys/fs/cgroup/user.slice/job-1/"
    fake_host(tmp_path, {"proc/self/cgroup": "0::/user.slice/job-1",
                         job + "memory.max": str(16 * GiB), job + "memory.current": str(GiB),
                         job + "memory.swap.max": "max"})
    assert cgroup_memory(tmp_path) == {"version": 2, "path": "/user.slice/job-1",
                                       "limit": 16 * GiB, "usage": GiB, "swap_limit": None}


def test_cgroup_v2_max_is_no_limit(tmp_path):
    job = "sys/fs/cgroup/job/"
    f = fake_host(tmp_path, {"proc/self/cgroup": "0::/job", job + "memory.max": "max",
                             job + "memory.current": str(2 * GiB)}).finding("cgroup")
    assert f.value == "no limit (cgroup v2, 2.00 GiB used)" and f.data["limit"] is None


# ---- THP, NUMA, /dev/shm, swap, shmmax -------------------------------------------------------

@pytest.mark.parametrize("text, mode, status", [("[always] madvise never", "always", "note"),
                                                ("always [madvise] never", "madvise", "ok"),
                                                ("always madvise [never]", "never", "note")])
def test_thp_mode_is_the_bracketed_word(tmp_path, text, mode, status):
    f = fake_host(tmp_path, {"sys/kernel/mm/transparent_hugepage/enabled": text}).finding("thp")
    assert (f.value, f.status) == (mode, status)
    madvise = "sudo sh -c 'echo madvise > /sys/kernel/mm/transparent_hugepage/enabled'"
    assert (madvise in f.commands) == (mode != "madvise")


def test_thp_madvise_mentions_torch_opt_in_only_when_it_is_off(tmp_path):
    off = fake_host(tmp_path).finding("thp")
    on = fake_host(tmp_path, environ={"THP_MEM_ALLOC_ENABLE": "1"}).finding("thp")
    assert off.commands == on.commands == []           # [ok]: an option to measure, not a fix
    assert "Optional, measure first: THP_MEM_ALLOC_ENABLE=1" in off.recommendation
    assert on.data["torch_thp"] and not off.data["torch_thp"]


def test_one_numa_node_needs_nothing(tmp_path):
    f = fake_host(tmp_path).finding("numa")
    assert f.status == "ok" and f.value == "1 node (node0: cpus 0-7, 32.00 GiB)"


def test_two_numa_nodes_are_listed_with_their_cpus_and_memory(tmp_path):
    nodes = "sys/devices/system/node/"
    f = fake_host(tmp_path, {nodes + "node0/cpulist": "0-3,8-11", nodes + "node1/cpulist": "4-7",
                             nodes + "node1/meminfo": "Node 1 MemTotal:  16777216 kB\n"}
                  ).finding("numa")
    assert f.status == "note" and f.value.startswith("2 nodes")
    assert f.data["nodes"]["node0"] == {"cpus": "0-3,8-11", "cpu_count": 8, "memory": 32 * GiB}
    assert f.data["nodes"]["node1"] == {"cpus": "4-7", "cpu_count": 4, "memory": 16 * GiB}
    assert "nvidia-smi topo -m" in f.commands


def test_cpulist_counts_ranges_and_singles():
    assert cpulist_count("0-3,8-11") == 8 and cpulist_count("5") == 1
    assert cpulist_count("0,2,4-5") == 4 and cpulist_count("") == 0


def test_dockers_64_mib_shm_is_a_warning_that_prints_the_fix(tmp_path):
    f = fake_host(tmp_path, statvfs=statvfs_of(64 * MiB, 16 * MiB)).finding("shm")
    assert f.status == "warn" and f.data == {"size": 64 * MiB, "used": 16 * MiB,
                                             "free": 48 * MiB}
    assert f.value == "64.00 MiB (16.00 MiB used, 48.00 MiB free)"
    assert any("--shm-size" in c and "--ipc=host" in c for c in f.commands)


def test_a_large_but_nearly_full_shm_warns_and_an_empty_one_is_ok(tmp_path):
    assert fake_host(tmp_path).finding("shm").status == "ok"
    assert fake_host(tmp_path, statvfs=statvfs_of(16 * GiB, 15 * GiB)).finding("shm").status \
        == "warn"


def test_shm_statvfs_of_a_real_folder(tmp_path):
    (tmp_path / "dev/shm").mkdir(parents=True)
    f = fake_host(tmp_path, statvfs=os.statvfs).finding("shm")
    st = os.statvfs(tmp_path)
    assert f.data["size"] == st.f_blocks * st.f_frsize


def test_swap_with_high_swappiness_is_a_note_and_no_swap_is_ok(tmp_path):
    assert fake_host(tmp_path).finding("swap").value == "none, vm.swappiness 60"
    swap = MEMINFO.replace("SwapTotal:             0", f"SwapTotal: {8 * GiB // 1024}")
    f = fake_host(tmp_path, {"proc/meminfo": swap}).finding("swap")
    assert f.status == "note" and f.data["total"] == 8 * GiB
    assert f.commands == ["sudo sysctl vm.swappiness=10"]


def test_shmmax_says_pytorch_shares_through_posix_shm_not_system_v(tmp_path):
    f = fake_host(tmp_path, {"proc/sys/kernel/shmmax": str(32 * GiB)}).finding("shmmax")
    assert f.value == 32 * GiB and "shm_open" in f.meaning and "System V" in f.meaning


def test_memory_totals_are_exact_bytes(tmp_path):
    f = fake_host(tmp_path).finding("memory")
    assert f.data == {"total": 32 * GiB, "available": 16 * GiB} and f.status == "ok"


def test_missing_files_give_unknown_never_an_exception(tmp_path):
    report = host_report(tmp_path, environ={}, probe_gpus=False)
    for key in ("numa", "thp", "shm", "shmmax", "memory", "swap", "cgroup"):
        f = report.finding(key)
        assert f.value == "unknown" and f.status == "note" and f.recommendation, key


# ---- limits and variables --------------------------------------------------------------------

def test_memlock_limit_prints_how_to_lift_it_and_unlimited_is_ok(tmp_path):
    f = fake_host(tmp_path).finding("memlock")
    assert f.status == "note" and f.value == "8.00 MiB (hard 8.00 MiB)"
    assert "NCCL over InfiniBand" in f.meaning
    assert "ulimit -l unlimited   # up to the hard limit" in f.commands
    inf = resource.RLIM_INFINITY
    f = fake_host(tmp_path, memlock=(inf, inf)).finding("memlock")
    assert (f.status, f.value, f.commands) == ("ok", "unlimited (hard unlimited)", [])


def test_unset_allocator_settings_suggest_expandable_segments(tmp_path):
    f = fake_host(tmp_path).finding("alloc_conf")
    assert f.status == "ok" and f.value == "unset (defaults)"
    assert f.commands == ["export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]


def test_when_both_names_differ_the_cuda_one_wins_and_it_warns(tmp_path):
    f = fake_host(tmp_path, environ={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                     "PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
                  ).finding("alloc_conf")
    assert f.value == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert f.status == "warn" and f.data["used"] == "PYTORCH_CUDA_ALLOC_CONF"


def test_a_bad_allocator_setting_warns_with_the_parsers_fix(tmp_path):
    allocator = pytest.importorskip("labkit.host.allocator")    # lab 08's allocator module
    bad = "expandable_segment:True"                         # a typo PyTorch refuses at start-up
    with pytest.raises(ValueError) as error:
        allocator.parse_alloc_conf(bad)
    f = fake_host(tmp_path, environ={"PYTORCH_CUDA_ALLOC_CONF": bad}).finding("alloc_conf")
    assert f.status == "warn" and str(error.value) in f.recommendation
    assert f.commands == ["export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]


def test_cuda_launch_blocking_is_for_debugging_not_memory(tmp_path):
    f = fake_host(tmp_path, environ={"CUDA_LAUNCH_BLOCKING": "1"}).finding("launch_blocking")
    assert f.status == "warn" and f.commands == ["unset CUDA_LAUNCH_BLOCKING"]
    assert "nothing about allocation" in f.meaning
    assert fake_host(tmp_path, environ={"CUDA_LAUNCH_BLOCKING": "0"}
                     ).finding("launch_blocking").status == "ok"


def test_more_omp_threads_than_usable_cores_warns(tmp_path):
    f = fake_host(tmp_path, environ={"OMP_NUM_THREADS": "64"}, affinity={0, 1}).finding("threads")
    assert f.status == "warn" and f.commands == ["export OMP_NUM_THREADS=2"]
    assert fake_host(tmp_path, environ={"OMP_NUM_THREADS": "2"}).finding("threads").status == "ok"


def test_a_cpuset_smaller_than_the_machine_is_a_note(tmp_path):
    f = fake_host(tmp_path, affinity={0, 1}, cpu_count=64).finding("cpu")
    assert f.status == "note" and f.value == "2 usable of 64"


def test_nccl_variables_are_listed_and_an_empty_device_list_warns(tmp_path):
    f = fake_host(tmp_path, environ={"CUDA_VISIBLE_DEVICES": "", "NCCL_IB_DISABLE": "1",
                                     "NCCL_DEBUG": "INFO", "HOME": "/root"}).finding("devices_env")
    assert f.data["nccl"] == {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1"}
    assert f.status == "warn" and "NCCL_DEBUG=INFO, NCCL_IB_DISABLE=1" in f.value


def test_asking_for_a_finding_that_is_not_there_names_the_keys(tmp_path):
    with pytest.raises(ValueError, match="use one of cpu, numa"):
        fake_host(tmp_path).finding("hugepages")


# ---- this machine, the command line, and the read-only proof ---------------------------------

def test_this_machine_reports_every_finding_with_meaning_and_advice():
    report = host_report()
    assert len(report.findings) == 14
    for f in report.findings:
        assert f.meaning and f.recommendation and f.status in STATUSES, f.key
        assert f.label in report.text()
    json.dumps(report.as_dict())                            # plain values only


def test_doctor_prints_the_report_and_json_on_request(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "/dev/shm" in out and "Memory cgroup limit" in out and "means:" in out
    assert main(["doctor", "--json"]) == 0
    keys = [f["key"] for f in json.loads(capsys.readouterr().out)["findings"]]
    assert keys == [f.key for f in host_report().findings]


def test_the_audit_sees_writes_and_programs_of_the_whole_process_tree(tmp_path):
    # the proof below can fail: a child's child that writes outside and starts a program is seen
    outside = tmp_path / "outside.txt"
    child = f"import subprocess; open({str(outside)!r}, 'w').close(); subprocess.run(['true'])"
    run = run_audited(["-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                             f"{child!r}])"], tmp_path / "audit")
    assert run.returncode == 0, run.stderr
    assert [e["path"] for e in writes_outside(run.events, [tmp_path / "audit"])] == [str(outside)]
    assert programs(run.events)[-1] == ["true"] and len(programs(run.events)) == 2
    assert len({e["pid"] for e in run.events}) == 2


def test_doctor_writes_nothing_and_starts_only_a_read_only_gpu_query(tmp_path):
    # a stand-in nvidia-smi on PATH, so the one program the report may start is exercised
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559, 4, "
                                        "550.54.15'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    run = run_audited(["-m", "labkit", "doctor", "--json"], tmp_path / "audit", env=env,
                      cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr
    opened = [e["path"] for e in run.events if e["event"] == "open"]
    assert any(p.endswith("proc/meminfo") for p in opened)         # the hook saw the reads
    assert writes_outside(run.events, [tmp_path]) == []
    assert not any(e["write"] and e["path"].startswith(("/proc", "/sys", "/etc", "/dev", "/boot",
                                                         "/usr")) for e in run.events
                   if e["event"] == "open")
    assert all(argv == NVIDIA_SMI for argv in programs(run.events))
    gpus = next(f for f in json.loads(run.stdout)["findings"] if f["key"] == "gpus")["data"]
    if gpus["source"] == "nvidia-smi":          # NVML, where importable, is asked first
        assert programs(run.events) == [NVIDIA_SMI]
        assert gpus["gpus"][0] == {"name": "NVIDIA H100 80GB HBM3", "total": 81559 * MiB,
                                   "used": 4 * MiB, "driver": "550.54.15"}


def test_numa_nodes_with_less_memory_than_the_host_are_a_note(tmp_path):
    # a sandbox's one node of 16 GiB on a host of 32 GiB: partial NUMA data, said so
    nodes = "sys/devices/system/node/"
    f = fake_host(tmp_path, {nodes + "node0/meminfo": "Node 0 MemTotal:  16777216 kB\n"}
                  ).finding("numa")
    assert f.status == "note" and "16.00 GiB of the host's 32.00 GiB" in f.recommendation
