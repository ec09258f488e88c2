"""The course website (``scripts/build_site.py``) in headless Chromium: built into a scratch
folder and served from 127.0.0.1 by a thread, every page opens with no console error, page
error, failed or refused request and no broken image; the maths is typeset (when MathJax is
installed); the search box lists sections as you type and a result opens its page.
Screenshots of the landing page and one lab go to $BROWSER_ARTIFACTS (or a pytest temporary
folder), always: they are the check a person looks at."""
from __future__ import annotations

import functools
import importlib.util
import json
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
def site(built_site) -> dict:
    """The built site (tests/conftest.py) and what it carries: MathJax, labkit's wheel."""
    broken, _ = build_site.check_links(built_site)
    assert not broken, "broken links:\n" + "\n".join(broken)
    wheels = sorted((built_site / "labkit").glob("*.whl"))
    return {"out": built_site, "mathjax": (built_site / "assets" / "mathjax").is_dir(),
            "wheel": f"labkit/{wheels[0].name}" if wheels else None}


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


def open_page(browser, url: str, only: str | None = None):
    """(page, problems): problems collects console errors, page errors, failed requests and
    responses of 400 or more while the page loads and is used; with ``only`` (a URL prefix)
    every other request is aborted and named a problem."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    if only:
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(only)
                   else (problems.append(f"outside the site: {route.request.url}"), route.abort()))
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
            panels = page.locator("p.kernel-note, div.live-panel").count()
            assert panels >= 1, f"{name}: no panel, live or its note"
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


# ---- the calculator: labkit's wheel under Pyodide, answering as CPython does --------------------
GRID = [dict(), dict(model="deepseek-v2-lite", dp=8, ep=8), dict(model="mixtral-8x7b", tp=2, sp=True),
        dict(precision="bf16-master", dp=8, zero_stage=3, recompute="full"),
        dict(model="llama-3-8b", seq=32768, cp=4, dp=4, zero_stage=1),
        dict(model="llama-2-13b", pp=4, schedule="interleaved", micro_batches=8),
        dict(model="qwen3-8b", fine_tuning="qlora", precision="bf16", recompute="selective"),
        dict(model="gemma-2-9b", optimizer="adamw-8bit", batch=2, seq=2048),
        dict(dp=3, ep=2), dict(model="tiny-moe", config='{"model_type": "llama"'),
        dict(config="[1, 2]"), dict(dp=8, zero_stage=3, fsdp2_bf16=True, precision="bf16-master"),
        dict(model="mixtral-8x7b", dp=16, ep=8, etp=2, recompute="every-2"),
        dict(config='{"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, '
                    '"num_attention_heads": 8, "num_hidden_layers": 4, "vocab_size": 32000, '
                    '"max_position_embeddings": 4096}')]
PLANS = [dict(), dict(model="deepseek-v2-lite", gpu="a100-80gb", gpus=8, fine_tuning="lora")]


@pytest.fixture(scope="module")
def calculator(browser, base_url, site, record_testsuite_property):
    """The calculator page once Python is ready in it (its time to ready recorded), with every
    request to another site aborted: it must need none."""
    if not site["wheel"]:
        pytest.skip("no Pyodide in this build: python scripts/fetch_pyodide.py fetches it once")
    page, problems = open_page(browser, f"{base_url}calculator.html", only=base_url)
    page.wait_for_selector("#calc-status[data-ready]", timeout=120_000)
    assert page.get_attribute("#calc-status", "data-ready") == "1", page.inner_text("#calc-status")
    record_testsuite_property("calculator ready s", page.evaluate("window.labkit.readyMs") / 1000)
    yield page, problems
    page.close()


def test_the_calculator_answers_as_cpython_does(calculator, artifacts):
    """Every form of the grid (presets, a pasted config.json, refused layouts) and two plans:
    the page's JSON equals labkit.course.web's in this process, byte for byte."""
    from labkit.course import web

    page, problems = calculator
    for kind, forms in (("estimate", GRID), ("plan", PLANS)):
        for form in forms:
            got = page.evaluate("([kind, form]) => window.labkit.answer(kind, form)", [kind, form])
            assert got == web.answer(kind, json.dumps(form)), (kind, form)
    page.screenshot(path=str(artifacts / "site-calculator.png"), full_page=True)
    assert not problems, "\n".join(problems)


# each control of the estimate form moved once, in turn: (field, how, the value the form sends)
MOVES = [("model", "deepseek-v2-lite", "deepseek-v2-lite"), ("batch", "2", 2), ("seq", "2048", 2048),
         ("precision", "bf16-master", "bf16-master"), ("optimizer", "adamw-8bit", "adamw-8bit"),
         ("optimizer_impl", "fused", "fused"), ("recompute", "full", "full"),
         ("fine_tuning", "lora", "lora"), ("dp", "8", 8), ("zero_stage", "3", 3),
         ("fsdp2_bf16", "check", True), ("replicas", "2", 2), ("offload", "check", True),
         ("tp", "2", 2), ("sp", "check", True), ("pp", "2", 2), ("schedule", "zb-h1", "zb-h1"),
         ("micro_batches", "4", 4), ("ep", "2", 2), ("etp", "2", 2), ("cp", "2", 2),
         ("config", '{"model_type": "llama"}', '{"model_type": "llama"}')]
PLAN_MOVES = [("model", "llama-2-7b", "llama-2-7b"), ("gpu", "a100-80gb", "a100-80gb"),
              ("gpus", "8", 8), ("gpus_per_node", "4", 4), ("seq", "2048", 2048),
              ("global_batch", "16", 16), ("fine_tuning", "lora", "lora")]


def _move(page, form: str, name: str, how: str):
    field = page.locator(f"#{form} [name={name}]")
    if how == "check":
        field.check()
    elif field.evaluate("f => f.tagName") == "SELECT":
        field.select_option(how)
    else:
        field.fill(how)


def test_each_control_sends_its_own_field(calculator):
    """Each control moved in turn: the page shows the answer CPython gives for the form with
    that field changed (so a control wired to another field fails), an error naming the fix
    included; then the planner's controls and its button."""
    from labkit.course import web

    page, problems = calculator
    expected = dict(web.ESTIMATE_FORM)
    for name, how, value in MOVES:
        _move(page, "estimate-form", name, how)
        expected[name] = value
        sent = page.evaluate("window.labkit.formValues(document.getElementById('estimate-form'))")
        assert sent == expected, name
        want = web.estimate_answer(expected)
        shown = page.inner_text("#estimate-result")
        assert (want["error"] if "error" in want else want["total_text"]) in shown, (name, shown)
        assert "[object" not in shown and "undefined" not in shown, (name, shown)
        if "error" not in want:                  # what the estimate assumes, each line shown
            assert all(f"assumes {line}" in shown for line in want["assumes"]), (name, shown)
    plan = dict(web.PLAN_FORM)
    for name, how, value in PLAN_MOVES:
        _move(page, "plan-form", name, how)
        plan[name] = value
    page.click("#plan-button")
    page.locator("#plan-result pre").wait_for(timeout=120_000)
    assert page.inner_text("#plan-result pre") == web.plan_answer(plan)["text"]
    assert not problems, "\n".join(problems)


