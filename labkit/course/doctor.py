"""Before the workshop: does this machine run every lab? (``python -m labkit doctor --course``)

Each check reads one thing the labs need - the Python and torch versions, the packages the
notebooks import, available memory, free disk, CPU cores, a GPU if any - and a smoke run
executes lab 00 at SCALE="ci" with papermill in a temporary folder. A check that is not ok
names its fix: a command to run or an action to take. Like ``labkit.host.system`` (whose readers it
uses) it changes nothing: fixes are printed, never run, and the smoke run's notebook, kernel
and working folder live in a temporary folder that is removed afterwards.

    report = course_report()                      # this machine, smoke run included
    print(report.text()); report.ready            # ready: no check failed
    check_packages(version=fake_version)          # a simulated missing package, in the tests

The versions come from pyproject.toml (tests/test_doctor.py keeps the two equal), the
packages from the notebooks' imports.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.core.units import fmt_bytes
from labkit.host.system import cgroup_memory, disk_space, gpus, meminfo, torch_gpus, usable_cpus

STATUSES = ("ok", "warn", "fail")
GiB = 1 << 30
INSTALL = 'pip install -e ".[dev]"'      # the course's set-up command (README), from its folder
MIN_PYTHON = (3, 10)                     # pyproject.toml's requires-python
# The labs' kernels after Run All at SCALE="ci" on 2 cores (tests/browser, 2026-12-02) hold
# 527, 630, 781, 1,948, 478, 1,269, 682, 730, 471 and 467 MiB (labs 00-09): about 2 GiB for the
# largest (lab 03), plus about 1 GiB for JupyterLab's server and the browser tab that shows it.
MIN_MEMORY = 3 * GiB
# The labs save notebooks (under 0.5 MiB each) and small temporary files; the optional extras
# take about 0.3 GiB installed (transformers 129 MiB, bitsandbytes 125 MiB, torchao 26 MiB) and
# pip's downloads as much again: 1 GiB leaves room for both.
MIN_DISK = 1 * GiB
MIN_CPUS = 2                             # every lab is timed on a 2-core laptop (DESIGN.md)
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
SMOKE_NOTEBOOK = NOTEBOOKS / "00_welcome.ipynb"
SMOKE_BUDGET_S = 20.0                    # lab 00 at "ci" on 2 free cores: 12-20 s
SMOKE_LIMIT_S = 300                      # a cell still running after this has hung


@dataclass
class Check:
    """One thing the labs need: what this machine has, and the fix when it is not ok."""

    name: str
    status: str                                   # "ok" | "warn" | "fail"
    found: str
    fix: str = ""                                 # a command or an action; "" when ok
    data: dict = field(default_factory=dict)      # the numbers behind found (bytes: int)


@dataclass
class CourseReport:
    """Every check, in a fixed order; ``text()`` for people, ``as_dict()`` for JSON."""

    checks: list[Check]

    @property
    def problems(self) -> int:
        return sum(c.status == "fail" for c in self.checks)

    @property
    def ready(self) -> bool:
        return self.problems == 0

    def verdict(self) -> str:
        if not self.ready:
            n = self.problems
            return f"{n} problem{'s' * (n > 1)}: fix {'them' if n > 1 else 'it'} before the workshop"
        smoke = any(c.name == "smoke run" for c in self.checks)
        return "ready: every lab runs here" + ("" if smoke else " (smoke run skipped)")

    def as_dict(self) -> dict:
        return {"ready": self.ready, "problems": self.problems, "verdict": self.verdict(),
                "checks": [asdict(c) for c in self.checks]}

    def text(self) -> str:
        mark = {"ok": "ok", "warn": "warn", "fail": "FAIL"}
        width = max(len(c.name) for c in self.checks) + 2
        lines = [f"{mark[c.status]:<6}{c.name:<{width}}{c.found}"
                 + (f"  -> fix: {c.fix}" if c.fix else "") for c in self.checks]
        return "\n".join(lines + ["", self.verdict()])


# ---- versions: Python, torch and the packages the notebooks import ---------------------------

@dataclass(frozen=True)
class Requirement:
    """A package the labs import: the version they need, and what it is for."""

    name: str             # as pip and importlib.metadata know it
    minimum: str          # lowest version ("": any); with ``pinned``, the one version checked
    needed_by: str
    extra: str = "dev"    # pyproject's extra that installs it; "" for a core dependency
    pinned: bool = False

    @property
    def optional(self) -> bool:
        """An optional extra: missing or another version is a warning, never a failure."""
        return self.extra in ("hf", "production")


REQUIREMENTS = (
    Requirement("torch", "2.13", "labs 04-05 (torch.distributed's all_gather_single, "
                "reduce_scatter_single); the version the course is tested on", ""),
    Requirement("numpy", "", "every lab's figures; lab 03", ""),
    Requirement("matplotlib", "", "every lab's figures", ""),
    Requirement("ipywidgets", "8", "every lab's panel", ""),
    Requirement("tqdm", "", "lab 08's progress bar", ""),
    Requirement("gpu-memory-labs", "", "import labkit in a notebook's kernel"),
    Requirement("jupyterlab", "", "opening the labs: jupyter lab START_HERE.ipynb"),
    Requirement("ipykernel", "", "the Python kernel the labs run in"),
    Requirement("psutil", "", "lab 04 (counts the ranks' processes)"),
    Requirement("papermill", "", "the smoke run below"),
    Requirement("nbclient", "", "papermill's notebook runner"),
    Requirement("transformers", "5.0", "Hugging Face configs in lk.from_hf_config's tests "
                "(no lab needs it)", "hf"),
    Requirement("huggingface_hub", "", "the command line's --model org/name, read from the local "
                "Hugging Face cache (comes with transformers)", "hf"),
    Requirement("bitsandbytes", "0.50.2", "lab 06's side-by-side with bitsandbytes' NF4, "
                "LLM.int8() and 8-bit AdamW (skipped without it)", "production", pinned=True),
    Requirement("torchao", "0.18.0", "lab 06's side-by-side with torchao's int8 (skipped "
                "without it)", "production", pinned=True),
)


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version: "2.13.0+cpu" -> (2, 13, 0); "" -> ()."""
    match = re.match(r"\d+(\.\d+)*", text.strip())
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def check_python(version_info=sys.version_info) -> Check:
    """Python itself: pyproject's requires-python (match statements, ``X | Y`` types)."""
    found = ".".join(map(str, tuple(version_info)[:3]))
    need = ".".join(map(str, MIN_PYTHON))
    if tuple(version_info)[:2] >= MIN_PYTHON:
        return Check("python", "ok", f"{found} (>= {need} needed)")
    return Check("python", "fail", f"{found}, older than {need}",
                 f"install Python {need} or newer (conda env create -f environment.yml brings "
                 "3.11)")


