"""Shared pytest hooks: slow work that test modules start in the background when collection
ends, a closing summary of how long each notebook took to execute, and a one-thread fixture for
tests of many small ops."""
import pytest
import torch

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
