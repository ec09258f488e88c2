"""Shared pytest hooks: a closing summary of how long each notebook took to execute."""
import pytest

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
