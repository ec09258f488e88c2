"""Fixtures of the browser test: a scratch copy of the notebooks served by JupyterLab, headless
Chromium (Debian's ``chromium`` driven by Playwright), a folder for screenshots, and a watch
that fails the session if any server, kernel or browser process outlives it."""
import os
import shutil
from pathlib import Path

import nbformat
import pytest

from labdriver import BROWSER_TIMES, ROOT, LabServer, ProcessWatch, run_notebooks

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


def chromium() -> str:
    path = os.environ.get("CHROMIUM") or next((p for p in CHROMIUM if Path(p).exists()), None)
    if not path:
        pytest.fail("no Chromium: install Debian's (apt-get install chromium) or set CHROMIUM "
                    "to its executable; Playwright's own browser download is not used",
                    pytrace=False)
    return path


@pytest.fixture(scope="session")
def watch():
    """Every process the session starts; after the last test none may be left alive."""
    w = ProcessWatch()
    yield w
    w.look()
    left = w.leftovers()
    w.end_all()
    assert not left, "processes left running after the browser tests:\n" + "\n".join(left)


@pytest.fixture(scope="session")
def lab_root(tmp_path_factory) -> Path:
    """A scratch copy of notebooks/ (and data/, which sits beside it): JupyterLab writes
    checkpoints and autosaves there, never into the repository. A notebook that declares
    alternative parameters gets them in a cell after its parameters cell, as a learner who
    edits that cell would run it (its one run with them)."""
    root = tmp_path_factory.mktemp("lab")
    for folder in ("notebooks", "data"):
        if (ROOT / folder).exists():
            shutil.copytree(ROOT / folder, root / folder,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for path in (root / "notebooks").glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        if alt := run_notebooks.alt_parameters(nb):
            nbformat.write(run_notebooks.with_parameters(nb, alt), path)
    return root / "notebooks"


@pytest.fixture(scope="session")
def lab_server(lab_root, tmp_path_factory, watch):
    server = LabServer(lab_root, tmp_path_factory.mktemp("jupyter"), watch)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def browser(watch):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser test needs Playwright: pip install playwright "
                    "(its browser download is not needed)", pytrace=False)
    executable = chromium()
    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=executable, headless=True)
        watch.look()
        yield b
        watch.look()
        b.close()
    finally:
        pw.stop()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    """Where screenshots go: $BROWSER_ARTIFACTS, or a pytest temporary folder."""
    folder = os.environ.get("BROWSER_ARTIFACTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("browser-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def keep_screenshots():
    """A failed check always leaves its screenshots; the ones that record checks that passed
    (each lab after Run All, each panel before and after) are taken with LABKIT_SCREENSHOTS=1."""
    return os.environ.get("LABKIT_SCREENSHOTS") == "1"



def pytest_terminal_summary(terminalreporter):
    """Each notebook's time in the browser and its kernel's memory, first and second run."""
    rows = [(report.nodeid, dict(report.user_properties)[BROWSER_TIMES])
            for reports in terminalreporter.stats.values() for report in reports
            if getattr(report, "when", None) == "call"
            and BROWSER_TIMES in dict(getattr(report, "user_properties", ()))]
    if rows:
        terminalreporter.write_sep("-", "notebooks in JupyterLab (headless Chromium)")
        for nodeid, line in rows:
            terminalreporter.write_line(f"{line}  {nodeid.split('::')[-1]}")
