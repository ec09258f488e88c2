"""The pre-flight check (``python -m labkit doctor --course``) tells a learner whether this machine
runs every lab: each problem is named with its fix, a missing or old package included, and it
changes nothing - the smoke run's notebook and kernel stay in a temporary folder."""
import json
import os
import re
import sys
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest
import torch

from labkit.__main__ import main
from labkit.course import doctor
from labkit.course.doctor import (INSTALL, MIN_DISK, MIN_MEMORY, REQUIREMENTS, SMOKE_NOTEBOOK,
                                  STATUSES, Check, CourseReport, check_cpus, check_disk, check_gpu,
                                  check_memory, check_packages, check_python, smoke_result,
                                  smoke_run, stopped_at, version_tuple)
from labkit.host.system import NVIDIA_SMI, meminfo

sys.path.insert(0, str(Path(__file__).parent))
from readonly_audit import programs, run_audited, writes_outside  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
INSTALLED = {r.name: r.minimum or "1.0" for r in REQUIREMENTS}   # every package at its version


def versions(**changed):
    """An importlib.metadata.version stand-in: every requirement installed at the version it
    needs, except ``changed`` (name -> version, or None: not installed; '_' for '-')."""
    table = {**INSTALLED, **{k.replace("_", "-"): v for k, v in changed.items()}}

    def version(name):
        if table.get(name) is None:
            raise PackageNotFoundError(name)
        return table[name]
    return version


def by_name(checks):
    return {(c["name"] if isinstance(c, dict) else c.name): c for c in checks}


# ---- packages: simulated missing and old ones ------------------------------------------------

def test_every_package_at_the_version_it_needs_is_ok_with_no_fix():
    checks = check_packages(versions())
    assert [c.name for c in checks] == [r.name for r in REQUIREMENTS]
    assert all(c.status == "ok" and c.fix == "" for c in checks)
    assert by_name(checks)["torch"].found == "2.13 (>= 2.13 needed)"


def test_a_missing_package_fails_with_the_pip_command_that_installs_it():
    check = by_name(check_packages(versions(ipywidgets=None)))["ipywidgets"]
    assert check.status == "fail"
    assert check.found == "not installed; needed for every lab's panel"
    assert check.fix == 'pip install -e ".[dev]"' == INSTALL
    others = [c for c in check_packages(versions(ipywidgets=None)) if c.name != "ipywidgets"]
    assert all(c.status == "ok" for c in others)


def test_an_old_torch_fails_with_pip_install_torch_2_13():
    check = by_name(check_packages(versions(torch="2.12.1+cpu")))["torch"]
    assert check.status == "fail"
    assert check.found.startswith("2.12.1+cpu, older than 2.13")
    assert check.fix == 'pip install "torch>=2.13"'


def test_the_torch_floor_is_one_version_everywhere_and_has_the_collectives_labs_04_05_call():
    """pyproject, the pre-flight check and the README state the same floor, and the torch
    the course is tested on has what the floor is for (older ones lack these names)."""
    import torch.distributed as dist
    floor = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert by_name(REQUIREMENTS)["torch"].minimum == floor
    assert f"PyTorch {floor} or newer is required" in (ROOT / "README.md").read_text()
    assert version_tuple(torch.__version__) >= version_tuple(floor)
    assert hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")


def test_a_missing_torch_is_installed_on_its_own_so_its_build_can_be_chosen():
    check = by_name(check_packages(versions(torch=None)))["torch"]
    assert (check.status, check.fix) == ("fail", 'pip install "torch>=2.13"')


def test_an_old_package_fails_with_the_minimum_it_needs():
    check = by_name(check_packages(versions(ipywidgets="7.8.1")))["ipywidgets"]
    assert (check.status, check.fix) == ("fail", 'pip install "ipywidgets>=8"')


def test_the_course_itself_not_installed_fails_with_the_set_up_command():
    # without it a notebook's kernel (started in notebooks/) cannot import labkit
    check = by_name(check_packages(versions(gpu_memory_labs=None)))["gpu-memory-labs"]
    assert (check.status, check.fix) == ("fail", INSTALL)
    assert "import labkit" in check.found


@pytest.mark.parametrize("name, extra", [("transformers", "hf"), ("bitsandbytes", "production"),
                                         ("torchao", "production")])
