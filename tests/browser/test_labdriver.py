"""The browser test's comparison of checked cells, without a browser: a page's cells (as
``window.__lab.cells()`` returns them) made back into a notebook compare equal with the committed
notebook they came from, and a changed number is named."""
import copy

import nbformat

from labdriver import ROOT, NotebookPage, run_notebooks


def page_cells(nb) -> list[dict]:
    """What LAB_JS's cells() gives for ``nb``: code cells with their outputs as JSON."""
    return [{"index": i, "source": c.source, "count": c.execution_count,
             "raw": [dict(o) for o in c.outputs]}
            for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def test_a_pages_cells_compare_equal_and_a_changed_number_is_named():
    committed = nbformat.read(str(ROOT / "notebooks" / "00_welcome.ipynb"), as_version=4)
    cells = page_cells(committed)
    assert run_notebooks.compare_checked(committed, NotebookPage.as_notebook(cells)) == []
    changed = copy.deepcopy(cells)
    checked = next(c for c in changed if c["source"].startswith(run_notebooks.CHECK_MARK)
                   and any(o.get("name") == "stdout" for o in c["raw"]))
    stream = next(o for o in checked["raw"] if o.get("name") == "stdout")
    stream["text"] = stream["text"] + "one more line\n"
    (problem,) = run_notebooks.compare_checked(committed, NotebookPage.as_notebook(changed))
    assert "printed something else" in problem and "+one more line" in problem
