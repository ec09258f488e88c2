"""Shared pytest hooks: a closing summary of how long each notebook took to execute, and a
one-thread fixture for tests of many small ops."""
import pytest
import torch

NOTEBOOK_SECONDS = "notebook_seconds"


@pytest.fixture
def record_notebook_seconds(record_property):
    """Record a notebook's execution time: kept in the report (JUnit XML too) and summarised."""
    return lambda seconds: record_property(NOTEBOOK_SECONDS, round(seconds, 1))


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