def install_command(req: Requirement, missing: bool) -> str:
    """What installs ``req``: its extra, the version it needs, or the course's set-up command."""
    if req.optional:
        return f'pip install -e ".[{req.extra}]"'
    if req.name == "torch" or (req.minimum and not missing):   # torch: the build comes first
        return f'pip install "{req.name}>={req.minimum}"'
    return INSTALL                     # one command installs every missing package at once


def check_package(req: Requirement, version=importlib.metadata.version) -> Check:
    """One requirement against the installed version that ``version(name)`` returns."""
    bad = "warn" if req.optional else "fail"
    try:
        found = version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return Check(req.name, bad, f"not installed; needed for {req.needed_by}",
                     install_command(req, missing=True))
    data = {"version": found, "minimum": req.minimum}
    have, need = version_tuple(found), version_tuple(req.minimum)
    if req.pinned and have != need:
        return Check(req.name, bad, f"{found}; {req.minimum} is the version checked for "
                     f"{req.needed_by}", install_command(req, missing=False), data)
    if have < need:
        return Check(req.name, bad, f"{found}, older than {req.minimum}; needed for "
                     f"{req.needed_by}", install_command(req, missing=False), data)
    wanted = (f"{req.minimum} checked" if req.pinned else f">= {req.minimum} needed"
              if req.minimum else "any version")
    return Check(req.name, "ok", f"{found} ({wanted})", data=data)


def check_packages(version=importlib.metadata.version, requirements=REQUIREMENTS) -> list[Check]:
    """Every requirement; ``version`` is ``importlib.metadata.version`` or a stand-in for it."""
    return [check_package(req, version) for req in requirements]


# ---- the machine: memory, disk, cores, a GPU ------------------------------------------------