# ---- the lab pages' live panels ----------------------------------------------------------
def calls_a_live_panel(stem: str) -> bool:
    """Does the lab call a panel that only estimates (labkit.course.web.PANELS)?"""
    from labkit.course.web import PANELS
    nb = build_site.read(ROOT / "notebooks" / f"{stem}.ipynb")
    return any(f"{name}(" in cell.source for cell in nb.cells for name in PANELS)


LIVE_LABS = [stem for stem in PAGES[1:] if calls_a_live_panel(stem)]


def _move_control(panel, control: dict):
    """Move one of the panel's controls (a controls_spec entry) as a user would."""
    field = panel.locator(f"[name={control['name']}]")
    if control["name"] == "model":               # a small one: the planner is quick on it
        field.select_option(label="small" if control["value"] == "tiny" else "tiny")
    elif control["kind"] == "select":            # the next option (a model may have reset them)
        count = field.evaluate("f => f.options.length")
        field.select_option(index=(int(field.input_value()) + 1) % count)
    elif control["kind"] == "checkbox":
        field.click()
    else:                                        # (a model may have moved the slider's end)
        up, top = control["value"] + control["step"], int(field.get_attribute("max"))
        value = up if up <= top else control["value"] - control["step"]
        field.evaluate("(f, v) => { f.value = v; f.dispatchEvent(new Event('input'));"
                       " f.dispatchEvent(new Event('change')); }", str(value))


