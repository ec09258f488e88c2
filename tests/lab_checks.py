"""What every run of a lab is held to, wherever it runs: with papermill (tests/test_notebooks.py,
the README's test command) or in JupyterLab (tests/browser, where CI runs the labs).

- Other CPU kernels than the committed outputs were made with (an AVX-512 machine's), one
  thread: a checked cell must print the same text under them.
- The host lab (READ_ONLY_LABS) runs under an audit hook (readonly_audit.py) and may write under
  no system folder nor start any program but Python and a few read-only ones.
"""
import os
import sys

import readonly_audit

# A laptop's AVX2 kernels in torch, oneDNN and MKL (1.0-1.2x the time here), or with
# LABKIT_OTHER_KERNELS=sse4 kernels without vector extensions (2-3x the time: labs 02 and 06
# 144 and 316 s). Losses then move in the third decimal; bytes, counts and verdicts must not.
KERNEL_SETS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "sse4": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
             "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
_kernels = os.environ.get("LABKIT_OTHER_KERNELS", "avx2")
if _kernels not in KERNEL_SETS:
    raise ValueError(f"LABKIT_OTHER_KERNELS={_kernels!r}: use one of {', '.join(KERNEL_SETS)}")
OTHER_KERNELS = {**KERNEL_SETS[_kernels], "OMP_NUM_THREADS": "1"}

# The host lab reads the system and changes nothing: its kernel, DataLoader workers and child
# processes write nowhere under the system's folders and start only read-only programs (a
# private mount namespace for the small-/dev/shm run, a GPU query, uname) and Python itself.
READ_ONLY_LABS = {"08_host_and_allocator"}
SYSTEM_FOLDERS = ("/proc", "/sys", "/etc", "/boot", "/usr", "/lib", "/lib64", "/bin", "/sbin",
                  "/dev", "/var", "/opt", "/root/.bashrc", "/root/.profile")
HARMLESS = ("/dev/null",)
PROGRAMS = {"unshare", "nvidia-smi", "uname"}     # uname -p: Python's platform.processor()


def audited(stem: str) -> bool:
    return stem in READ_ONLY_LABS


def check_read_only(events):
    """No write under a system folder; every program started is Python or one of PROGRAMS."""
    assert events, "the audit hook logged nothing: was it installed in the kernel?"
    opened = [e for e in events if e["event"] == "open"]
    assert any(e["path"].startswith("/proc/") for e in opened), "the lab read no /proc file"
    writes = [e for e in readonly_audit.writes_outside(events, [])
              if any(e.get("path", "").startswith(f) or any(p.startswith(f) for p in e.get("paths", []))
                     for f in SYSTEM_FOLDERS)
              and e.get("path") not in HARMLESS]
    assert writes == [], f"the lab wrote under a system folder: {writes[:5]}"
    started = {os.path.basename(argv[0]) for argv in readonly_audit.programs(events)}
    python = {os.path.basename(sys.executable), "python", "python3"}
    assert started <= PROGRAMS | python, f"the lab started {started - PROGRAMS - python}"
