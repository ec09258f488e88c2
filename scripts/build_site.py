"""Build the course as a static website from the executed notebooks, as committed.

    python scripts/build_site.py [--out site]      # then open site/index.html

Writes, into ``site/`` by default (emptied first; only a folder this script made is emptied):

- ``index.html``: the README's introduction and its "## The labs" table, each row a link;
- one page per ``notebooks/*.ipynb`` (nbconvert's "lab" template, not executed again): a
  header bar with the course name, the previous and next lab and a search box; figures
  inline; a panel that only estimates (``labkit.course.web.PANELS``: labs 00-03, 05, 09) made
  live: its controls, as the notebook's call builds them, run labkit's torch-free report under
  Pyodide; every other widget output replaced by a note that the panel needs a kernel (the
  notebooks are committed without widget state, and rendering saved state would need the
  widget manager from a CDN);
- ``calculator.html``: labkit's estimate and planner behind a form, run in the browser by
  Pyodide (``python scripts/fetch_pyodide.py`` fetches it once) from labkit's wheel, built here;
- ``assets/``: the stylesheets, the search index (``search-index.js``: every section's
  heading and text) and its script, and MathJax 2.7 for the maths, copied from the
  ``jupyter-server-mathjax`` package (``pip install -e ".[site]"``; without it the TeX stays text).

The site works offline: no page loads anything from outside it. The build ends with a link
check (every relative href and src resolves to a file, every #anchor to an id) and exits 1
with the list of broken links; links to other sites are listed, not fetched.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from html import escape
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import ast
import ipywidgets
import jinja2
import nbformat
from bs4 import BeautifulSoup
from nbconvert import HTMLExporter
from nbconvert.filters.markdown_mistune import markdown2html_mistune

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).resolve().parent / "site_templates"
MARKER = ".built-by-build_site"          # only a folder holding this file is ever emptied

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# an output whose text/plain is a widget's repr ("VBox(children=...)"): the state was not saved
WIDGET_REPR = re.compile(r"^(?:%s)\(" % "|".join(
    name for name, obj in vars(ipywidgets).items()
    if isinstance(obj, type) and issubclass(obj, ipywidgets.DOMWidget)))
KERNEL_NOTE = ('<p class="kernel-note">Interactive panel: run this notebook in JupyterLab '
               '(<code>jupyter lab notebooks/</code>) to use it.</p>')

# MathJax 2.7 as jupyter-server-mathjax ships it (HTML-CSS output, STIX-Web fonts): what the
# pages can load (the TeX extensions, every STIX-Web font), not its SVG output or localisations
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe"
MATHJAX_PARTS = ["MathJax.js", "config", "extensions/Safe.js", "extensions/TeX",
                 "jax/output/HTML-CSS/fonts/STIX-Web", "jax/output/HTML-CSS/autoload",
                 "jax/element/mml", "fonts/HTML-CSS/STIX-Web/woff"]


@dataclass
class Lab:
    """A row of the landing page's table, and the page of its notebook (if there is one)."""
    number: str
    name: str            # inline HTML, from the README's table cell
    measures: str        # inline HTML
    duration: str        # "45 min"
    notebook: Path | None = None

    @property
    def url(self) -> str | None:
        return f"{self.notebook.stem}.html" if self.notebook else None

    @property
    def label(self) -> str:
        """How the previous/next links name it: "02 · mixed precision"."""
        return f"{self.number} · {BeautifulSoup(self.name, 'html.parser').get_text()}"


# --- the README: course name, introduction, table of labs ------------------------------------

def inline_html(markdown: str) -> str:
    """A table cell's markdown as HTML, without the paragraph around it."""
    html = markdown2html_mistune(markdown).strip()
    return re.sub(r"^<p>(.*)</p>$", r"\1", html, flags=re.S)


def read_readme(path: Path) -> tuple[str, str, list[Lab]]:
    """(course name, introduction as HTML, the labs of the "## The labs" table)."""
    text = path.read_text(encoding="utf-8")
    course = re.search(r"^# (.+)$", text, re.M).group(1).strip()
    intro = text.split("\n## ", 1)[0].split("\n", 1)[1]        # between the title and the first ##
    table = re.search(r"^## The labs\n(.*?)(?=^## |\Z)", text, re.M | re.S).group(1)
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in table.splitlines() if line.startswith("|")]
    labs = [Lab(number, inline_html(name), inline_html(measures), duration)
            for number, name, measures, duration in rows[2:]]      # after the header and ---
    return course, markdown2html_mistune(intro), labs


