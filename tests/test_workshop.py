"""The workshop kit is what scripts/build_workshop.py makes of the course's sources, byte for byte:
solutions that cover every exercise once (and, slow, print ✅ for each), a handout per lab whose
figures exist, agendas that fit their day, a guide that quotes only what its labs compute, a
landing notebook whose links open every lab; ``--time`` writes each notebook's seconds."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.course import exercises

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("build_workshop",
                                               ROOT / "scripts" / "build_workshop.py")
build_workshop = importlib.util.module_from_spec(_spec)
sys.modules["build_workshop"] = build_workshop        # its dataclasses look their module up
_spec.loader.exec_module(build_workshop)

LAB_NOTEBOOKS = sorted((ROOT / "notebooks").glob("0*.ipynb"))
SOLUTION_NOTEBOOKS = sorted(build_workshop.SOLUTIONS.glob("*.ipynb"))
STALE = "run scripts/build_workshop.py"
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def labs():
    return build_workshop.read_labs()


@pytest.mark.parametrize("kind", sorted(build_workshop.KINDS))
def test_the_committed_files_equal_a_fresh_build(kind, labs):
    problems = build_workshop.differences(build_workshop.KINDS[kind](labs))
    assert not problems, f"{kind}: {'; '.join(problems)}: {STALE}"


def test_every_exercise_is_solved_in_exactly_one_solution_notebook_of_its_lab():
    solved = {}
    for path in SOLUTION_NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            for i in re.findall(r'^check\("([^"]+)", answer\)$', cell.source, re.M):
                solved.setdefault(i, []).append(path.name)
            if cell.cell_type == "code":                  # committed without outputs
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: {STALE}"
    assert sorted(solved) == sorted(exercises.exercises()), STALE
    assert {i: where for i, where in solved.items()
            if where != [f"{i[:2]}_solutions.ipynb"]} == {}


def test_the_solution_notebooks_import_in_one_cell_after_the_title():
    for path in SOLUTION_NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        assert [c.id for c in cells[:2]] == ["title", "imports"]
        assert all(not re.search(r"^(import|from) ", c.source, re.M)
                   for c in cells[2:] if c.cell_type == "code"), path.name


def test_every_lab_has_a_handout_whose_figures_and_links_exist():
    for notebook in LAB_NOTEBOOKS:
        handout = build_workshop.HANDOUTS / f"{notebook.stem}.md"
        assert handout.exists(), f"no handout for {notebook.name}: {STALE}"
        text = handout.read_text(encoding="utf-8")
        figures = re.findall(r"!\[[^\]]*\]\((img/[^)]+\.png)\)", text)
        assert 1 <= len(figures) <= 2, handout.name
        for link in LINK.findall(text):
            assert (handout.parent / link).is_file(), f"{handout.name}: {link} does not exist"
        assert text.startswith(f"# {notebook.stem[:2]} · ")


def test_each_agenda_fits_its_day_and_gives_each_lab_the_readmes_time(labs):
    minutes = {f"Lab {lab.label}": lab.minutes for lab in labs}
    for day in build_workshop.DAYS:
        slots = build_workshop.agenda(day, labs)
        assert sum(length for _, _, length in slots) <= day.minutes, day.name
        assert all(length == minutes[what] for _, what, length in slots if what in minutes)
    half, full = ([what for _, what, _ in build_workshop.agenda(day, labs) if what in minutes]
                  for day in (build_workshop.HALF_DAY, build_workshop.FULL_DAY))
    assert [w[4:6] for w in half] == ["00", "01", "02", "03", "09"]
    assert [w[4:6] for w in full] == ["00", "01", "02", "03", "04", "07", "09"]
    # the labs the full day leaves out are named in the guide as self-study
    assert "leaves 05, 06 and 08 for self-study" in " ".join(build_workshop.GUIDE.read_text().split())


def test_an_agenda_longer_than_its_day_stops_the_build(labs):
    too_long = build_workshop.Day("A short day", "09:00", 60, ("01", (build_workshop.BREAK, 15), "02"))
    with pytest.raises(SystemExit, match="takes 2 h 00 min, more than its 1 h 00 min"):
        build_workshop.agenda(too_long, labs)


def test_the_landing_notebook_links_every_lab_and_each_link_resolves():
    nb = nbformat.read(build_workshop.LANDING, as_version=4)
    assert {c.cell_type for c in nb.cells} == {"markdown"}
    links = [link for c in nb.cells for link in LINK.findall(c.source)]
    for notebook in LAB_NOTEBOOKS:
        assert f"notebooks/{notebook.name}" in links, f"START_HERE.ipynb misses {notebook.name}"
    for link in links:
        assert (ROOT / link).exists(), f"START_HERE.ipynb: {link} does not exist"
    text = "\n".join(c.source for c in nb.cells)
    assert "python -m labkit doctor --course" in text and "scripts/build_site.py" in text


def test_the_guides_links_resolve():
    text = build_workshop.GUIDE.read_text(encoding="utf-8")
    for link in LINK.findall(text):
        assert (build_workshop.GUIDE.parent / link).exists(), f"workshop/README.md: {link}"


def notebook_text(path: Path, outputs_only: bool = False) -> str:
    """Everything a lab shows: its cells' sources and their text outputs (or the outputs only)."""
    parts = []
    for cell in nbformat.read(path, as_version=4).cells:
        if not outputs_only:
            parts.append(cell.source)
        for output in cell.get("outputs", []):
            parts.append(output.get("text", "") + output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


# a number as written: 4,096, 125.52 (a trailing comma or full stop is not part of it)
NUMBER = re.compile(r"(?<![\d.])\d+(?:,\d{3})*(?:\.\d+)?(?![\d])")
# the unit right after a measured figure: "125.52 GiB", "73.0%", "3.9x", "0.54 s"
UNIT = r"\s?(GiB|MiB|KiB|TiB|GB|MB|ms|s|x|%|bits|bytes|tokens)(?![A-Za-z])"


def measured_figures(text: str) -> set[tuple[str, str]]:
    """(decimal number, the unit after it or "") for every decimal figure in ``text``."""
    return {(m.group(1), m.group(2) or "")
            for m in re.finditer(rf"((?<![\d.])\d+(?:,\d{{3}})*\.\d+)(?![\d])(?:{UNIT})?", text)}


def lab_sections(template: str) -> dict[str, str]:
    """{"01": the template's "### 01 · ..." section}."""
    return dict(re.findall(r"^### (\d\d) · .*?\n(.*?)(?=^##)", template + "\n##", re.M | re.S))


def test_the_guide_quotes_only_numbers_and_sections_its_labs_have():
    """Each number a lab's section quotes is a whole number the lab shows (not a piece of a
    longer one: 12 is not found in 125.52); each decimal figure, a computed result, is one its
    stored outputs print, with the same unit after it when the guide gives one."""
    sections = lab_sections(build_workshop.TEMPLATE.read_text(encoding="utf-8"))
    assert sorted(sections) == [p.stem[:2] for p in LAB_NOTEBOOKS]
    for number, section in sections.items():
        path = next(p for p in LAB_NOTEBOOKS if p.stem.startswith(number))
        shown = notebook_text(path)
        missing = sorted(set(NUMBER.findall(section)) - set(NUMBER.findall(shown)))
        assert not missing, f"lab {number}'s section quotes {missing}, which {path.name} never shows"
        printed = measured_figures(notebook_text(path, outputs_only=True))
        printed_numbers = {n for n, _ in printed}
        unprinted = sorted(f"{n} {unit}".strip() for n, unit in measured_figures(section)
                           if (n, unit) not in printed and not (unit == "" and n in printed_numbers))
        assert not unprinted, (f"lab {number}'s section quotes {unprinted}, which no output of "
                               f"{path.name} prints (with that unit)")
        headings = {h.strip() for h in re.findall(r"^## (.+)$", shown, re.M)}
        for n, heading in re.findall(r'^\d\. \*(?:§(\d+) )?"([^"]+)"\*', section, re.M):
            assert (f"{n}. {heading}" if n else heading) in headings, f"lab {number}: {heading}"


MACHINE = {"date": "2026-01-01", "cpus": 2, "torch": "2.13.0", "gpu": None}


def test_the_guide_says_not_measured_until_the_labs_are_timed(labs):
    table = build_workshop.lab_table(labs, None)
    assert table.count("| not measured |") == len(labs) and "not measured yet" in table
    timed = build_workshop.lab_table(labs, {"scale": "workshop", "runs": [
        {"seconds": {"01_parameter_memory": 125.04}, "failed": {}, "machine": MACHINE}]})
    assert "| 2 min 05 s |" in timed and timed.count("| not measured |") == len(labs) - 1
    assert "in 1 run (2026-01-01) on 2 CPUs, torch 2.13.0, no GPU" in timed
    assert "times as long" not in timed                     # one run: no spread to speak of
    failed = build_workshop.lab_table(labs, {"scale": "workshop", "runs": [
        {"seconds": {}, "failed": {"04_zero_fsdp": "a cell timed out"}, "machine": MACHINE}]})
    assert "| 60 min | did not finish |" in failed


def test_several_runs_show_each_labs_fastest_and_slowest(labs):
    later = dict(MACHINE, date="2026-01-02")
    timings = {"scale": "workshop", "runs": [
        {"seconds": {"01_parameter_memory": 60.0, "04_zero_fsdp": 200.0}, "failed": {},
         "machine": MACHINE},
        {"seconds": {"01_parameter_memory": 150.0}, "failed": {"04_zero_fsdp": "timed out"},
         "machine": later}]}
    table = build_workshop.lab_table(labs, timings)
    assert "| 1 min 00 s - 2 min 30 s (2 runs) |" in table
    assert ("| 3 min 20 s; did not finish in 1 of 2 runs (a cell passed the timer's limit: time it "
            "on the room's machines before class) |") in table
    assert "in 2 runs (2026-01-01, 2026-01-02)" in table
    assert "up to 2.5 times as long" in table


def test_timings_of_another_scale_are_not_shown(tmp_path):
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({"scale": "ci", "runs": []}))
    assert build_workshop.read_timings(path) is None
    assert build_workshop.read_timings(tmp_path / "absent.json") is None


