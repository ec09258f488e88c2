"""Shared pytest hooks: slow work that test modules start in the background when collection
ends, a closing summary of how long each notebook took to execute, a one-thread fixture for
tests of many small ops, and the course website built once for the tests that read it."""
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

NOTEBOOK_SECONDS = "notebook_seconds"


@pytest.fixture
def record_notebook_seconds(record_property):
    """Record a notebook's execution time: kept in the report (JUnit XML too) and summarised."""
    return lambda seconds: record_property(NOTEBOOK_SECONDS, round(seconds, 1))


def _modules_with(items, hook: str) -> list:
    modules = {id(item.module): item.module for item in items if hasattr(item, "module")}
    return [m for m in modules.values() if hasattr(m, hook)]


def pytest_collection_modifyitems(items):
    """The tests of such modules go last: they wait for their background work, which runs
    while every other test runs."""
    waiting = {id(m) for m in _modules_with(items, "start_in_background")}
    items.sort(key=lambda item: id(getattr(item, "module", None)) in waiting)


def pytest_collection_finish(session):
    """A test module that defines ``start_in_background(items, tmp_path_factory)`` starts its
    slow work (processes of their own) now, so it runs beside the other tests."""
    if session.config.option.collectonly:
        return
    factory = session.config._tmp_path_factory
    for module in _modules_with(session.items, "start_in_background"):
        module.start_in_background(session.items, factory)


def pytest_sessionfinish(session):
    """... and ``stop_background()`` ends what is still running when the session stops."""
    for module in _modules_with(session.items, "stop_background"):
        module.stop_background()


def pytest_terminal_summary(terminalreporter):
    """List each executed notebook's seconds, whether or not output capture (-s) is on."""
    rows = [(dict(report.user_properties)[NOTEBOOK_SECONDS], report.nodeid)
            for reports in terminalreporter.stats.values() for report in reports
            if getattr(report, "when", None) == "call"
            and NOTEBOOK_SECONDS in dict(getattr(report, "user_properties", ()))]
    if rows:
        terminalreporter.write_sep("-", "notebook execution times")
        for seconds, nodeid in sorted(rows, reverse=True):
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")


@pytest.fixture
def one_thread():
    """One torch thread for the test: small ops (GPTQ's column loop, 8-bit blocks) only wait on
    a second thread, and on 2 shared cores two threads make them many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The course website, built by the README's one command (``scripts/build_site.py --out``).
    Runs side by side share one build through ``LABKIT_SHARED_SITE`` (a folder; CI sets it):
    the first to take its lock builds it, the others wait and read it."""
    shared = os.environ.get("LABKIT_SHARED_SITE")
    out = Path(shared) if shared else tmp_path_factory.mktemp("site") / "site"
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_name(out.name + ".log")
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                 # released when the file closes
        if not log.exists():
            run = subprocess.run([sys.executable, "scripts/build_site.py", "--out", str(out)],
                                 cwd=ROOT, capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, f"the build failed:\n{run.stdout}\n{run.stderr}"
            log.write_text(run.stdout, encoding="utf-8")
    stdout = log.read_text(encoding="utf-8")
    assert "lab pages" in stdout and " s: " in stdout, stdout
    return out
