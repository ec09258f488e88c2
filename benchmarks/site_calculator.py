"""The website calculator's and live panels' speed in headless Chromium (prints medians; not a
timed test).

    python benchmarks/site_calculator.py [--site DIR] [--loads 3]

Builds the site (or serves ``--site``), opens calculator.html ``--loads`` times and prints the
median time until Python is ready in the page, of one estimate (21 calls) and of the planner
for DeepSeek-V3 on 2,048 H100s and LLaMA-3-8B on 16 (3 calls each), beside the same calls in
this CPython process; then each lab page's live panel: the time from scrolling to it until it
answers, and one answer of its default form (11 calls) in the page and in CPython.
"""
import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from playwright.sync_api import sync_playwright

from labkit.course import web

ROOT = Path(__file__).resolve().parents[1]
ESTIMATE = dict(model="deepseek-v2-lite", dp=8, ep=8, precision="bf16-master")
PLANS = {"DeepSeek-V3 on 2,048 H100s": dict(model="deepseek-v3", gpu="h100-80gb", gpus=2048),
         "LLaMA-3-8B on 16 H100s": dict(model="llama-3-8b", gpu="h100-80gb", gpus=16)}


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def built_site(folder: Path) -> Path:
    spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
    build_site = sys.modules["build_site"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_site)
    report = build_site.build(folder / "site")
    if not report["wheel"]:
        raise SystemExit("no Pyodide: python scripts/fetch_pyodide.py")
    return report["out"]


def median_s(call, times: int) -> float:
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def live_panels(browser, site: Path, base: str) -> None:
    """Each lab page's live panel: ready after scrolling to it, and one answer, medians."""
    for stem in sorted(p.stem for p in site.glob("*.html")
                       if 'class="live-panel"' in p.read_text(encoding="utf-8")):
        page = browser.new_page()
        page.goto(f"{base}/{stem}.html")
        panel = page.locator("div.live-panel")
        start = time.perf_counter()
        panel.scroll_into_view_if_needed()
        page.wait_for_selector("div.live-panel[data-ready='1']", timeout=120_000)
        ready = time.perf_counter() - start
        query = json.loads(panel.get_attribute("data-query")) | {"changed": ""}
        in_page = median_s(lambda: page.evaluate("q => window.labkit.answer('panel', q)", query), 11)
        here = median_s(lambda: web.answer("panel", json.dumps(query)), 11)
        print(f"{stem} {query['panel']}: ready {ready:.2f} s after scrolling to it; one answer "
              f"{1000 * in_page:.1f} ms in the page, {1000 * here:.1f} ms in CPython "
              f"({in_page / here:.1f}x)")
        page.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", type=Path)
    parser.add_argument("--loads", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        site = args.site or built_site(Path(scratch))
        server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/calculator.html"
        with sync_playwright() as pw:
            chromium = os.environ.get("CHROMIUM") or next(
                path for path in ("/usr/bin/chromium", "/usr/bin/chromium-browser")
                if Path(path).exists())
            browser = pw.chromium.launch(executable_path=chromium, headless=True)
            ready, page = [], None
            for _ in range(args.loads):
                if page:
                    page.close()
                page = browser.new_page()
                start = time.perf_counter()
                page.goto(url)
                page.wait_for_selector("#calc-status[data-ready='1']", timeout=120_000)
                ready.append(time.perf_counter() - start)
            print(f"interactive after loading: median {statistics.median(ready):.2f} s "
                  f"({', '.join(f'{s:.2f}' for s in ready)})")
            form = json.dumps(ESTIMATE)
            in_page = median_s(lambda: page.evaluate("f => window.labkit.answer('estimate', f)",
                                                     ESTIMATE), 21)
            here = median_s(lambda: web.answer("estimate", form), 21)
            print(f"one estimate: {1000 * in_page:.1f} ms in the page, {1000 * here:.1f} ms in "
                  f"CPython ({in_page / here:.1f}x)")
            for name, plan in PLANS.items():
                in_page = median_s(lambda: page.evaluate("f => window.labkit.answer('plan', f)",
                                                         plan), 3)
                here = median_s(lambda: web.answer("plan", json.dumps(plan)), 3)
                print(f"planner, {name}: {in_page:.2f} s in the page, {here:.2f} s in CPython "
                      f"({in_page / here:.1f}x)")
            live_panels(browser, Path(site), url.rsplit("/", 1)[0])
            browser.close()
        server.shutdown()


if __name__ == "__main__":
    main()