def attach_notebooks(labs: list[Lab], notebooks: list[Path]) -> list[Lab]:
    """Give each lab its notebook ("03" -> 03_activations.ipynb); a notebook the table does not
    list still gets a row, named by its title. Returns the labs that have a page, in order."""
    by_number = {lab.number: lab for lab in labs}
    for path in notebooks:
        number = path.stem.split("_", 1)[0]
        if number not in by_number:
            by_number[number] = Lab(number, escape(notebook_title(read(path))), "", "")
            labs.append(by_number[number])
        by_number[number].notebook = path
    return [lab for lab in labs if lab.notebook]


# --- a notebook, as committed ------------------------------------------------------------------

def read(path: Path):
    return nbformat.read(path, as_version=4)


def notebook_title(nb) -> str:
    """The text of the notebook's first "# " heading."""
    for cell in nb.cells:
        found = cell.cell_type == "markdown" and re.search(r"^# (.+)$", cell.source, re.M)
        if found:
            return found.group(1).strip()
    return "untitled"


def is_widget(output) -> bool:
    data = output.get("data", {})
    return WIDGET_MIME in data or bool(WIDGET_REPR.match(data.get("text/plain", "")))


def replace_widgets(nb, live: bool = False) -> int:
    """Replace each widget output with the note that it needs a kernel, or (``live``: the site
    has labkit's wheel) a panel that only estimates with its live version; how many there were."""
    count = 0
    for at, cell in enumerate(nb.cells):
        for i, output in enumerate(cell.get("outputs", [])):
            if is_widget(output):
                call = panel_call(cell.source, notebook_names(nb.cells[:at])) if live else None
                html = live_panel(*call) if call else KERNEL_NOTE
                cell.outputs[i] = nbformat.v4.new_output(
                    "display_data", data={"text/html": html, "text/plain": "(panel)"})
                count += 1
    return count


LIVE_MARK = 'class="live-panel"'
# expressions a notebook's plain names are built from: literals, and dicts of them indexed
# (SEQ = {"ci": 512, ...}[SCALE]); nothing else is evaluated
PLAIN_NODES = (ast.Expression, ast.Constant, ast.Dict, ast.List, ast.Tuple, ast.Name, ast.Load,
               ast.Subscript, ast.UnaryOp, ast.USub)


def plain_value(node: ast.AST, names: dict):
    """The value of a plain expression over ``names``; KeyError if it is not one."""
    tree = ast.Expression(node)
    if not all(isinstance(n, PLAIN_NODES) for n in ast.walk(tree)):
        raise KeyError(ast.unparse(node))
    try:
        return eval(compile(tree, "<notebook>", "eval"), {"__builtins__": {}}, dict(names))
    except (NameError, LookupError, TypeError) as e:
        raise KeyError(ast.unparse(node)) from e


def as_python(source: str) -> str:
    """A cell as the kernel runs it: IPython's magics (%time, %%capture, !pip) as Python calls."""
    from IPython.core.inputtransformer2 import TransformerManager
    return TransformerManager().transform_cell(source)


def bound_names(node: ast.AST) -> set | None:
    """The names a statement binds in the notebook's namespace (not a def's locals), those in a
    cell magic's body too; None when a cell magic's body is not Python (it may bind any)."""
    names, todo = set(), [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)                          # its body binds its own locals, and
            names.update(name for g in ast.walk(n) if isinstance(g, ast.Global)
                         for name in g.names)          # the notebook's it declares global
            continue
        elif isinstance(n, ast.Lambda):
            continue
        elif (isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "run_cell_magic"
              and isinstance(n.args[-1], ast.Constant)):
            try:
                body = ast.parse(n.args[-1].value)
            except SyntaxError:
                return None
            todo.append(body)
        todo.extend(ast.iter_child_nodes(n))
    return names


def notebook_names(cells) -> dict:
    """The names the code ``cells`` leave with plain values (their parameters, SEQ = {...}[SCALE]),
    in running order: a top-level ``NAME = plain expression`` sets one; any other binding of it
    (in an if or a loop, +=, a tuple, a def, a cell magic) makes it unknown, until such an
    assignment again."""
    names = {}
    for cell in cells:
        if cell.cell_type != "code":
            continue
        for node in ast.parse(as_python(cell.source)).body:
            if isinstance(node, ast.Assign) and [type(t) for t in node.targets] == [ast.Name]:
                try:
                    names[node.targets[0].id] = plain_value(node.value, names)
                    continue
                except KeyError:
                    pass
            bound = bound_names(node)
            names = {} if bound is None else {k: v for k, v in names.items() if k not in bound}
    return names


