"""labkit's layers point one way - the core, the estimate, the mechanisms, then the course - and
no module imports one that imports it back; imports inside functions count too."""
import ast
import subprocess
import sys
from pathlib import Path

import labkit

PACKAGE = Path(labkit.__file__).parent
# the layers, bottom to top, by folder; the byte rules of ZeRO, pipeline schedules and expert
# placement live beside their mechanisms in parallel/ but belong to the estimate
CORE = "labkit.core"
BYTE_RULES = {"labkit.parallel.data.zero", "labkit.parallel.expert.compose",
              "labkit.parallel.pipeline.schedules"}
MECHANISMS = ("labkit.transformer", "labkit.training", "labkit.parallel", "labkit.quantisation",
              "labkit.host")
COURSE = ("labkit.course", "labkit.__main__")
PACKAGES = {"labkit", "labkit.parallel", "labkit.parallel.context", "labkit.parallel.data",
            "labkit.parallel.expert", "labkit.parallel.pipeline", "labkit.parallel.tensor"}  # a docstring, no import


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in
               ((prefixes,) if isinstance(prefixes, str) else prefixes))


def layer(name: str) -> int:
    """0 core, 1 estimate, 2 mechanisms, 3 course."""
    if under(name, CORE):
        return 0
    if under(name, "labkit.predict") or name in BYTE_RULES:
        return 1
    if under(name, COURSE):
        return 3
    assert under(name, MECHANISMS) or name in PACKAGES, f"{name} is in no layer's folder"
    return 2


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("labkit",) + path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict) -> list[tuple[str, bool]]:
    """(imported module, outside every function?) for every import in the file. ``from labkit
    import name`` counts as an import of the module that defines ``name``."""
    tree = ast.parse(path.read_text())
    lazy = {id(inner) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for inner in ast.walk(node)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            if base == "labkit":
                targets += [f"labkit.{labkit._HOMES[a.name]}" for a in node.names
                            if a.name in labkit._HOMES]
            targets = [t for t in targets if t in known] or [base]
        else:
            continue
        found += [(t, id(node) not in lazy) for t in targets]
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {t for t, _ in imports(name, path, known) if t in known and t != name
                   and t not in PACKAGES}
            for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(component)

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_every_module_imports_only_its_layer_and_those_below():
    known = modules()
    for name, path in sorted(known.items()):
        for target, _ in imports(name, path, known):
            if target in known and target not in PACKAGES:
                assert layer(target) <= layer(name), \
                    f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"


def test_the_core_and_the_estimate_import_only_the_standard_library_outside_functions():
    known = modules()
    assert BYTE_RULES <= set(known), BYTE_RULES - set(known)
    for name in sorted(n for n in known if layer(n) <= 1):
        for target, at_top in imports(name, known[name], known):
            top_name = target.split(".")[0]
            assert not at_top or top_name in sys.stdlib_module_names | {"labkit", "__future__"}, \
                f"{name} imports {target} outside a function: the estimate must load without it"


def test_packages_hold_only_a_docstring():
    """Importing ``labkit.parallel.data.zero`` loads ``labkit.parallel.data`` first: it must
    load nothing else, or the estimate would pull in a mechanism unseen."""
    known = modules()
    for name in PACKAGES - {"labkit"}:
        body = ast.parse(known[name].read_text()).body
        assert all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                   for node in body), f"{name}/__init__.py holds code: move it to a module"


def test_labkit_modules_do_not_import_the_top_package():
    """``import labkit as lk`` inside labkit would hide which layer a name comes from."""
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert all(a.name != "labkit" for a in node.names), f"{name}: import labkit"


def test_no_import_cycle():
    assert cycles(graph()) == [], ("an import cycle: import downward only (the core, the "
                                   "estimate, the mechanisms, then the course)")


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_estimate_runs_without_torch_installed():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
            "import labkit as lk\n"
            "e = lk.estimate('deepseek-v3', 1, 4096, precision='bf16-master', "
            "recompute='selective', layout=lk.Layout(dp=256, zero_stage=3, tp=8, sp=True))\n"
            "print(e.total, lk.fmt_bytes(e.total), lk.count_params('llama-2-7b').total)\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('labkit'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    total, _, _, params = done.stdout.split("\n")[0].split()
    assert int(params) == 6_738_415_616                       # LLaMA-2-7B, published
    assert int(total) == labkit.estimate(
        "deepseek-v3", 1, 4096, precision="bf16-master", recompute="selective",
        layout=labkit.Layout(dp=256, zero_stage=3, tp=8, sp=True)).total
    loaded = set(done.stdout.split("\n")[1].split()) - PACKAGES - {"labkit.preset_data"}
    assert {layer(name) for name in loaded} <= {0, 1}, loaded     # the presets' JSON aside


MAX_MODULE_LINES = 500      # a module reads top to bottom
MAX_FUNCTION_LINES = 60     # code lines of a function, its docstring not counted


def test_modules_and_functions_stay_short():
    long_modules, long_functions = [], []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append((name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if body and body[-1].end_lineno - body[0].lineno + 1 > MAX_FUNCTION_LINES:
                long_functions.append(f"{name}.{node.name}")
    assert not long_modules, f"split these modules: {long_modules}"
    assert not long_functions, f"split these functions: {long_functions}"


def test_pyproject_ships_every_package():
    """A wheel holds only the packages pyproject names: a folder left out is missing there."""
    import tomllib
    listed = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(PACKAGE.parent).parts)
               for p in PACKAGE.rglob("__init__.py")}
    assert set(listed["packages"]) == on_disk | {"labkit.preset_data"}
