"""Fixtures of the browser test: a scratch copy of the notebooks served by JupyterLab, headless
Chromium (Debian's ``chromium`` driven by Playwright), a folder for screenshots, and a watch
that fails the session if any server, kernel or browser process outlives it."""
import os
import shutil
from pathlib import Path

import nbformat
import pytest

from labdriver import BROWSER_TIMES, ROOT, LabServer, ProcessWatch, run_notebooks
from lab_checks import OTHER_KERNELS, READ_ONLY_LABS, audited
from readonly_audit import audit_env

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


# Seconds of each lab's Run All in CI's browser runs (2 cores, four runs side by side; clean
# clone of f9b84b5, lab 08 twice, lab 04 less the faster fake FSDP2 optimizer step), to split
# the labs between CI's two browser processes; other tests count 5 s.
LAB_SECONDS = {"04_zero_fsdp": 270, "06_quantization": 265, "08_host_and_allocator": 175,
               "03_activations": 166, "07_attention_kv_cache": 155, "02_mixed_precision": 145,
               "09_capstone": 116, "05_tensor_pipeline_expert": 101, "01_parameter_memory": 35,
               "00_welcome": 27}
SHARD = "LABKIT_BROWSER_SHARD"


def shards(items, count: int) -> list[list]:
    """The browser tests in ``count`` shards of about equal time: each lab's test alone, the
    other tests with their module; the longest first, each to the shard with the least."""
    groups: dict[str, list] = {}
    for item in items:
        lab = item.callspec.params.get("name") if hasattr(item, "callspec") else None
        stem = Path(lab).stem if lab and item.originalname.startswith("test_lab_") else None
        groups.setdefault(stem or item.nodeid.split("::")[0], []).append(item)
    weight = lambda key: LAB_SECONDS.get(key, 5 * len(groups[key]))
    out, totals = [[] for _ in range(count)], [0] * count
    for key in sorted(groups, key=weight, reverse=True):
        i = totals.index(min(totals))
        out[i] += groups[key]
        totals[i] += weight(key)
    return out


def pytest_collection_modifyitems(config, items):
    """LABKIT_BROWSER_SHARD=K/N keeps the K-th of N shards of the browser tests (CI runs two
    processes side by side, one per core); the other tests are left alone."""
    value = os.environ.get(SHARD)
    if not value:
        return
    try:
        k, n = (int(x) for x in value.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"{SHARD}={value!r}: give K/N with 1 <= K <= N, e.g. 1/2")
    browser = [item for item in items if item.get_closest_marker("browser")]
    keep = {id(item) for item in shards(browser, n)[k - 1]}
    dropped = [item for item in browser if id(item) not in keep]
    items[:] = [item for item in items if id(item) not in {id(d) for d in dropped}]
    config.hook.pytest_deselected(items=dropped)


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
            nb = run_notebooks.with_parameters(nb, alt)
        if audited(path.stem):            # its kernel starts under the audit hook
            nb.metadata.kernelspec = {"name": audited_kernel(path.stem), "language": "python",
                                      "display_name": audited_kernel(path.stem)}
        nbformat.write(nb, path)
    return root / "notebooks"


def audited_kernel(stem: str) -> str:
    return f"audited-{stem}"


@pytest.fixture(scope="session")
def audit_logs(tmp_path_factory) -> dict[str, Path]:
    """{lab stem: the folder its audited kernels log to}, for the host lab(s)."""
    return {stem: tmp_path_factory.mktemp(f"audit-{stem}") for stem in READ_ONLY_LABS}


@pytest.fixture(scope="session")
def lab_server(lab_root, tmp_path_factory, watch, audit_logs):
    """JupyterLab whose kernels run with other CPU kernels than the committed outputs were
    made with (lab_checks.OTHER_KERNELS), the host lab's under the audit hook."""
    specs = {audited_kernel(stem): audit_env(folder, {"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
             for stem, folder in audit_logs.items()}
    server = LabServer(lab_root, tmp_path_factory.mktemp("jupyter"), watch,
                       kernel_env=OTHER_KERNELS, kernelspecs=specs)
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