MAGIC_CALLS = ("run_line_magic", "run_cell_magic", "system", "getoutput")   # IPython's, as_python's


def panel_call(source: str, names: dict) -> tuple[str, dict] | None:
    """(panel function, its keyword arguments) when the cell calls a panel that only estimates;
    a call whose arguments are not plain values fails the build, naming it."""
    from labkit.course.web import PANELS
    for node in ast.walk(ast.parse(as_python(source))):
        func = getattr(node, "func", None)
        name = getattr(func, "id", None) or getattr(func, "attr", None)
        if isinstance(node, ast.Call) and name in PANELS:
            if node.args or any(k.arg is None for k in node.keywords):
                raise SystemExit(f"{ast.unparse(node)}: the site reads a panel's keyword "
                                 f"arguments only; name each one (model=..., seq=...)")
            try:
                return name, {k.arg: plain_value(k.value, names) for k in node.keywords}
            except KeyError as e:
                raise SystemExit(f"{name}(...): its argument {e.args[0]} is not a plain value "
                                 f"the site can resolve (a literal, or a name the cells before "
                                 f"give one)") from None
    magics = [a.value for n in ast.walk(ast.parse(as_python(source)))
              if getattr(getattr(n, "func", None), "attr", None) in MAGIC_CALLS
              for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    called = [name for name in PANELS for text in magics if re.search(rf"\b{name}\s*\(", text)]
    if called:                                        # a panel called inside a magic
        raise SystemExit(f"{called[0]}(...) inside an IPython magic: the site cannot read its "
                         f"arguments; call it as a statement of its own")
    return None


def live_panel(function: str, kwargs: dict) -> str:
    """The panel's live version: its controls (``controls_spec`` of the notebook's panel) for
    assets/panel.js, which asks ``labkit.course.web.panel_answer`` what to show."""
    from labkit.course import widgets
    from labkit.course.web import PANELS
    panel = widgets.PANEL_CLASSES[function](**kwargs)
    spec = {"panel": function, "slow": PANELS[function].slow, **widgets.controls_spec(panel)}
    for c in spec["controls"]:               # a browser snaps a slider to its steps
        if c["kind"] == "range" and (c["value"] - c["min"]) % c["step"]:
            raise SystemExit(f"{function}({kwargs}): {c['name']}={c['value']} is not on its "
                             f"slider's steps ({c['min']}, {c['min'] + c['step']}, ...): the "
                             f"page would start elsewhere")
    note = PANELS[function].note
    return (f'<div {LIVE_MARK} data-spec="{escape(json.dumps(spec), quote=True)}">'
            '<p class="live-status calc-status" role="status">Live panel: labkit runs it in this '
            'page (Pyodide) once it scrolls into view.</p>'
            '<form class="calc-form live-form"><fieldset disabled></fieldset></form>'
            '<div class="live-result calc-result" aria-live="polite"></div>'
            + (f'<p class="kernel-note">{escape(note)}</p>' if note else "") + '</div>')


# --- rendering -----------------------------------------------------------------------------

def exporter() -> HTMLExporter:
    """nbconvert's "lab" template with the site's blocks (site_templates/lab.html.j2)."""
    return HTMLExporter(template_name="lab", template_file="lab.html.j2",
                        extra_template_paths=[str(TEMPLATES)],
                        exclude_input_prompt=True, exclude_output_prompt=True)


def render_lab(html: HTMLExporter, lab: Lab, site: dict) -> tuple[str, list[dict]]:
    """(the lab's page, its sections for the search index)."""
    nb = read(lab.notebook)
    title = notebook_title(nb)
    nb.metadata["title"] = f"{title} — {site['course']}"
    replace_widgets(nb, live=bool(site["wheel"]))
    site["live"] = any(LIVE_MARK in output.get("data", {}).get("text/html", "")
                       for cell in nb.cells for output in cell.get("outputs", []))
    body, _ = html.from_notebook_node(nb, resources={"site": site})
    return body, search_sections(nb, title, lab.url)


def render_index(course: str, intro: str, labs: list[Lab], first: Lab | None) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=False)
    site = {"course": course, "prev": None, "next": first}
    return env.get_template("index.html.j2").render(site=site, intro=intro, labs=labs)


