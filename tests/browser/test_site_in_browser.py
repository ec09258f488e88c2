"""The course website (``scripts/build_site.py``) in headless Chromium: built into a scratch
folder and served from 127.0.0.1 by a thread, every page opens with no console error, page
error, failed or refused request and no broken image; the maths is typeset (when MathJax is
installed); the search box lists sections as you type and a result opens its page.
Screenshots of the landing page and one lab go to $BROWSER_ARTIFACTS (or a pytest temporary
folder), always: they are the check a person looks at."""
from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
build_site = sys.modules["build_site"] = importlib.util.module_from_spec(_spec)   # (dataclasses)
_spec.loader.exec_module(build_site)

PAGES = ["index"] + [p.stem for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
SCREENSHOT_LAB = "07_attention_kv_cache"       # maths and figures near the top
TIMEOUT_MS = 60_000


def has_maths(stem: str) -> bool:
    nb = build_site.read(ROOT / "notebooks" / f"{stem}.ipynb")
    return any("$" in cell.source for cell in nb.cells if cell.cell_type == "markdown")


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict:
    report = build_site.build(tmp_path_factory.mktemp("site") / "site")
    assert not report["broken"], "broken links:\n" + "\n".join(report["broken"])
    return report


@pytest.fixture(scope="module")
def base_url(site):
    """The built site over HTTP on a free port of 127.0.0.1, served by a thread."""
    handler = functools.partial(QuietHandler, directory=str(site["out"]))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def open_page(browser, url: str):
    """(page, problems): problems collects console errors, page errors, failed requests and
    responses of 400 or more while the page loads and is used."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}")
            if r.status >= 400 else None)
    page.goto(url, wait_until="load")
    # MathJax 2 posts "End" once its first typeset is done; a hook added later still hears it
    page.evaluate("() => new Promise(done => window.MathJax"
                  " ? MathJax.Hub.Register.StartupHook('End', done) : done())")
    return page, problems


def screenshot(page, path: Path, whole: bool) -> None:
    """The whole page, or the screen around its first figure (the header bar stays in view)."""
    if not whole:
        page.set_viewport_size({"width": 1280, "height": 1400})
        page.evaluate("() => { const img = document.querySelector('main .jp-OutputArea-output img');"
                      " if (img) window.scrollTo(0, img.getBoundingClientRect().top"
                      " + window.scrollY - 500); }")
    page.screenshot(path=str(path), full_page=whole)


@pytest.mark.parametrize("name", PAGES)
def test_page_renders_without_errors(browser, base_url, site, artifacts, name):
    page, problems = open_page(browser, f"{base_url}{name}.html")
    try:
        broken_images = page.evaluate(
            "() => [...document.images].filter(i => !i.complete || !i.naturalWidth)"
            ".map(i => i.src.slice(0, 80))")
        assert not broken_images, f"{name}: images that did not load: {broken_images}"
        assert page.locator("header.site-header #site-search").count() == 1
        if name != "index":
            assert page.locator("p.kernel-note").count() >= 1, f"{name}: no note for its panel"
            assert page.locator("main img").count() >= 1, f"{name}: no figure"
            if site["mathjax"] and has_maths(name):
                assert page.locator(".MathJax, .MathJax_Display").count() > 0, \
                    f"{name}: no maths typeset"
                assert page.locator(".MathJax_Error, .merror").count() == 0, \
                    f"{name}: MathJax could not typeset some TeX"
        if name in ("index", SCREENSHOT_LAB):
            screenshot(page, artifacts / f"site-{name}.png", whole=name == "index")
        assert not problems, f"{name}.html in Chromium:\n" + "\n".join(problems)
    finally:
        page.close()


def test_search_lists_sections_and_opens_one(browser, base_url, artifacts):
    page, problems = open_page(browser, f"{base_url}index.html")
    try:
        page.locator("#site-search").press_sequentially("checkpointing", delay=20)
        results = page.locator("#site-search-results li a")
        results.first.wait_for(state="visible")
        assert results.count() >= 2, "searching 'checkpointing' found fewer than 2 sections"
        page.screenshot(path=str(artifacts / "site-search.png"))
        href = results.first.get_attribute("href")
        results.first.click()
        page.wait_for_load_state("load")
        assert page.url.split("#")[0] == base_url + href.split("#")[0]
        assert page.evaluate("() => !!document.getElementById("
                             "decodeURIComponent(location.hash.slice(1)))"
                             " || !!document.getElementById(location.hash.slice(1))"), \
            f"the result's anchor {href} is not on its page"
        assert not problems, "search in Chromium:\n" + "\n".join(problems)
    finally:
        page.close()
