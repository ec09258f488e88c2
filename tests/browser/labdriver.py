"""Drive JupyterLab in headless Chromium: a server on a scratch folder, a notebook page that
runs all cells and reports each cell, a panel whose controls are moved, and screenshots.

The browser test (test_labs_in_browser.py) uses these; they hold no assertions of their own
except ``Page.fail``, which screenshots the page and names the file in the failure.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import psutil

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)      # alt parameters, compare_checked
_spec.loader.exec_module(run_notebooks)
BROWSER_TIMES = "browser_times"           # the user property the closing summary prints
# JupyterLab's settings for the test: every cell attached to the page (the default
# "contentVisibility" skips painting cells off screen), no request for Jupyter news.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessWatch:
    """Every process started under this one (server, kernels, browser), seen at each
    ``look()``; ``leftovers()`` names those still alive. Kernels start in sessions of their
    own, so killing the server's process group does not reach them: they are watched here."""

    def __init__(self):
        self.me = psutil.Process()
        self.seen: dict[int, psutil.Process] = {}

    def look(self, *roots: psutil.Process) -> None:
        for root in (self.me, *roots):
            try:
                for p in root.children(recursive=True):
                    self.seen.setdefault(p.pid, p)
            except psutil.NoSuchProcess:
                pass

    def end_all(self, timeout: float = 15) -> None:
        """Terminate what is still alive, then kill what ignored it."""
        alive = [p for p in self.seen.values() if p.is_running()]
        for p in alive:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=timeout)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)

    def leftovers(self) -> list[str]:
        out = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        return out


class LabServer:
    """``jupyter lab`` serving ``root`` on 127.0.0.1, a free port and a random token, in its
    own process group, with its settings, workspaces and runtime files under ``home``."""

    def __init__(self, root: Path, home: Path, watch: ProcessWatch,
                 kernel_env: dict | None = None, kernelspecs: dict | None = None):
        """``kernel_env``: variables every kernel gets (the server's environment);
        ``kernelspecs``: {name: variables} for kernels of their own, which a notebook whose
        metadata names the kernelspec starts with."""
        self.root, self.home, self.watch = root, home, watch
        self.port, self.token = free_port(), secrets.token_hex(16)
        settings = home / "user-settings"
        for name, value in SETTINGS.items():
            (settings / name).parent.mkdir(parents=True, exist_ok=True)
            (settings / name).write_text(json.dumps(value))
        for name, variables in (kernelspecs or {}).items():
            spec = home / "data" / "kernels" / name / "kernel.json"
            spec.parent.mkdir(parents=True, exist_ok=True)
            spec.write_text(json.dumps({
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": name, "language": "python", "env": variables}))
        env = dict(os.environ, **(kernel_env or {}), JUPYTER_CONFIG_DIR=str(home / "config"),
                   JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_PATH=os.pathsep.join(
                       filter(None, [str(home / "data"), os.environ.get("JUPYTER_PATH")])),
                   PYDEVD_DISABLE_FILE_VALIDATION="1")
        self.log = home / "server.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
             "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}",
             f"--IdentityProvider.token={self.token}", "--LabApp.expose_app_in_browser=True",
             f"--LabApp.user_settings_dir={settings}",
             f"--LabApp.workspaces_dir={home / 'workspaces'}"],
            cwd=root, env=env, start_new_session=True,
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)
        watch.look(self.ps)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"jupyter lab did not answer /api/status in {timeout} s; see {self.log}")

    def url(self, path: str, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path}?{query}token={self.token}"

    def api(self, path: str, method: str = "GET"):
        """Call the server's REST API; returns the decoded JSON (None when empty)."""
        request = urllib.request.Request(self.url(f"api/{path}"), method=method)
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self, timeout: float = 20) -> None:
        """Shut every kernel down (a closed page leaves its kernel running) and wait for
        their processes to end."""
        procs = []
        for k in self.api("kernels"):
            try:
                procs.append(self.kernel_process(k["id"]))
            except LookupError:
                pass
            self.api(f"kernels/{k['id']}", method="DELETE")
        psutil.wait_procs(procs, timeout=timeout)

    def kernel_process(self, kernel_id: str) -> psutil.Process:
        """The ipykernel process of ``kernel_id`` (its connection file names the id)."""
        self.watch.look(self.ps)
        for p in self.ps.children(recursive=True):
            try:
                if any(f"kernel-{kernel_id}.json" in arg for arg in p.cmdline()):
                    return p
            except psutil.NoSuchProcess:
                pass
        raise LookupError(f"no process for kernel {kernel_id}")

    def stop(self) -> None:
        """SIGTERM the server's group (it shuts its kernels down), SIGKILL it if it lingers."""
        self.watch.look(self.ps)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