def check_memory(mem: dict[str, int], cgroup_limit: int | None = None) -> Check:
    """Memory the labs can have: MemAvailable, capped by the container's limit if any."""
    if "MemAvailable" not in mem:
        return Check("memory", "warn", "unknown (no MemAvailable in /proc/meminfo)",
                     f"check that {fmt_bytes(MIN_MEMORY, 0)} is free (Activity Monitor, Task "
                     "Manager)")
    available = mem["MemAvailable"]
    capped = cgroup_limit is not None and cgroup_limit < available
    available = min(available, cgroup_limit) if capped else available
    found = (f"{fmt_bytes(available, 1)} available"
             + (" (the container's limit)" if capped else "")
             + f", {fmt_bytes(MIN_MEMORY, 0)} needed")
    data = {"available": available, "total": mem.get("MemTotal"), "cgroup_limit": cgroup_limit,
            "needed": MIN_MEMORY}
    if available >= MIN_MEMORY:
        return Check("memory", "ok", found, data=data)
    fix = (f"raise the container's memory limit to {fmt_bytes(MIN_MEMORY + GiB, 0)} "
           "(docker run --memory=4g ...)" if capped else
           f"close programs to free {fmt_bytes(MIN_MEMORY - available, 1)}, or use a machine "
           "with 8 GiB RAM")
    return Check("memory", "fail", found, fix, data)


def check_disk(free: int | None, where: str) -> Check:
    """Free disk where the course runs: saved notebooks and the optional extras' installs."""
    if free is None:
        return Check("disk", "warn", f"unknown (cannot read the filesystem of {where})",
                     f"check that {fmt_bytes(MIN_DISK, 0)} is free on {where}")
    found = f"{fmt_bytes(free, 1)} free on {where}, {fmt_bytes(MIN_DISK, 0)} needed"
    if free >= MIN_DISK:
        return Check("disk", "ok", found, data={"free": free, "needed": MIN_DISK})
    return Check("disk", "fail", found, f"free {fmt_bytes(MIN_DISK - free, 1)} on {where}",
                 {"free": free, "needed": MIN_DISK})


def check_cpus(usable: int) -> Check:
    """Cores this process may use: the labs are timed on 2, lab 04's ranks share them."""
    found = f"{usable} usable core{'s' * (usable != 1)}, {MIN_CPUS} needed"
    if usable >= MIN_CPUS:
        return Check("cpus", "ok", found, data={"usable": usable})
    return Check("cpus", "fail", found, f"use a machine (or container: docker run --cpus="
                 f"{MIN_CPUS} ...) with {MIN_CPUS} cores", {"usable": usable})


def check_gpu(usable: list[dict], present: list[dict], torch_version: str,
              cuda_build: str | None) -> Check:
    """A GPU is never needed; one torch cannot use is worth a word (lk.device() picks CUDA)."""
    listed = lambda found: "; ".join(f"{g['name']} {fmt_bytes(g['total'], 1)}" for g in found)
    data = {"usable": usable, "present": present, "torch": torch_version, "cuda": cuda_build}
    if usable:
        return Check("gpu", "ok", f"{listed(usable)} (torch {torch_version})", data=data)
    if not present:
        return Check("gpu", "ok", "none: every lab runs on the CPU", data=data)
    why = (f"torch {torch_version} is a CPU-only build" if cuda_build is None
           else f"torch's CUDA {cuda_build} build cannot reach its driver")
    return Check("gpu", "warn", f"{listed(present)}, but {why}: every lab runs on the CPU",
                 "for the GPU, install the torch build for your driver "
                 "(https://pytorch.org/get-started/locally/)", data)


# ---- the smoke run: one lab, executed as the workshop will --------------------------------

def _code_cells(nb: dict) -> list[dict]:
    """The notebook's code cells as a learner numbers them (papermill's injected one left out)."""
    return [c for c in nb.get("cells", []) if c.get("cell_type") == "code"
            and "injected-parameters" not in c.get("metadata", {}).get("tags", [])]


def stopped_at(nb: dict) -> dict | None:
    """The cell that raised (or was still running) in papermill's output, as {cell, line,
    error} (error None: it never finished); None when every cell finished."""
    for number, cell in enumerate(_code_cells(nb), 1):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        status = cell.get("metadata", {}).get("papermill", {}).get("status")
        if errors or status in ("running", "failed"):
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else source
            line = next((l.strip() for l in source.splitlines()
                         if l.strip() and not l.startswith("# NBVAL")), "")
            error = f"{errors[0]['ename']}: {errors[0]['evalue']}" if errors else None
            return {"cell": number, "line": line, "error": error}
    return None


