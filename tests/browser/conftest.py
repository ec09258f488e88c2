"""Fixtures of the browser test: a scratch copy of the notebooks served by JupyterLab, headless
Chromium (Debian's ``chromium`` driven by Playwright), a folder for screenshots, and a watch
that fails the session if any server, kernel or browser process outlives it."""
import os
import shutil
from pathlib import Path

import pytest

from labdriver import BROWSER_TIMES, ROOT, LabServer, ProcessWatch

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
    checkpoints and autosaves there, never into the repository."""
    root = tmp_path_factory.mktemp("lab")
    for folder in ("notebooks", "data"):
        if (ROOT / folder).exists():
            shutil.copytree(ROOT / folder, root / folder,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
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
    """Screenshots stay when a check fails; on success only with LABKIT_SCREENSHOTS=1."""
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