# Installed once per page: what the test reads from JupyterLab's own objects.
LAB_JS = r"""
() => {
  const app = window.jupyterapp;
  const panel = () => app.shell.currentWidget;
  window.__lab = {
    kernel() {
      const k = panel().sessionContext.session && panel().sessionContext.session.kernel;
      return k ? {id: k.id, status: k.status, connection: k.connectionStatus} : null;
    },
    // per code cell: index, first line, execution count, prompt ("[*]:" while queued or running)
    progress() {
      return panel().content.widgets.map((c, i) => c.model.type !== 'code' ? null : {
        index: i, head: c.model.sharedModel.getSource().split('\n')[0].slice(0, 80),
        count: c.model.executionCount, prompt: c.promptNode ? c.promptNode.textContent : ''})
        .filter(Boolean);
    },
    // per code cell: its source, its outputs as text (images as their mime type only) and
    // as the notebook file would store them (raw)
    cells() {
      const text = t => Array.isArray(t) ? t.join('') : (t || '');
      return panel().content.widgets.map((c, i) => c.model.type !== 'code' ? null : {
        index: i, source: c.model.sharedModel.getSource(), count: c.model.executionCount,
        outputs: c.model.outputs.toJSON().map(o => ({type: o.output_type, name: o.name || '',
          text: o.output_type === 'stream' ? text(o.text)
              : o.output_type === 'error' ? o.ename + ': ' + o.evalue + '\n' +
                  (o.traceback || []).join('\n').replace(/\x1b\[[0-9;]*m/g, '')
              : text((o.data || {})['text/plain']),
          mimes: Object.keys(o.data || {})})),
        raw: c.model.outputs.toJSON()}).filter(Boolean);
    },
    run(command) {
      window.__run = {done: false, result: null, error: null};
      app.commands.execute(command).then(
        r => { window.__run = {done: true, result: String(r), error: null}; },
        e => { window.__run = {done: true, result: null, error: String(e)}; });
    },
    // errors the kernel publishes outside any cell's run (a widget callback that raises)
    listen() {
      window.__errors = [];
      panel().sessionContext.iopubMessage.connect((_, msg) => {
        const t = msg.header.msg_type, c = msg.content;
        if (t === 'error')
          window.__errors.push(c.ename + ': ' + c.evalue + '\n' +
                               c.traceback.join('\n').replace(/\x1b\[[0-9;]*m/g, ''));
        else if (t === 'stream' && c.name === 'stderr' && /Traceback|Error/.test(c.text))
          window.__errors.push(c.text);
      });
    },
    mark(index, name) { panel().content.widgets[index].node.setAttribute('data-lab-test', name); },
    height() {          // the notebook's full height (its scrolling element in JupyterLab 4)
      const nb = panel().content.node;
      return (nb.querySelector('.jp-WindowedPanel-outer') || nb).scrollHeight;
    },
    top() {
      const nb = panel().content.node;
      (nb.querySelector('.jp-WindowedPanel-outer') || nb).scrollTop = 0;
    },
  };
}
"""


class CheckFailed(AssertionError):
    """A check on the page failed; the message names the screenshot taken at that moment."""


