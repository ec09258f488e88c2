"""Re-execute the course notebooks in place at SCALE="ci", keeping their outputs.

    python scripts/run_notebooks.py                      # every notebooks/*.ipynb
    python scripts/run_notebooks.py 03_activations       # or those named (stem or path)

Each notebook runs with papermill from its own folder (notebooks/), then is saved without
what would only add noise to a diff: papermill's injected cell and metadata, per-cell
timings and widget state. tests/test_notebooks.py uses the same ``execute``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
import papermill

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CI = {"SCALE": "ci"}
CELL_TIMEOUT_S = 600          # a hung cell fails the run instead of stalling it


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


def clean(nb):
    """Drop papermill's injected cell and metadata, cell timings and widget state; keep outputs."""
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
        for output in cell.outputs:
            if "execution_count" in output:
                output.execution_count = count
            # a widget's view points at the state dropped above: keep its text fallback only
            output.get("data", {}).pop("application/vnd.jupyter.widget-view+json", None)
    return nb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="stems or paths (default: all)")
    paths = find(parser.parse_args(argv).notebooks)
    if not paths:
        print(f"no notebooks in {NOTEBOOKS}")
    for path in paths:
        start = time.perf_counter()
        nb = clean(execute(path))
        nbformat.write(nb, str(path))
        print(f"{time.perf_counter() - start:6.1f} s  {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