def test_a_missing_optional_extra_only_warns_and_says_what_it_enables(name, extra):
    check = by_name(check_packages(versions(**{name: None})))[name]
    assert check.status == "warn"
    assert check.fix == f'pip install -e ".[{extra}]"'
    assert check.found.startswith("not installed; needed for ")
    assert ("lab 06" in check.found) == (extra == "production")


def test_another_version_of_a_pinned_extra_warns_never_fails():
    old, new = (by_name(check_packages(versions(bitsandbytes=v)))["bitsandbytes"]
                for v in ("0.49.0", "0.51.0"))
    assert old.status == new.status == "warn"
    assert "0.50.2 is the version checked" in new.found
    assert new.fix == 'pip install -e ".[production]"'


def test_version_tuples_read_local_and_pre_release_versions():
    assert version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert version_tuple("2.6.0.dev20240901") == (2, 6, 0)
    assert version_tuple("8") == (8,) and version_tuple("") == ()
    assert version_tuple("2.10.0") > version_tuple("2.5") > version_tuple("2.4.1")


def test_python_older_than_3_10_fails_and_3_10_is_enough():
    assert check_python((3, 10, 0)).status == "ok"
    old = check_python((3, 9, 18))
    assert old.status == "fail" and old.found == "3.9.18, older than 3.10"
    assert "Python 3.10 or newer" in old.fix


def test_the_checked_versions_are_the_ones_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")
    packaging = pytest.importorskip("packaging.requirements")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    checked = {r.name: r for r in REQUIREMENTS}
    for line in project["dependencies"] + extras["hf"] + extras["production"]:
        declared = packaging.Requirement(line)
        req = checked[declared.name]
        wanted = f"{'==' if req.pinned else '>='}{req.minimum}" if req.minimum else ""
        assert str(declared.specifier) == wanted, declared.name
    dev = {packaging.Requirement(line).name for line in extras["dev"]}
    assert {r.name for r in REQUIREMENTS if r.extra == "dev"} - dev == {"gpu-memory-labs",
                                                                       "nbclient"}
    assert project["requires-python"] == ">=" + ".".join(map(str, doctor.MIN_PYTHON))


def test_every_package_a_notebook_or_labkit_imports_is_checked():
    imported = set()
    sources = [c["source"] for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))
               for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    sources += [p.read_text() for p in sorted((ROOT / "labkit").rglob("*.py"))]
    for source in sources:
        source = "".join(source) if isinstance(source, list) else source
        for match in re.finditer(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", source,
                                 re.M):
            imported.add((match.group(1) or match.group(2)).split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"", "labkit"}
    # zero_core: a module lab 04 writes into a temporary folder; pynvml: optional, system.gpus
    # falls back to nvidia-smi and torch.cuda without it; triton: optional (the `triton` extra),
    # only labkit.transformer.flash_triton imports it and says how to install it
    assert third_party - {"zero_core", "pynvml", "triton"} <= {r.name for r in REQUIREMENTS}
    assert {"torch", "matplotlib", "numpy", "ipywidgets", "psutil", "tqdm"} <= third_party


# ---- the machine: memory, disk, cores, GPU -------------------------------------------------------

def test_memory_below_3_gib_fails_and_names_how_much_to_free():
    check = check_memory({"MemTotal": 16 * GiB, "MemAvailable": 2 * GiB})
    assert check.status == "fail"
    assert check.found == "2.0 GiB available, 3 GiB needed"
    assert check.fix == "close programs to free 1.0 GiB, or use a machine with 8 GiB RAM"
    assert check_memory({"MemTotal": 16 * GiB, "MemAvailable": MIN_MEMORY}).status == "ok"


def test_a_container_limit_below_3_gib_fails_with_the_docker_flag():
    check = check_memory({"MemTotal": 64 * GiB, "MemAvailable": 60 * GiB}, cgroup_limit=2 * GiB)
    assert check.status == "fail" and "the container's limit" in check.found
    assert "docker run --memory=4g" in check.fix
    assert check_memory({"MemAvailable": 60 * GiB}, cgroup_limit=8 * GiB).status == "ok"


