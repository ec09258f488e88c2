"""The course website: ``python scripts/build_site.py --out DIR`` (the one command, in a new
process) builds from the committed notebooks; every notebook has a page with the header bar,
the landing page links every lab, no link is broken, nothing is loaded from another site, the
search index covers every lab, and each widget output became the note that it needs a kernel.
The same pages in headless Chromium: tests/browser/test_site_in_browser.py (-m browser)."""
from __future__ import annotations

import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
from bs4 import BeautifulSoup

import labkit as lk

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
build_site = sys.modules["build_site"] = importlib.util.module_from_spec(_spec)   # (dataclasses)
_spec.loader.exec_module(build_site)

_fetch = importlib.util.spec_from_file_location("fetch_pyodide", ROOT / "scripts" / "fetch_pyodide.py")
fetch_pyodide = importlib.util.module_from_spec(_fetch)
_fetch.loader.exec_module(fetch_pyodide)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def site(built_site) -> Path:
    return built_site                  # tests/conftest.py: the one command, run once


def links(page: Path) -> list[tuple[str, str]]:
    return build_site.Links(page).links


def search_index(site: Path) -> list[dict]:
    text = (site / "assets" / "search-index.js").read_text(encoding="utf-8")
    prefix = "window.SEARCH_INDEX = "
    assert text.startswith(prefix)
    return json.loads(text[len(prefix):].rstrip().rstrip(";"))


def test_every_notebook_has_a_page_with_the_header_bar(site):
    pages = [site / f"{nb.stem}.html" for nb in NOTEBOOKS]
    for i, page in enumerate(pages):
        assert page.is_file(), f"no page for {NOTEBOOKS[i].name}"
        hrefs = {url for tag, url in links(page) if tag == "a"}
        assert "index.html" in hrefs, f"{page.name}: no link to the course's index"
        neighbours = {p.name for p in pages[max(i - 1, 0):i + 2]} - {page.name}
        assert neighbours <= hrefs, f"{page.name}: no link to {neighbours - hrefs}"
        assert 'id="site-search"' in page.read_text(encoding="utf-8"), f"{page.name}: no search box"


def test_index_links_every_lab_of_the_readme_table(site):
    hrefs = {url for tag, url in links(site / "index.html") if tag == "a"}
    assert {f"{nb.stem}.html" for nb in NOTEBOOKS} <= hrefs
    _, intro, labs = build_site.read_readme(ROOT / "README.md")
    assert [lab.number for lab in labs] == [f"{i:02d}" for i in range(len(labs))]
    assert "predict" in intro and "<table" not in intro


def test_no_link_is_broken(site):
    broken, _ = build_site.check_links(site)
    assert broken == []


def test_the_link_check_names_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.html").write_text(
        '<h1 id="top">a</h1><a href="#top">ok</a> <a href="b.html#nowhere">b</a> '
        '<img src="img/missing.png"> <a href="https://example.org/">out</a>')
    (tmp_path / "b.html").write_text('<p id="here">b</p>')
    broken, external = build_site.check_links(tmp_path)
    assert len(broken) == 2, broken
    assert "no id 'nowhere'" in broken[0] and "img/missing.png" in broken[1]
    assert external == ["https://example.org/"]


def test_nothing_is_loaded_from_another_site(site):
    for page in sorted(site.glob("*.html")):
        loaded = [url for tag, url in links(page) if tag != "a" and build_site.is_external(url)]
        assert loaded == [], f"{page.name} loads {loaded}"
        assert "import(\"http" not in page.read_text(encoding="utf-8"), page.name
    for css in (site / "assets").glob("*.css"):
        text = css.read_text(encoding="utf-8")
        assert "url(http" not in text and "url('http" not in text and "@import" not in text


def test_the_search_index_names_every_lab_and_its_anchors_exist(site):
    index = search_index(site)
    for nb in NOTEBOOKS:
        title = build_site.notebook_title(build_site.read(nb))
        sections = [s for s in index if s["url"] == f"{nb.stem}.html"]
        assert sections and sections[0]["title"] == title, f"{nb.stem} is not in the search index"
        ids = build_site.Links(site / f"{nb.stem}.html").ids
        missing = [s["anchor"] for s in sections if s["anchor"] not in ids]
        assert missing == [], f"{nb.stem}: search anchors with no heading: {missing}"
    assert any("checkpoint" in s["text"].lower() for s in index)


