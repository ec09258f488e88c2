"""Every notebook executes once at SCALE="ci" (two at a time, each in a process of its own) and
its checked cells print what is committed; the alternative parameter sets a notebook declares in
its metadata (``"labkit": {"alt_parameters": {"MODEL": "mistral-7b"}}``) run again, and every
notebook again under other CPU kernels, marked slow."""
import concurrent.futures
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellTimeoutError

import readonly_audit

_spec = importlib.util.spec_from_file_location(
    "run_notebooks", Path(__file__).resolve().parents[1] / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)


def _cases():
    """(notebook, parameters) for each notebook at CI scale, then for each alternative set."""
    cases = []
    for path in run_notebooks.find():
        cases.append(pytest.param(path, run_notebooks.CI, id=path.stem))
        alts = nbformat.read(str(path), as_version=4).metadata.get("labkit", {}).get(
            "alt_parameters", [])
        for alt in alts if isinstance(alts, list) else [alts]:
            label = ",".join(f"{k}={v}" for k, v in alt.items())
            cases.append(pytest.param(path, {**run_notebooks.CI, **alt},
                                      id=f"{path.stem}:{label}", marks=pytest.mark.slow))
    return cases or [pytest.param(None, None, id="no-notebooks", marks=pytest.mark.skip(
        reason=f"no notebooks in {run_notebooks.NOTEBOOKS} yet"))]


def check_conventions(nb):
    """DESIGN.md: a cell tagged `parameters` sets SCALE = "ci"; no widget state is committed."""
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert tagged, "no cell is tagged 'parameters' (papermill needs one)"
    assert re.search(r"""^SCALE\s*=\s*["']ci["']""", tagged[0].source, re.M), \
        'the parameters cell must set SCALE = "ci" (the committed outputs are at CI scale)'
    assert "widgets" not in nb.metadata, "widget state committed: run scripts/run_notebooks.py"


# The notebooks run two at a time, each in a process of its own whose kernel uses one thread:
# a notebook waits on Python and on its child processes much of the time, so two share a CI
# machine's 2 cores for about half the wall time of one after another. One thread changes no
# checked output (the other-kernels run below uses one too).
PARALLEL = 2
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _execute(path, parameters, folder: Path, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    """``scripts/run_notebooks.py --to``, in a new process: (seconds, what it returned)."""
    extra = {k: v for k, v in parameters.items() if k not in run_notebooks.CI}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, run_notebooks.__file__, str(path), "--to",
                           str(folder / path.name), "--parameters", json.dumps(extra)],
                          env=env, capture_output=True, text=True, timeout=30 * 60)
    return time.perf_counter() - start, done