def test_memory_is_read_from_proc_meminfo_and_unknown_memory_only_warns(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 2097152 kB\n")
    assert check_memory(meminfo(tmp_path)).data["available"] == 2 * GiB
    assert check_memory(meminfo(tmp_path / "nowhere")).status == "warn"


def test_disk_below_1_gib_fails_naming_the_folder_to_free():
    check = check_disk(MIN_DISK // 4, "/home/learner")
    assert check.status == "fail" and check.fix == "free 768.0 MiB on /home/learner"
    assert check_disk(MIN_DISK, "/home/learner").status == "ok"
    assert check_disk(None, "/home/learner").status == "warn"


def test_one_core_fails_and_two_are_enough():
    assert check_cpus(1).status == "fail" and "--cpus=2" in check_cpus(1).fix
    assert check_cpus(2).status == check_cpus(16).status == "ok"


def test_no_gpu_is_fine_every_lab_runs_on_the_cpu():
    check = check_gpu([], [], "2.13.0+cpu", None)
    assert (check.status, check.found, check.fix) == ("ok", "none: every lab runs on the CPU", "")


def test_a_usable_gpu_is_reported_with_its_name_and_memory():
    h100 = {"name": "NVIDIA H100 80GB HBM3", "total": 81559 << 20, "used": None, "driver": None}
    check = check_gpu([h100], [], "2.13.0+cu128", "12.8")
    assert check.status == "ok" and check.found.startswith("NVIDIA H100 80GB HBM3 79.6 GiB")


def test_a_gpu_that_a_cpu_only_torch_cannot_use_warns_with_where_to_get_the_cuda_build():
    h100 = {"name": "NVIDIA H100 80GB HBM3", "total": 81559 << 20, "used": 0, "driver": "550"}
    check = check_gpu([], [h100], "2.13.0+cpu", None)
    assert check.status == "warn"
    assert "torch 2.13.0+cpu is a CPU-only build: every lab runs on the CPU" in check.found
    assert "pytorch.org/get-started/locally" in check.fix


# ---- the smoke run ---------------------------------------------------------------------------

def test_a_slow_smoke_run_warns_with_its_time_and_a_fast_one_is_ok():
    slow = smoke_result(31.4, None)
    assert slow.status == "warn" and "ran in 31.4 s" in slow.found and "budget 20 s" in slow.found
    assert slow.fix
    assert smoke_result(12.0, None).status == "ok" and smoke_result(12.0, None).fix == ""


def test_a_missing_module_in_the_smoke_run_is_fixed_by_the_set_up_command():
    stopped = {"cell": 2, "line": "import platform",
               "error": "ModuleNotFoundError: No module named 'labkit'"}
    check = smoke_result(3.0, stopped)
    assert check.status == "fail" and check.fix == INSTALL
    assert check.found == ("00_welcome.ipynb: cell 2 (import platform) raised "
                           "ModuleNotFoundError: No module named 'labkit'")


def test_a_cell_that_never_finished_is_named_as_the_one_still_running():
    nb = {"cells": [
        {"cell_type": "code", "source": "SCALE = 'ci'", "metadata": {"tags": ["parameters"]}},
        {"cell_type": "code", "source": ["# injected\n"],
         "metadata": {"tags": ["injected-parameters"]}},
        {"cell_type": "markdown", "source": "prose", "metadata": {}},
        {"cell_type": "code", "source": ["# NBVAL_CHECK_OUTPUT\n", "while True: pass\n"],
         "metadata": {"papermill": {"status": "running"}}}]}
    assert stopped_at(nb) == {"cell": 2, "line": "while True: pass", "error": None}
    assert "cell 2 (while True: pass) never finished" in smoke_result(300, stopped_at(nb)).found


def test_a_smoke_run_that_raises_fails_naming_the_cell(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('SCALE = "workshop"', metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("assert SCALE == 'ci'"),      # papermill's value arrived
        nbformat.v4.new_code_cell('raise ValueError("broken on purpose")')],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}})
    nbformat.write(nb, tmp_path / "broken.ipynb")
    check = smoke_run(tmp_path / "broken.ipynb", budget_s=60, limit_s=120)
    assert check.status == "fail"
    assert check.found == ('broken.ipynb: cell 3 (raise ValueError("broken on purpose")) raised '
                           "ValueError: broken on purpose")
    assert "cell 3" in check.fix
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.ipynb"]   # output elsewhere


def test_a_missing_notebook_fails_with_where_to_run_it(tmp_path):
    check = smoke_run(tmp_path / "00_welcome.ipynb")
    assert check.status == "fail" and "course folder" in check.fix


