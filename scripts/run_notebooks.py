"""Re-execute the course notebooks in place at SCALE="ci", keeping their outputs.

    python scripts/run_notebooks.py                      # every notebooks/*.ipynb
    python scripts/run_notebooks.py 03_activations       # or those named (stem or path)
    python scripts/run_notebooks.py --check              # execute, compare, write nothing
    python scripts/run_notebooks.py 03_activations --to out.ipynb   # the executed copy, as is

Each notebook runs with papermill from its own folder (notebooks/), then is saved without
what would only add noise to a diff: papermill's injected cell and metadata, per-cell
timings and widget state. tests/test_notebooks.py uses the same ``execute`` and
``compare_checked``: the text a cell marked ``# NBVAL_CHECK_OUTPUT`` prints must equal the
committed text, on every machine, so such a cell prints only bytes, counts and verdicts
(CONTRIBUTING.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import copy
import difflib
import re

import nbformat
import papermill
from nbclient.exceptions import CellTimeoutError
from papermill.exceptions import PapermillExecutionError

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CI = {"SCALE": "ci"}
CELL_TIMEOUT_S = 300          # a hung cell fails the run, naming the cell, instead of stalling it
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"


def find(names=()) -> list[Path]:
    """The notebooks named (by stem, file name or path), or all of notebooks/*.ipynb."""
    if not names:
        return sorted(NOTEBOOKS.glob("*.ipynb"))
    paths = []
    for name in names:
        path = Path(name) if Path(name).suffix == ".ipynb" else NOTEBOOKS / f"{name}.ipynb"
        if not path.exists():
            raise SystemExit(f"no notebook {name!r} (looked for {path})")
        paths.append(path.resolve())
    return paths


def execute(path: Path, parameters: dict = CI, output: Path | None = None):
    """Run ``path`` with papermill from its own folder; returns the executed notebook."""
    return papermill.execute_notebook(
        str(path), str(output) if output else None, parameters=parameters,
        kernel_name="python3", cwd=str(path.parent), progress_bar=False,
        execution_timeout=CELL_TIMEOUT_S)


def alt_parameters(nb) -> dict:
    """The one alternative parameter set a notebook declares in its metadata
    (``"labkit": {"alt_parameters": {"MODEL": "mistral-7b"}}``), or {}: the browser test runs
    the notebook with it, as a learner who edits the parameters cell would."""
    alt = nb.metadata.get("labkit", {}).get("alt_parameters", {})
    if not isinstance(alt, dict):
        raise ValueError(f"alt_parameters must be one dict of parameters, got {alt!r}: each "
                         "notebook runs once in the browser, with one alternative set at most")
    return alt


def with_parameters(nb, parameters: dict):
    """A copy of ``nb`` with a cell setting ``parameters`` after its `parameters` cell, tagged
    `injected-parameters` as papermill tags its own."""
    nb = copy.deepcopy(nb)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    source = "# Injected parameters\n" + "".join(f"{k} = {v!r}\n" for k, v in parameters.items())
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(
        source, metadata={"tags": ["injected-parameters"]}))
    return nb


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# tqdm's bar as text: "desc:   0%|          | 0/60 [00:00<?, ?it/s]"
PROGRESS_BAR = re.compile(r"\d+%\|.*\| *\d+/\d+ \[")


def is_progress_bar(output) -> bool:
    """A tqdm bar shown as a widget: without its state only its first frame (0%) would stay."""
    data = output.get("data", {})
    return WIDGET_VIEW in data and bool(PROGRESS_BAR.search(data.get("text/plain", "")))


def clean(nb):
    """Drop papermill's injected cell and metadata, cell timings, widget state and progress bars;
    keep outputs."""
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    nb.metadata.pop("papermill", None)
    nb.metadata.pop("widgets", None)
    count = 0
    for cell in nb.cells:
        for key in ("papermill", "execution"):
            cell.metadata.pop(key, None)
        if cell.metadata.get("tags") == []:
            del cell.metadata["tags"]
        if cell.cell_type != "code":
            continue
        count += 1                        # renumber: no gap where the injected cell was
        cell.execution_count = count
        cell.outputs = _joined_streams([o for o in cell.outputs if not is_progress_bar(o)])
        for output in cell.outputs:
            if "execution_count" in output:
                output.execution_count = count
            # a widget's view points at the state dropped above: keep its text fallback only
            output.get("data", {}).pop(WIDGET_VIEW, None)
    return nb


def _joined_streams(outputs) -> list:
    """Consecutive stdout (or stderr) chunks as one output: how the kernel chunked a cell's
    prints depends on the machine's load, and must not show in a diff."""
    joined = []
    for output in outputs:
        if (output.output_type == "stream" and joined and joined[-1].output_type == "stream"
                and joined[-1].name == output.name):
            joined[-1].text += output.text
        else:
            joined.append(output)
    return joined


def _printed(cell) -> str:
    """What a code cell showed as text: its stdout (however the kernel chunked it) and the
    plain-text form of its results. stderr (warnings, progress bars) is left out."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream" and output.name == "stdout":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.get("data", {}).get("text/plain", "") + "\n")
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}\n")
    return "".join(parts)


def checked_outputs(nb) -> dict[int, tuple[str, str]]:
    """{code cell number: (first line of its code, printed text)} for the cells marked
    ``# NBVAL_CHECK_OUTPUT`` (papermill's injected cell is not counted)."""
    nb = clean(copy.deepcopy(nb))
    code = [c for c in nb.cells if c.cell_type == "code"]
    return {i: (next((line for line in c.source.splitlines()
                      if line.strip() and CHECK_MARK not in line), ""), _printed(c))
            for i, c in enumerate(code, 1) if CHECK_MARK in c.source}


def compare_checked(expected, executed) -> list[str]:
    """One message per checked cell whose printed text differs from the committed one."""
    want, got = checked_outputs(expected), checked_outputs(executed)
    problems = []
    if set(want) != set(got):
        problems.append(f"checked cells moved: committed {sorted(want)}, executed {sorted(got)}"
                        " (re-run scripts/run_notebooks.py)")
    for i in sorted(set(want) & set(got)):
        (code, before), (_, after) = want[i], got[i]
        if before != after:
            diff = difflib.unified_diff(before.splitlines(), after.splitlines(), "committed",
                                        "executed", lineterm="", n=0)
            problems.append(f"cell [{i}] `{code}` printed something else:\n" + "\n".join(diff))
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="stems or paths (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="compare the checked cells with the committed outputs; write nothing")
    parser.add_argument("--to", type=Path, metavar="OUT.ipynb",
                        help="execute one notebook into OUT.ipynb (kept as executed, even when a "
                             "cell fails); compare nothing, leave the committed one as it is")
    parser.add_argument("--parameters", type=json.loads, default={}, metavar="JSON",
                        help='with --to: parameters beside SCALE="ci", e.g. \'{"MODEL": "tiny"}\'')
    args = parser.parse_args(argv)
    paths = find(args.notebooks)
    if args.to:
        if len(paths) != 1:
            parser.error("--to takes exactly one notebook")
        try:
            execute(paths[0], {**CI, **args.parameters}, output=args.to)
        except (PapermillExecutionError, CellTimeoutError) as error:   # the cell, not a stack
            print(error)
            return 1
        return 0
    if not paths:
        print(f"no notebooks in {NOTEBOOKS}")
    failed = 0
    for path in paths:
        start = time.perf_counter()
        nb = execute(path)
        problems = compare_checked(nbformat.read(str(path), as_version=4), nb)
        if args.check:
            failed += bool(problems)
            print("\n".join(problems))
        else:
            nbformat.write(clean(nb), str(path))
        print(f"{time.perf_counter() - start:6.1f} s  {path.name}"
              + (f"  ({len(problems)} checked cells differ)" if problems else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