@pytest.fixture(scope="module")
def notebook_runs(request, tmp_path_factory):
    """Every selected (notebook, parameters) case at CI scale, started PARALLEL at a time; the
    read-only lab under the audit hook, whose log the test then reads."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        yield _submit(pool, request, tmp_path_factory, "test_notebook_executes", ONE_THREAD,
                      audit=True)


def _submit(pool, request, tmp_path_factory, test_name: str, env: dict, audit=False) -> dict:
    """Each selected case of ``test_name``, submitted to ``pool`` with ``env`` over ours (and
    the audit hook, with ``audit``, where ``audited``): {case id: (its folder, a future of
    (seconds, completed process))}."""
    runs = {}
    for item in request.session.items:
        if item.originalname != test_name:
            continue
        path = item.callspec.params["path"]
        parameters = item.callspec.params.get("parameters", run_notebooks.CI)
        folder = tmp_path_factory.mktemp(path.stem)
        environ = {**os.environ, **env}
        if audit and audited(path, parameters):   # the kernel and all it starts log their writes
            environ = readonly_audit.audit_env(folder / "audit", environ)
        runs[item.callspec.id] = folder, pool.submit(_execute, path, parameters, folder, environ)
    return runs


def audited(path, parameters) -> bool:
    return path.stem in READ_ONLY_LABS and parameters == run_notebooks.CI


@pytest.mark.notebook
@pytest.mark.parametrize("path, parameters", _cases())
def test_notebook_executes(path, parameters, request, notebook_runs, record_notebook_seconds):
    committed = nbformat.read(str(path), as_version=4)
    check_conventions(committed)
    folder, executed = _executed(notebook_runs[request.node.callspec.id], path, parameters,
                                 record_notebook_seconds)
    if parameters == run_notebooks.CI:          # other parameters print other numbers
        problems = run_notebooks.compare_checked(committed, executed)
        assert not problems, f"{path.name}: " + "\n\n".join(problems)
    if audited(path, parameters):
        check_read_only(readonly_audit.read_events(folder / "audit"))


def _executed(run, path, parameters, record_seconds=None):
    """Wait for a submitted run: (its folder, the executed notebook); a failure names the cell."""
    folder, future = run
    seconds, done = future.result()
    if record_seconds:
        record_seconds(seconds)
    output = folder / path.name
    if done.returncode != 0:                    # the failing cell, not a stack
        pytest.fail(f"{path.name} with {parameters} failed (executed copy: {output})\n"
                    f"{done.stdout[-5000:]}\n{done.stderr[-3000:]}", pytrace=False)
    return folder, nbformat.read(str(output), as_version=4)


# The host lab reads the system and changes nothing: its kernel, DataLoader workers and child
# processes write nowhere under the system's folders and start only read-only programs (a
# private mount namespace for the small-/dev/shm run, a GPU query, uname) and Python itself.
READ_ONLY_LABS = {"08_host_and_allocator"}
SYSTEM_FOLDERS = ("/proc", "/sys", "/etc", "/boot", "/usr", "/lib", "/lib64", "/bin", "/sbin",
                  "/dev", "/var", "/opt", "/root/.bashrc", "/root/.profile")
HARMLESS = ("/dev/null",)
PROGRAMS = {"unshare", "nvidia-smi", "uname"}     # uname -p: Python's platform.processor()


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


def test_the_read_only_check_fails_on_a_system_write_or_a_changing_program():
    read = {"event": "open", "path": "/proc/meminfo", "mode": "r", "flags": 0, "write": False}
    check_read_only([read, {"event": "open", "path": "/tmp/x/out.pickle", "mode": "wb",
                            "flags": 0, "write": True}])
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    with pytest.raises(AssertionError, match="wrote under a system folder"):
        check_read_only([read, {"event": "open", "path": thp, "mode": "w", "flags": 0,
                                "write": True}])
    with pytest.raises(AssertionError, match="started {'sysctl'}"):
        check_read_only([read, {"event": "subprocess.Popen",
                                "argv": ["sysctl", "-w", "kernel.shmmax=1"]}])


def test_clean_keeps_outputs_and_drops_noise():
    nb = nbformat.v4.new_notebook(metadata={"widgets": {"state": {}}, "papermill": {}})
    injected = nbformat.v4.new_code_cell("SCALE = 'ci'", metadata={"tags": ["injected-parameters"]})
    cell = nbformat.v4.new_code_cell("w", execution_count=7, metadata={
        "tags": [], "papermill": {"duration": 1.0}, "execution": {"iopub.status.busy": "…"}})
    view = {"application/vnd.jupyter.widget-view+json": {}}
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={       # a tqdm bar: its 0% frame goes
            "text/plain": "fine-tuning LoRA r=16:   0%|          | 0/60 [00:00<?, ?it/s]", **view}),
        nbformat.v4.new_output("stream", name="stdout", text="a\n"),
        nbformat.v4.new_output("stream", name="stdout", text="b\n"),
        nbformat.v4.new_output("execute_result", execution_count=7, data={
            "text/plain": "IntSlider(value=3)", **view})]
    nb.cells = [injected, cell]
    nb = run_notebooks.clean(nb)
    assert nb.metadata == {} and len(nb.cells) == 1
    (cell,) = nb.cells
    assert cell.metadata == {} and cell.execution_count == 1
    assert [o.output_type for o in cell.outputs] == ["stream", "execute_result"]
    assert cell.outputs[0].text == "a\nb\n"
    assert cell.outputs[1].data == {"text/plain": "IntSlider(value=3)"}
    assert cell.outputs[1].execution_count == 1


def _notebook(*cells):
    nb = nbformat.v4.new_notebook()
    for source, printed in cells:
        cell = nbformat.v4.new_code_cell(source)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in printed]
        nb.cells.append(cell)
    return nb


def test_checked_cells_compare_printed_text_however_chunked():
    committed = _notebook(("# NBVAL_CHECK_OUTPUT\nprint(n)", ["a\nb\n"]), ("x = 1", ["1.234\n"]))
    same = _notebook(("# NBVAL_CHECK_OUTPUT\nprint(n)", ["a\n", "b\n"]), ("x = 1", ["1.235\n"]))
    assert run_notebooks.compare_checked(committed, same) == []


def test_a_changed_checked_cell_is_named_with_its_difference():
    committed = _notebook(("x = 1", []), ("# NBVAL_CHECK_OUTPUT\nprint(loss)", ["loss 2.783\n"]))
    other = _notebook(("x = 1", []), ("# NBVAL_CHECK_OUTPUT\nprint(loss)", ["loss 2.784\n"]))
    (problem,) = run_notebooks.compare_checked(committed, other)
    assert problem.startswith("cell [2] `print(loss)`")
    assert "-loss 2.783" in problem and "+loss 2.784" in problem


# Other CPU kernels, one thread: torch's own kernels without vector extensions, oneDNN and
# MKL held to SSE4. Losses then move in the third decimal; bytes, counts and verdicts must not.
OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def other_kernel_runs(request, tmp_path_factory):
    """The selected notebooks under OTHER_KERNELS, PARALLEL at a time (one thread each)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        yield _submit(pool, request, tmp_path_factory,
                      "test_checked_cells_print_the_same_with_other_cpu_kernels", OTHER_KERNELS)


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.parametrize("path", run_notebooks.find(), ids=lambda p: p.stem)
def test_checked_cells_print_the_same_with_other_cpu_kernels(path, request, other_kernel_runs):
    _, executed = _executed(other_kernel_runs[request.node.callspec.id], path, OTHER_KERNELS)
    problems = run_notebooks.compare_checked(nbformat.read(str(path), as_version=4), executed)
    assert not problems, f"{path.name} with {OTHER_KERNELS}: " + "\n\n".join(problems)


def test_a_stuck_cell_times_out_naming_the_cell(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": "python3", "language": "python", "display_name": "Python 3"}})
    parameters = nbformat.v4.new_code_cell('SCALE = "ci"', metadata={"tags": ["parameters"]})
    nb.cells = [parameters, nbformat.v4.new_code_cell("import time\ntime.sleep(60)  # stuck")]
    nbformat.write(nb, str(tmp_path / "stuck.ipynb"))
    monkeypatch.setattr(run_notebooks, "CELL_TIMEOUT_S", 2)
    start = time.perf_counter()
    with pytest.raises(CellTimeoutError, match="time.sleep"):
        run_notebooks.execute(tmp_path / "stuck.ipynb")
    assert time.perf_counter() - start < 30