# --- the calculator: labkit's wheel under Pyodide -------------------------------------------------

PYODIDE_NOTICE = """Pyodide {version} (https://github.com/pyodide/pyodide), Mozilla Public License 2.0:
CPython compiled to WebAssembly, with CPython's standard library (Python Software Foundation
License). Unmodified files of the npm package pyodide@{version}.
"""


def build_wheel(root: Path, into: Path) -> Path:
    """labkit's wheel, built offline (no dependencies, no build isolation) from a copy of the
    project's files, so that no build/ folder of an earlier build ships a deleted module."""
    into.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "project"
        shutil.copytree(root, source, ignore=shutil.ignore_patterns(
            ".*", "build", "site", "notebooks", "workshop", "tests", "*.egg-info", "__pycache__"))
        run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                              "--no-build-isolation", "--no-index", "-q", "-w", str(into),
                              str(source)], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"building labkit's wheel failed:\n{run.stdout}{run.stderr}")
    return next(into.glob("*.whl"))


def build_calculator(out: Path, course: str, root: Path = ROOT) -> str | None:
    """calculator.html, with Pyodide (``scripts/fetch_pyodide.py``'s copy) and labkit's wheel
    built now (offline: pip wheel, no dependencies, no build isolation). Without Pyodide the
    page says how to fetch it; returns the wheel's path in the site, or None."""
    spec = importlib.util.spec_from_file_location("fetch_pyodide", TEMPLATES.parent / "fetch_pyodide.py")
    fetch_pyodide = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_pyodide)
    wheel = None
    if fetch_pyodide.present(root):
        shutil.copytree(fetch_pyodide.folder(root), out / "pyodide")
        (out / "pyodide" / "NOTICE.txt").write_text(PYODIDE_NOTICE.format(
            version=fetch_pyodide.PYODIDE_VERSION), encoding="utf-8")
        wheel = "labkit/" + build_wheel(root, out / "labkit").name
        for script in ("labkit-web.js", "calculator.js", "panel.js"):
            shutil.copy(TEMPLATES / script, out / "assets" / script)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=False)
    site = {"course": course, "prev": None, "next": None}
    page = env.get_template("calculator.html.j2").render(site=site, wheel=wheel)
    (out / "calculator.html").write_text(page, encoding="utf-8")
    return wheel


def search_sections(nb, title: str, url: str) -> list[dict]:
    """Each heading of the notebook's markdown (rendered as on its page, so the anchors are the
    page's ids) with the paragraph and list text under it."""
    sections = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for element in BeautifulSoup(markdown2html_mistune(cell.source), "html.parser").find_all(
                recursive=False):
            if re.fullmatch(r"h[1-6]", element.name):
                for link in element.select("a.anchor-link"):
                    link.decompose()
                sections.append({"title": title, "url": url, "anchor": element.get("id", ""),
                                 "heading": element.get_text(" ", strip=True), "text": ""})
            elif element.name in ("p", "ul", "ol", "blockquote", "table") and sections:
                sections[-1]["text"] += " " + element.get_text(" ", strip=True)
    for section in sections:
        section["text"] = re.sub(r"\s+", " ", section["text"]).strip()
    return sections


# --- assets ------------------------------------------------------------------------------------

def write_assets(out: Path, html: HTMLExporter, index: list[dict]) -> None:
    """Stylesheets (nbconvert's lab CSS once, not inlined in every page), search, MathJax."""
    assets = out / "assets"
    assets.mkdir(exist_ok=True)
    loader = html.environment.loader
    lab_css = [loader.get_source(html.environment, f"static/{name}")[0]
               for name in ("index.css", "theme-light.css")]
    (assets / "notebook.css").write_text("\n".join(lab_css), encoding="utf-8")
    for name in ("site.css", "search.js"):
        shutil.copy(TEMPLATES / name, assets / name)
    (assets / "search-index.js").write_text(
        "window.SEARCH_INDEX = " + json.dumps(index, ensure_ascii=False, indent=0) + ";\n",
        encoding="utf-8")


def mathjax_source() -> Path | None:
    try:
        import jupyter_server_mathjax
    except ImportError:
        return None
    return Path(jupyter_server_mathjax.__file__).parent / "static"