def open_live_panel(browser, base_url, site, stem: str):
    """(page, problems, panel): the lab page scrolled to its live panel, Python ready in it,
    every request to another site aborted."""
    if not site["wheel"]:
        pytest.skip("no Pyodide in this build: python scripts/fetch_pyodide.py fetches it once")
    page, problems = open_page(browser, f"{base_url}{stem}.html", only=base_url)
    panel = page.locator("div.live-panel")
    panel.scroll_into_view_if_needed()
    page.wait_for_selector("div.live-panel[data-ready]", timeout=120_000)
    assert panel.get_attribute("data-ready") == "1", panel.inner_text()
    return page, problems, panel


@pytest.mark.parametrize("stem", LIVE_LABS)
def test_a_live_panel_answers_as_cpython_does_as_each_control_moves(browser, base_url, site,
                                                                    artifacts, stem):
    """The lab page's panel starts once scrolled to; each control moved in turn sends that
    field (and only what the answer sets besides), and the page's answer is CPython's for the
    same query, byte for byte; the text shown is its summary. No request leaves the site."""
    from labkit.course import web

    page, problems, panel = open_live_panel(browser, base_url, site, stem)

    def shown_answer(changed: str) -> dict:
        query = json.loads(panel.get_attribute("data-query"))
        assert query["changed"] == changed
        text = panel.get_attribute("data-answer")
        assert text == web.answer("panel", json.dumps(query)), (stem, query)
        answer = json.loads(text)
        # what it draws: the summary, a bar per layout or stage, a row per stage's schedule
        assert panel.locator(".live-summary").inner_text() == answer["summary"]
        assert panel.locator(".live-bars tr").count() == len(answer["bars"]) + len(answer["stages"])
        rows = len(answer["gantt"]["stages"]) if answer["gantt"] else 0
        assert panel.locator(".live-gantt-row").count() == rows
        captions = panel.locator(".live-caption").all_inner_texts()
        assert [t for t in (answer["title"], (answer["gantt"] or {}).get("title")) if t] == captions
        return query["form"] | {k: v["value"] if isinstance(v, dict) else v
                                for k, v in answer["controls"].items()}

    spec = json.loads(panel.get_attribute("data-spec"))
    form = shown_answer("")
    # it starts where the notebook's panel does (a slider off its steps would have moved)
    assert form == {c["name"]: c["value"] for c in spec["controls"]} | spec["fixed"]
    for control in spec["controls"]:
        control = control | {"value": form[control["name"]]}
        before, answers = panel.get_attribute("data-query"), int(panel.get_attribute("data-answers"))
        _move_control(panel, control)
        page.wait_for_function("([el, q]) => el.dataset.query !== q",
                               arg=[panel.element_handle(), before], timeout=60_000)
        assert int(panel.get_attribute("data-answers")) == answers + 1, control  # once a change
        sent = json.loads(panel.get_attribute("data-query"))["form"]
        assert {k for k in sent if sent[k] != form[k]} == {control["name"]}, (stem, control)
        form = shown_answer(control["name"])
    panel.screenshot(path=str(artifacts / f"site-live-{stem}.png"))
    assert not problems, "\n".join(problems)


def test_a_live_panel_is_used_as_a_form_is(browser, base_url, site):
    """Lab 00's memory panel with the keyboard: a slider moves a step a key press, answering
    each and keeping the focus; a number box answers once it is left, with a whole number
    within its bounds, whatever was typed (no number: the one it held)."""
    page, problems, panel = open_live_panel(browser, base_url, site, "00_welcome")
    sent = lambda: json.loads(panel.get_attribute("data-query"))["form"]   # noqa: E731
    seq, answers = sent()["seq"], int(panel.get_attribute("data-answers"))
    panel.locator("[name=seq]").focus()
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    assert sent()["seq"] == seq + 3 * 128 and int(panel.get_attribute("data-answers")) == answers + 3
    assert page.evaluate("document.activeElement.name") == "seq"
    batch = panel.locator("[name=batch]")
    for typed, held in (("-5", 1), ("2.6", 2), ("1e3", 1), ("99999", 4096), ("", 4096)):
        answers = int(panel.get_attribute("data-answers"))
        batch.fill(typed)
        assert int(panel.get_attribute("data-answers")) == answers, typed   # not while typing
        batch.press("Tab")
        assert int(panel.get_attribute("data-answers")) == answers + 1, typed
        assert sent()["batch"] == held and batch.input_value() == str(held), typed
    assert not problems, "\n".join(problems)