LIVE_LABS = {"00_welcome", "01_parameter_memory", "02_mixed_precision", "03_activations",
             "05_tensor_pipeline_expert", "09_capstone"}       # their panels only estimate


def live_specs(page: Path) -> list[dict]:
    soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
    return [json.loads(div["data-spec"]) for div in soup.select("div.live-panel")]


def test_each_widget_output_became_a_live_panel_or_the_kernel_note(site):
    """With Pyodide, the panels that only estimate are live (labs 00-03, 05, 09) and load
    Pyodide, labkit's wheel and assets/panel.js; every other panel is the note to open
    JupyterLab, and its page loads no Pyodide."""
    live = fetch_pyodide.present(ROOT)
    for nb in NOTEBOOKS:
        widgets = sum(build_site.is_widget(o) for c in build_site.read(nb).cells
                      for o in c.get("outputs", []))
        page = site / f"{nb.stem}.html"
        soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
        panels = soup.select("div.live-panel")
        notes = [p for p in soup.select("p.kernel-note") if not p.find_parent(class_="live-panel")]
        assert widgets >= 1, f"{nb.stem}: no widget output (has its panel moved?)"
        assert len(panels) + len(notes) == widgets, nb.stem
        assert len(panels) == (live and nb.stem in LIVE_LABS), nb.stem
        scripts = {url for tag, url in links(page) if tag == "script"}
        assert ({"pyodide/pyodide.js", "assets/panel.js"} <= scripts) == bool(panels), nb.stem
        assert "VBox(children" not in str(soup) and "HBox(children" not in str(soup), nb.stem
    if not live:
        pytest.skip("no Pyodide here: python scripts/fetch_pyodide.py fetches it once")


def test_a_live_panel_starts_where_the_notebooks_call_does(site):
    """Lab 01 calls states_panel(model=MODEL, precision="bf16-mixed", zero_stage=0, gpus=8),
    MODEL its parameter; lab 02 memory_panel(model=MODEL, seq=SEQ, ...), SEQ 512 at SCALE "ci"."""
    if not fetch_pyodide.present(ROOT):
        pytest.skip("no Pyodide here: python scripts/fetch_pyodide.py fetches it once")
    (states,) = live_specs(site / "01_parameter_memory.html")
    assert states["panel"] == "states_panel" and states["fixed"] == {"seq": 2048}
    assert {c["name"]: c["value"] for c in states["controls"]} == dict(
        model="llama-2-7b", precision="bf16-mixed", optimizer="adamw", zero_stage=0, gpus=8)
    (memory,) = live_specs(site / "02_mixed_precision.html")
    values = {c["name"]: c["value"] for c in memory["controls"]}
    assert (values["model"], values["seq"], values["precision"]) == ("llama-2-7b", 512, "bf16-mixed")
    assert values["layers"] == lk.preset("llama-2-7b").layers


def test_a_panels_arguments_resolve_from_plain_names_only():
    cells = [nbformat.v4.new_code_cell('SCALE = "ci"\nMODEL = "small"\nLAYERS = 4'),
             nbformat.v4.new_code_cell('SEQ = {"ci": 512, "gpu": 4096}[SCALE]\nN = len("ab")'),
             nbformat.v4.new_code_cell("%%time\nx = 1"),
             nbformat.v4.new_code_cell('if SCALE == "ci":\n    MODEL = "tiny"\nLAYERS += 1')]
    names = build_site.notebook_names(cells[:3])
    assert names == {"SCALE": "ci", "MODEL": "small", "LAYERS": 4, "SEQ": 512}  # no len()
    # a name bound any other way (in an if, +=, a cell magic) is unknown from there on; a
    # def's own locals are not the notebook's
    assert build_site.notebook_names(cells) == {"SCALE": "ci", "SEQ": 512}
    later = [nbformat.v4.new_code_cell("%%time\nSEQ = 4096"),
             nbformat.v4.new_code_cell("def f():\n    SCALE = 1\n!pip list")]
    assert build_site.notebook_names(cells + later) == {"SCALE": "ci"}
    rebinds = nbformat.v4.new_code_cell("def bump():\n    global SCALE\n    SCALE = 'gpu'")
    assert build_site.notebook_names(cells + [rebinds]) == {"SEQ": 512}
    opaque = nbformat.v4.new_code_cell("%%bash\necho $((1 + 1))")
    assert build_site.notebook_names(cells + [opaque]) == {}            # may have bound any
    call = "from labkit.course import widgets\nwidgets.recompute_panel(model=MODEL, seq=SEQ)"
    assert build_site.panel_call(call, names) == ("recompute_panel", {"model": "small", "seq": 512})
    assert build_site.panel_call("quant_panel()", names) is None      # it measures: a note
    with pytest.raises(SystemExit, match="its argument N is not a plain value"):
        build_site.panel_call("recompute_panel(seq=N)", names)
    for call in ('memory_panel("tiny", seq=SEQ)', "memory_panel(**ARGS)"):
        with pytest.raises(SystemExit, match="keyword arguments only"):
            build_site.panel_call(call, names)
    with pytest.raises(SystemExit, match="inside an IPython magic"):
        build_site.panel_call('%time memory_panel(model="tiny")', names)
    mentions = '# memory_panel(model="tiny") is below\nprint("memory_panel(...)")\ndef my_plan_panel(x): pass'
    assert build_site.panel_call(mentions, names) is None                # a mention is no call


