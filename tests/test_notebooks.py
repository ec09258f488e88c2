"""Every notebook executes once at SCALE="ci" under other CPU kernels than the machine's own
(two at a time, each in a process of its own, started in the background when collection ends),
and its checked cells print what is committed: the committed outputs come from the machine's
default kernels, so one run shows both that they are reproduced and that they do not depend on
the kernels. The browser test (tests/browser) makes the same checks in JupyterLab (lab_checks.py
holds what both hold a lab to); CI runs the labs there and here only lab 01, whose browser run
takes its alternative parameters."""
import concurrent.futures
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient.exceptions import CellTimeoutError

import readonly_audit
from lab_checks import OTHER_KERNELS, audited, check_read_only

_spec = importlib.util.spec_from_file_location(
    "run_notebooks", Path(__file__).resolve().parents[1] / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)


def _cases():
    """Each notebook at CI scale."""
    return [pytest.param(path, id=path.stem) for path in run_notebooks.find()] or [pytest.param(
        None, id="no-notebooks", marks=pytest.mark.skip(
            reason=f"no notebooks in {run_notebooks.NOTEBOOKS} yet"))]


def check_conventions(nb):
    """DESIGN.md: a cell tagged `parameters` sets SCALE = "ci"; no widget state is committed."""
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert tagged, "no cell is tagged 'parameters' (papermill needs one)"
    assert re.search(r"""^SCALE\s*=\s*["']ci["']""", tagged[0].source, re.M), \
        'the parameters cell must set SCALE = "ci" (the committed outputs are at CI scale)'
    assert "widgets" not in nb.metadata, "widget state committed: run scripts/run_notebooks.py"


# The notebooks run two at a time, each in a process of its own whose kernel uses one thread,
# beside the other tests: the unit tests alone keep about one of two cores busy (measured: 50%),
# with the notebooks beside them 97-100%. The runs start when collection ends
# (``start_in_background``, called by conftest.py), the longest first; each test then waits
# for its own.
PARALLEL = 2
LONGEST_FIRST = ("04_zero_fsdp", "06_quantization", "03_activations", "05_tensor_pipeline_expert")
TEST_NAME = "test_notebook_executes"
_runs: dict = {}             # case id -> (its folder, a future of (seconds, completed process))
_running: set = set()        # the runner processes alive now, ended if the session stops early


def start_in_background(items, tmp_path_factory) -> None:
    """Submit each selected notebook case: OTHER_KERNELS over our environment, and the
    read-only lab under the audit hook, whose log its test then reads."""
    cases = [item for item in items if item.originalname == TEST_NAME
             and item.callspec.params["path"] is not None]
    rank = {stem: i for i, stem in enumerate(LONGEST_FIRST)}
    cases.sort(key=lambda item: rank.get(item.callspec.params["path"].stem, len(rank)))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL)
    for item in cases:
        path = item.callspec.params["path"]
        folder = tmp_path_factory.mktemp(path.stem)
        environ = {**os.environ, **OTHER_KERNELS}
        if audited(path.stem):          # the kernel and all it starts log their writes
            environ = readonly_audit.audit_env(folder / "audit", environ)
        _runs[item.callspec.id] = folder, pool.submit(_execute, path, folder, environ)
    pool.shutdown(wait=False)


def stop_background() -> None:
    """End every runner still alive, with its kernel and what that started (the session ended
    early: a failure with -x, or Ctrl-C)."""
    for proc in list(_running):
        try:
            family = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(family, timeout=10)


def _execute(path, folder: Path, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    """``scripts/run_notebooks.py --to``, in a new process: (seconds, what it returned)."""
    start = time.perf_counter()
    command = [sys.executable, run_notebooks.__file__, str(path), "--to", str(folder / path.name)]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as runner:
        proc = psutil.Process(runner.pid)
        _running.add(proc)
        try:
            stdout, stderr = runner.communicate(timeout=30 * 60)
        except subprocess.TimeoutExpired:
            runner.kill()
            stdout, stderr = runner.communicate()
        finally:
            _running.discard(proc)
    return time.perf_counter() - start, subprocess.CompletedProcess(
        command, runner.returncode, stdout, stderr)


@pytest.mark.notebook
@pytest.mark.parametrize("path", _cases())
def test_notebook_executes(path, request, tmp_path_factory, record_notebook_seconds):
    committed = nbformat.read(str(path), as_version=4)
    check_conventions(committed)
    if request.node.callspec.id not in _runs:       # collected outside a session's start
        start_in_background([request.node], tmp_path_factory)
    folder, executed = _executed(_runs[request.node.callspec.id], path, record_notebook_seconds)
    problems = run_notebooks.compare_checked(committed, executed)
    assert not problems, f"{path.name} with {OTHER_KERNELS}: " + "\n\n".join(problems)
    if audited(path.stem):
        check_read_only(readonly_audit.read_events(folder / "audit"))


def _executed(run, path, record_seconds=None):
    """Wait for a submitted run: (its folder, the executed notebook); a failure names the cell."""
    folder, future = run
    seconds, done = future.result()
    if record_seconds:
        record_seconds(seconds)
    output = folder / path.name
    if done.returncode != 0:                    # the failing cell, not a stack
        pytest.fail(f"{path.name} failed under {OTHER_KERNELS} (executed copy: {output})\n"
                    f"{done.stdout[-5000:]}\n{done.stderr[-3000:]}", pytrace=False)
    return folder, nbformat.read(str(output), as_version=4)


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
