"""Every notebook executes at SCALE="ci", and again with each alternative parameter set it
declares in its metadata: ``"labkit": {"alt_parameters": {"MODEL": "mistral-7b"}}``."""
import importlib.util
import re
import time
from pathlib import Path

import nbformat
import pytest
from papermill.exceptions import PapermillExecutionError

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
                                      id=f"{path.stem}:{label}"))
    return cases or [pytest.param(None, None, id="no-notebooks", marks=pytest.mark.skip(
        reason=f"no notebooks in {run_notebooks.NOTEBOOKS} yet"))]


def check_conventions(nb):
    """DESIGN.md: a cell tagged `parameters` sets SCALE = "ci"; no widget state is committed."""
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert tagged, "no cell is tagged 'parameters' (papermill needs one)"
    assert re.search(r"""^SCALE\s*=\s*["']ci["']""", tagged[0].source, re.M), \
        'the parameters cell must set SCALE = "ci" (the committed outputs are at CI scale)'
    assert "widgets" not in nb.metadata, "widget state committed: run scripts/run_notebooks.py"


@pytest.mark.notebook
@pytest.mark.parametrize("path, parameters", _cases())
def test_notebook_executes(path, parameters, tmp_path, record_notebook_seconds):
    check_conventions(nbformat.read(str(path), as_version=4))
    start, output, error = time.perf_counter(), tmp_path / path.name, None
    try:
        run_notebooks.execute(path, parameters, output=output)
    except PapermillExecutionError as e:        # report the failing cell, not papermill's stack
        error = e
    record_notebook_seconds(time.perf_counter() - start)
    if error:
        pytest.fail(f"{path.name} with {parameters} failed (executed copy: {output})\n{error}",
                    pytrace=False)


def test_clean_keeps_outputs_and_drops_noise():
    nb = nbformat.v4.new_notebook(metadata={"widgets": {"state": {}}, "papermill": {}})
    injected = nbformat.v4.new_code_cell("SCALE = 'ci'", metadata={"tags": ["injected-parameters"]})
    cell = nbformat.v4.new_code_cell("w", execution_count=7, metadata={
        "tags": [], "papermill": {"duration": 1.0}, "execution": {"iopub.status.busy": "…"}})
    cell.outputs = [nbformat.v4.new_output("execute_result", execution_count=7, data={
        "text/plain": "IntSlider(value=3)", "application/vnd.jupyter.widget-view+json": {}})]
    nb.cells = [injected, cell]
    nb = run_notebooks.clean(nb)
    assert nb.metadata == {} and len(nb.cells) == 1
    (cell,) = nb.cells
    assert cell.metadata == {} and cell.execution_count == 1
    assert cell.outputs[0].data == {"text/plain": "IntSlider(value=3)"}
    assert cell.outputs[0].execution_count == 1