def smoke_result(seconds: float, stopped: dict | None, lab: str = SMOKE_NOTEBOOK.name,
                 budget_s: float = SMOKE_BUDGET_S) -> Check:
    """An error fails, naming the cell; a slow but finished run only warns, with its time."""
    data = {"seconds": round(seconds, 1), "budget_s": budget_s, "stopped": stopped}
    if stopped:
        where = f"cell {stopped['cell']} ({stopped['line']})"
        what = (f"raised {stopped['error']}" if stopped["error"] else "never finished (it "
                "hung past the time limit, or the kernel died)")
        missing = (stopped["error"] or "").startswith("ModuleNotFoundError")
        return Check("smoke run", "fail", f"{lab}: {where} {what}",
                     INSTALL if missing else f"open notebooks/{lab} in JupyterLab, run it and "
                     f"read the traceback of cell {stopped['cell']}", data)
    found = f"{lab} ran in {seconds:.1f} s at SCALE=\"ci\" (budget {budget_s:.0f} s)"
    if seconds <= budget_s:
        return Check("smoke run", "ok", found, data=data)
    return Check("smoke run", "warn", found, "the labs run, slowly: close other programs (each "
                 "lab takes up to a minute on 2 free cores)", data)


def smoke_run(notebook: Path = SMOKE_NOTEBOOK, budget_s: float = SMOKE_BUDGET_S,
              limit_s: float = SMOKE_LIMIT_S) -> Check:
    """Execute one lab at SCALE="ci" with papermill, in and into a temporary folder, timed."""
    notebook = Path(notebook)
    if not notebook.exists():
        return Check("smoke run", "fail", f"no {notebook}", "run this from the course folder "
                     "(a clone of the repository), after " + INSTALL)
    if importlib.util.find_spec("papermill") is None:
        return Check("smoke run", "fail", "papermill is not installed", INSTALL)
    with tempfile.TemporaryDirectory(prefix="labkit-smoke-") as folder:
        out = Path(folder) / notebook.name
        command = [sys.executable, "-m", "papermill", str(notebook), str(out), "-p", "SCALE",
                   "ci", "--cwd", folder, "--kernel", "python3", "--no-progress-bar",
                   "--execution-timeout", str(int(limit_s))]
        # no __pycache__ written into the course's labkit/ by the kernel's imports
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = proc.communicate(timeout=limit_s + 60)   # + papermill's start and end
        except subprocess.TimeoutExpired:                       # the kernel's own poller ends it
            proc.kill()
            _, stderr = proc.communicate()
        wall = time.perf_counter() - start
        try:
            nb = json.loads(out.read_text())
        except (OSError, ValueError):
            nb = {}
    seconds = nb.get("metadata", {}).get("papermill", {}).get("duration") or wall
    stopped = stopped_at(nb)
    if stopped is None and proc.returncode != 0:               # before the first cell
        last = (stderr.strip().splitlines() or [f"papermill exited with {proc.returncode}"])[-1]
        return Check("smoke run", "fail", f"{notebook.name} did not start: {last}", INSTALL,
                     {"seconds": round(wall, 1), "budget_s": budget_s, "stopped": None})
    check = smoke_result(seconds, stopped, notebook.name, budget_s)
    check.data["wall_s"] = round(wall, 1)                      # with papermill's own start
    return check


# ---- all of it -------------------------------------------------------------------------------

def course_report(smoke: bool = True, *, root="/", workdir=".",
                  version=importlib.metadata.version) -> CourseReport:
    """Every check on this machine; ``root`` (a fake /proc) and ``version`` for the tests."""
    import torch
    try:
        free = disk_space(workdir)["free"]
    except OSError:
        free = None
    usable = torch_gpus()
    present = [] if usable else gpus()[1]          # a GPU torch cannot use, if any
    checks = [check_python(), *check_packages(version),
              check_memory(meminfo(root), cgroup_memory(root)["limit"]),
              check_disk(free, str(Path(workdir).resolve())),
              check_cpus(len(usable_cpus())),
              check_gpu(usable, present, torch.__version__, torch.version.cuda)]
    return CourseReport(checks + ([smoke_run()] if smoke else []))