def copy_mathjax(source: Path, out: Path) -> str:
    """Copy MATHJAX_PARTS; returns the script's URL relative to a page."""
    target = out / "assets" / "mathjax"
    for part in MATHJAX_PARTS:
        if (source / part).is_dir():
            shutil.copytree(source / part, target / part)
        else:
            (target / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / part, target / part)
    return f"assets/mathjax/MathJax.js?config={MATHJAX_CONFIG}"


def fresh_folder(out: Path) -> None:
    """Empty ``out`` for a new build, if it is empty or an earlier build's."""
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise SystemExit(f"{out} holds files this script did not write; choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by scripts/build_site.py; emptied by each build\n")


# --- the link check ----------------------------------------------------------------------------

def is_external(url: str) -> bool:
    return urlsplit(url).scheme in ("http", "https") or url.startswith("//")


class Links(HTMLParser):
    """A page's ids, and the (tag, URL) of each href and src."""

    def __init__(self, path: Path):
        super().__init__()
        self.ids, self.links = set(), []
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name == "id":
                self.ids.add(value)
            elif name in ("href", "src") and value:
                self.links.append((tag, value))


def check_links(out: Path) -> tuple[list[str], list[str]]:
    """(broken links, external links) of every .html file under ``out``. A relative href/src must
    name a file under ``out``; a #anchor on a local page must be an id in that page, as written
    or percent-decoded (as a browser looks it up: nbconvert's heading ids are percent-encoded)."""
    out = out.resolve()
    pages = {path: Links(path) for path in sorted(out.rglob("*.html"))}
    broken, external = [], set()
    for page, links in pages.items():
        for _, url in links.links:
            parts = urlsplit(url)
            if is_external(url):
                external.add(url)
                continue
            if parts.scheme:                       # data:, mailto:, javascript:
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            where = f"{page.relative_to(out)}: {url}"
            if not target.is_relative_to(out) or not target.is_file():
                broken.append(f"{where} (no file {target})")
            elif parts.fragment and target in pages and \
                    not {parts.fragment, unquote(parts.fragment)} & pages[target].ids:
                broken.append(f"{where} (no id {unquote(parts.fragment)!r} in {target.name})")
    return broken, sorted(external)


# --- the build -----------------------------------------------------------------------------------

def build(out: Path, root: Path = ROOT) -> dict:
    """Write the site into ``out``; returns a summary (pages, seconds, broken and external links)."""
    start = time.perf_counter()
    out = out.resolve()
    fresh_folder(out)
    course, intro, labs = read_readme(root / "README.md")
    pages = attach_notebooks(labs, sorted((root / "notebooks").glob("*.ipynb")))
    source = mathjax_source()
    mathjax = copy_mathjax(source, out) if source else None
    html, index = exporter(), []
    (out / "assets").mkdir(exist_ok=True)            # (MathJax may have made it)
    wheel = build_calculator(out, course, root)           # the wheel the live panels run too
    for i, lab in enumerate(pages):
        site = {"course": course, "mathjax": mathjax, "wheel": wheel,
                "prev": pages[i - 1] if i > 0 else None,
                "next": pages[i + 1] if i + 1 < len(pages) else None}
        page, sections = render_lab(html, lab, site)
        (out / lab.url).write_text(page, encoding="utf-8")
        index += sections
    (out / "index.html").write_text(render_index(course, intro, labs, pages[0] if pages else None),
                                    encoding="utf-8")
    write_assets(out, html, index)
    if (root / "notebooks" / "img").is_dir():             # images the labs' markdown shows
        shutil.copytree(root / "notebooks" / "img", out / "img")
    broken, external = check_links(out)
    return {"out": out, "pages": [lab.url for lab in pages], "sections": len(index),
            "mathjax": bool(mathjax), "wheel": wheel, "broken": broken, "external": external,
            "seconds": time.perf_counter() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "site", help="output folder (site/)")
    report = build(parser.parse_args(argv).out)
    if not report["wheel"]:
        print("calculator without Pyodide: python scripts/fetch_pyodide.py (once, with the "
              "network) puts labkit's estimate and planner in the page")
    if not report["mathjax"]:
        print('maths left as TeX: pip install -e ".[site]" (jupyter-server-mathjax) to render it')
    for url in report["external"]:
        print(f"external link (not fetched): {url}")
    if report["broken"]:
        print(f"{len(report['broken'])} broken link(s):", *report["broken"], sep="\n  ")
        return 1
    print(f"{len(report['pages'])} lab pages, {report['sections']} sections searchable, "
          f"in {report['seconds']:.1f} s: {report['out'] / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