def tiny_notebook(path: Path, code: str) -> Path:
    nbformat.write(nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('SCALE = "ci"', metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(code)], metadata={"kernelspec": {
            "name": "python3", "display_name": "Python 3", "language": "python"}}), path)
    return path


def test_time_executes_each_notebook_at_the_scale_and_writes_its_seconds(tmp_path):
    ran = tmp_path / "ran.txt"
    tiny = tiny_notebook(tmp_path / "tiny.ipynb",
                         f"from pathlib import Path\nPath({str(ran)!r}).write_text(SCALE)")
    broken = tiny_notebook(tmp_path / "broken.ipynb", 'raise ValueError("broken on purpose")')
    out = tmp_path / "timings.json"
    out.write_text(json.dumps({"scale": "workshop", "runs": [
        {"seconds": {"tiny": float(n)}, "failed": {}, "machine": MACHINE}
        for n in range(build_workshop.KEPT_RUNS)]}))
    assert build_workshop.main(["--time", "--scale", "workshop", "--timings", str(out),
                                str(tiny), str(broken)]) == 1          # one lab failed
    timings = json.loads(out.read_text())
    assert timings["scale"] == "workshop" and len(timings["runs"]) == build_workshop.KEPT_RUNS
    assert timings["runs"][0]["seconds"]["tiny"] == 1.0     # the oldest run (0.0) dropped
    run = timings["runs"][-1]                               # this one, added last
    assert list(run["seconds"]) == ["tiny"] and run["seconds"]["tiny"] > 0
    assert "broken on purpose" in run["failed"]["broken"]
    assert {"cpus", "torch", "date"} <= set(run["machine"])
    assert ran.read_text() == "workshop"                   # papermill set SCALE
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # executed in a folder of its own
        "broken.ipynb", "ran.txt", "timings.json", "tiny.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", SOLUTION_NOTEBOOKS, ids=lambda p: p.stem)
def test_each_solution_notebook_runs_and_every_check_shows_a_tick(path, tmp_path):
    import papermill
    nb = papermill.execute_notebook(str(path), str(tmp_path / path.name), kernel_name="python3",
                                    cwd=str(tmp_path), progress_bar=False,
                                    execution_timeout=600)
    answers = [c for c in nb.cells if c.cell_type == "code" and c.id.endswith("-answer")]
    assert len(answers) == len(exercises.exercises(f"{path.stem[:2]}-"))
    for cell in answers:
        shown = "".join(o.get("data", {}).get("text/plain", "") for o in cell.outputs
                        if o.output_type == "execute_result")
        assert shown.startswith("✅"), f"{path.name}, {cell.id}: {shown}"
    for cell in (c for c in nb.cells if c.cell_type == "code" and c.id.endswith("-solution")):
        printed = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
        assert printed.strip() and "{" not in printed, f"{path.name}, {cell.id}: {printed}"