def test_a_panel_starting_off_its_sliders_steps_fails_the_build():
    """Chromium snaps seq=1000 to 1024 (step 128): the page would show other numbers."""
    with pytest.raises(SystemExit, match="seq=1000 is not on its slider's steps"):
        build_site.live_panel("recompute_panel", {"model": "tiny", "seq": 1000})


def test_which_outputs_count_as_widgets():
    display = lambda data: nbformat.v4.new_output("display_data", data=data)   # noqa: E731
    cell = nbformat.v4.new_code_cell(outputs=[
        display({build_site.WIDGET_MIME: {"model_id": "1"}, "text/plain": "anything"}),
        display({"text/plain": "Tab(children=(Output(),))"}),
        display({"text/plain": "Layout(dp=2, zero_stage=1)"}),      # labkit's Layout, not a widget
        display({"text/plain": "<Figure size 640x480 with 1 Axes>"}),
    ])
    nb = nbformat.v4.new_notebook(cells=[cell])
    assert build_site.replace_widgets(nb) == 2
    kept = [o.data["text/plain"] for o in cell.outputs]
    assert kept[2:] == ["Layout(dp=2, zero_stage=1)", "<Figure size 640x480 with 1 Axes>"]
    assert all(build_site.KERNEL_NOTE == o.data["text/html"] for o in cell.outputs[:2])


def test_maths_uses_the_local_mathjax(site):
    if build_site.mathjax_source() is None:
        pytest.skip('jupyter-server-mathjax is not installed (pip install -e ".[site]")')
    assert (site / "assets" / "mathjax" / "MathJax.js").is_file()
    page = site / "07_attention_kv_cache.html"
    scripts = [url for tag, url in links(page) if tag == "script"]
    assert any(url.startswith("assets/mathjax/MathJax.js?config=") for url in scripts), scripts


def test_the_build_only_empties_a_folder_it_made(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="did not write"):
        build_site.fresh_folder(tmp_path)
    assert (tmp_path / "notes.txt").exists()


def test_every_page_links_the_calculator_and_it_has_what_it_loads(site):
    """The header links calculator.html; with Pyodide fetched it carries Pyodide's files and
    labkit's wheel (presets and labkit.course.web inside), else a note naming the fetch."""
    for page in sorted(site.glob("*.html")):
        assert "calculator.html" in {url for tag, url in links(page) if tag == "a"}, page.name
    calculator = (site / "calculator.html").read_text(encoding="utf-8")
    if not fetch_pyodide.present(ROOT):
        assert "python scripts/fetch_pyodide.py" in calculator
        pytest.skip("no Pyodide here: python scripts/fetch_pyodide.py fetches it once")
    assert all((site / "pyodide" / name).is_file() for name in fetch_pyodide.FILES)
    (wheel,) = (site / "labkit").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {"labkit/course/web.py", "labkit/preset_data/llama-2-7b.json"} <= names
    assert f'"labkit/{wheel.name}"' in calculator and "pyodide/pyodide.js" in calculator