@pytest.mark.slow
def test_lab_00_runs_as_the_smoke_run_and_writes_nothing_into_the_course_folder(tmp_path):
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}     # where the smoke run's folder goes
    run = run_audited(["-m", "labkit", "doctor", "--course", "--json"], tmp_path / "audit",
                      env=env, cwd=ROOT, timeout=600)
    smoke = by_name(json.loads(run.stdout)["checks"])["smoke run"] if run.stdout else run.stderr
    assert smoke["status"] in ("ok", "warn"), smoke             # slow on a busy machine: a warning
    assert smoke["data"]["seconds"] > 0 and SMOKE_NOTEBOOK.name in smoke["found"]
    # matplotlib's cache goes where it always does; relative names are not paths here: a number
    # is a pipe's file descriptor, a bare name the temporary folder's removal (rmtree's dir_fd)
    written = [os.path.realpath(path) for e in writes_outside(run.events, [tmp_path])
               for path in ([e["path"]] if e["event"] == "open" else e["paths"])
               if os.path.isabs(path)]
    assert [p for p in written if p.startswith(str(ROOT) + os.sep)] == []
    assert [p for p in written if p.startswith(("/proc", "/sys", "/etc", "/dev/", "/usr"))
            and p != os.devnull] == []


# ---- the report, the command line and the read-only proof ------------------------------------

def test_the_verdict_counts_the_failures_and_warnings_do_not_block():
    ok, warn = Check("cpus", "ok", "2 usable cores"), Check("gpu", "warn", "x", "y")
    fail = Check("memory", "fail", "1.0 GiB available", "close programs")
    assert CourseReport([ok, warn]).verdict() == "ready: every lab runs here (smoke run skipped)"
    assert CourseReport([ok, fail]).verdict() == "1 problem: fix it before the workshop"
    assert CourseReport([fail, fail, warn]).verdict() == "2 problems: fix them before the workshop"
    text = CourseReport([ok, fail]).text().splitlines()
    assert text[1].split() [:2] == ["FAIL", "memory"] and text[1].endswith("-> fix: close programs")
    assert text[-1] == "1 problem: fix it before the workshop" and len(text) == 4


def test_doctor_course_exits_1_when_a_check_fails(capsys, monkeypatch):
    failing = CourseReport([Check("ipywidgets", "fail", "not installed", INSTALL)])
    monkeypatch.setattr(doctor, "course_report", lambda smoke: failing)
    assert main(["doctor", "--course", "--no-smoke"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("1 problem: fix it before the workshop")
    assert main(["doctor", "--course", "--no-smoke", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["checks"][0]["fix"] == INSTALL


def test_no_smoke_goes_with_course():
    with pytest.raises(SystemExit):
        main(["doctor", "--no-smoke"])


def test_this_machine_gets_a_line_per_check_and_a_verdict_that_matches_the_exit_code(capsys):
    code = main(["doctor", "--course", "--no-smoke"])
    lines = capsys.readouterr().out.rstrip().splitlines()
    names = [r.name for r in REQUIREMENTS] + ["memory", "disk", "cpus", "gpu"]
    assert [line.split()[1] for line in lines[:-2]] == ["python"] + names
    assert code == (0 if lines[-1].startswith("ready") else 1)
    printed = main(["doctor", "--course", "--no-smoke", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert printed == code and report["ready"] == (code == 0)
    for check in report["checks"]:
        assert check["status"] in STATUSES and check["found"]
        assert bool(check["fix"]) == (check["status"] != "ok"), check
    required = [c for c in report["checks"] if c["name"] in {r.name for r in REQUIREMENTS
                                                            if not r.optional}]
    assert all(c["status"] == "ok" for c in required)       # pip install -e ".[dev]" was run


def test_doctor_course_writes_nothing_outside_a_temp_dir(tmp_path):
    run = run_audited(["-m", "labkit", "doctor", "--course", "--no-smoke", "--json"],
                      tmp_path / "audit", cwd=ROOT)
    assert run.returncode in (0, 1), run.stderr
    opened = [e["path"] for e in run.events if e["event"] == "open"]
    assert any(p.endswith("proc/meminfo") for p in opened)         # the hook saw the reads
    assert writes_outside(run.events, [tmp_path]) == []
    assert all(argv == NVIDIA_SMI for argv in programs(run.events))   # only a read-only query
    assert json.loads(run.stdout)["ready"] == (run.returncode == 0)