class NotebookPage:
    """One notebook open in JupyterLab in its own browser page."""

    def __init__(self, browser, server: LabServer, name: str, artifacts: Path, keep: bool = True):
        self.server, self.name, self.stem = server, name, Path(name).stem
        self.artifacts, self.keep = artifacts, keep
        artifacts.mkdir(parents=True, exist_ok=True)
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.page.set_default_timeout(60_000)
        # a workspace of its own, reset: JupyterLab would otherwise reopen every notebook an
        # earlier page had open (each with its kernel) in the shared default workspace
        workspace = f"{self.stem}-{secrets.token_hex(4)}"
        self.page.goto(server.url(f"lab/workspaces/{workspace}/tree/{name}", query="reset&"))
        self.shots: list[Path] = []
        try:
            self.page.wait_for_function(
                "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                " && window.jupyterapp.shell.currentWidget.sessionContext"
                " && window.jupyterapp.shell.currentWidget.sessionContext.isReady",
                timeout=120_000)
        except Exception as e:            # e.g. a kernel-selection dialog, a server error
            try:
                self.fail(f"the notebook did not open with a kernel within 120 s "
                          f"({type(e).__name__})")
            finally:
                self.close()
        self.page.evaluate(LAB_JS)
        self.page.evaluate("() => window.__lab.listen()")

    def close(self) -> None:
        """Close the page, then shut its kernel (and any other) down."""
        self.context.close()
        self.server.shut_down_kernels()

    # ---- screenshots and failures -----------------------------------------------------------
    def screenshot(self, label: str, locator=None, whole: bool = False) -> Path:
        """A PNG of ``locator``, of the whole notebook (``whole``: the viewport made as tall as
        the notebook, up to 32,000 px), or of the page."""
        path = self.artifacts / f"{self.stem}-{label}.png"
        if locator is not None:
            locator.screenshot(path=str(path))
        elif whole:
            size = self.page.viewport_size
            tall = min(self.page.evaluate("() => window.__lab ? window.__lab.height() : 0") + 200,
                       32_000)
            self.page.set_viewport_size({"width": size["width"],
                                         "height": max(tall, size["height"])})
            try:
                self.page.wait_for_timeout(300)            # let the layout settle
                self.page.evaluate("() => window.__lab && window.__lab.top()")
                self.page.wait_for_timeout(200)
                self.page.screenshot(path=str(path))
            finally:
                self.page.set_viewport_size(size)
        else:
            self.page.screenshot(path=str(path))
        self.shots.append(path)
        return path

    def snapshot(self, label: str, locator=None, whole: bool = False) -> Path | None:
        """A screenshot kept as a record of a check that passed: taken only when the page keeps
        them (a whole notebook is a PNG of up to 1400 x 32,000 px, seconds of CPU each)."""
        return self.screenshot(label, locator, whole) if self.keep else None

    def fail(self, message: str, locator=None):
        """Screenshot the page (and ``locator``) now, then fail naming the files."""
        names = []
        for label, loc in (("FAILED-page", None), ("FAILED-panel", locator)):
            if label == "FAILED-panel" and loc is None:
                continue
            try:
                names.append(str(self.screenshot(label, loc, whole=loc is None)))
            except Exception as e:                           # the page itself may be gone
                names.append(f"(no {label} screenshot: {e})")
        raise CheckFailed(f"{self.name}: {message}\nscreenshot: " + "\n            ".join(names))

    # ---- running ----------------------------------------------------------------------------
    def kernel(self) -> dict | None:
        return self.page.evaluate("() => window.__lab.kernel()")

    def wait_kernel_idle(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            k = self.kernel()
            if k and k["status"] == "dead":
                self.fail("the kernel died")
            if k and k["status"] == "idle" and k["connection"] == "connected":
                return k
            time.sleep(0.3)
        self.fail(f"the kernel was not idle within {timeout} s (last state {self.kernel()})")

    def kernel_pid(self) -> int:
        return self.server.kernel_process(self.wait_kernel_idle()["id"]).pid

    def run_all(self, restart: bool, timeout: float) -> float:
        """Run All (``restart``: Restart Kernel and Run All, its dialog accepted); wait until
        the command is done, no prompt shows [*] and the kernel is idle (after a restart: a new
        kernel process, as JupyterLab keeps the kernel's id). Returns seconds."""
        old_pid = self.kernel_pid()
        start = time.monotonic()
        self.page.evaluate("c => window.__lab.run(c)",
                           "notebook:restart-run-all" if restart else "notebook:run-all-cells")
        if restart:                  # "Restart Kernel?" — the learner clicks Restart
            self.page.locator(".jp-Dialog .jp-mod-accept").click(timeout=30_000)
        deadline, new_kernel = start + timeout, not restart
        while True:
            time.sleep(0.5)
            k, run = self.kernel(), self.page.evaluate("() => window.__run")
            if k is None or k["status"] == "dead":
                self.fail(f"the kernel died during Run All (kernel: {k})")
            cells = self.page.evaluate("() => window.__lab.progress()")
            busy = [c for c in cells if "*" in c["prompt"]]
            if not new_kernel and k["status"] == "idle":
                try:
                    new_kernel = self.server.kernel_process(k["id"]).pid != old_pid
                except LookupError:
                    pass
            if run["done"] and new_kernel and not busy and k["status"] == "idle":
                break
            if time.monotonic() > deadline:
                where = (f"cell {busy[0]['index']} ({busy[0]['head']!r}) still running"
                         if busy else f"run state {run}, kernel {k}")
                self.fail(f"Run All did not finish within {timeout:.0f} s: {where}")
        if run["error"]:
            self.fail(f"the Run All command failed: {run['error']}")
        seconds = time.monotonic() - start
        if not restart and self.kernel_pid() != old_pid:     # the server restarts a dead kernel
            self.fail("the kernel died during Run All (the server started a new one); "
                      "cells left without an execution count follow the one that killed it")
        return seconds

    def cells(self) -> list[dict]:
        return self.page.evaluate("() => window.__lab.cells()")

    @staticmethod
    def as_notebook(cells: list[dict]):
        """The page's code cells and outputs as a notebook, for ``run_notebooks.compare_checked``."""
        nb = nbformat.v4.new_notebook()
        for cell in cells:
            code = nbformat.v4.new_code_cell(cell["source"], execution_count=cell["count"])
            code.outputs = [nbformat.from_dict(o) for o in cell["raw"]]
            nb.cells.append(code)
        return nb

    def kernel_errors(self) -> list[str]:
        return self.page.evaluate("() => window.__errors")

    # ---- panels -----------------------------------------------------------------------------
    def panel(self, index: int):
        """The output area of code cell ``index`` (where its widget renders)."""
        self.page.evaluate("([i, n]) => window.__lab.mark(i, n)", [index, f"cell-{index}"])
        return self.page.locator(f'[data-lab-test="cell-{index}"] .jp-Cell-outputArea')

    @staticmethod
    def control(area, kind: str, label: str):
        """The dropdown or slider in ``area`` whose description is ``label``."""
        css = {"dropdown": ".widget-dropdown", "slider": ".widget-slider"}[kind]
        exact = re.compile(rf"^\s*{re.escape(label)}\s*$")
        return area.locator(css).filter(has=area.page.locator("label.widget-label",
                                                              has_text=exact))

    @staticmethod
    def shown(area) -> dict:
        """What a panel shows: its HTML and output widgets' text, and its images."""
        return area.evaluate("""a => ({
            text: [...a.querySelectorAll('.widget-html-content, .widget-output')]
                    .map(e => e.innerText).join('\\n'),
            images: [...a.querySelectorAll('img')].map(i => i.src),
            tracebacks: [...a.querySelectorAll('.widget-output .jp-OutputArea-output')]
                    .map(e => e.innerText).filter(t => /Traceback|Error:/.test(t))})""")
