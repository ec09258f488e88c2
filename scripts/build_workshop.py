"""Build the workshop kit from the course's own sources: solutions, handouts, guide, landing page.

    python scripts/build_workshop.py                        # regenerate every file below
    python scripts/build_workshop.py --check                # compare with the files as they are
    python scripts/build_workshop.py --time [--scale workshop]   # time each lab, then regenerate

Writes, from the README's "## The labs" table, the committed notebooks and labkit's exercises:

- ``workshop/solutions/NN_solutions.ipynb``, one per lab with exercises
  (``labkit.course.exercises``):
  for each exercise its question, ``print(solution(id))`` (the worked solution, with labkit's
  numbers) and the answer computed with labkit (``workshop/answers.py``) passed to
  ``check(id, answer)``. Committed without outputs; ``tests/test_workshop.py`` runs them (slow).
- ``workshop/handouts/NN_name.md``, a short handout per lab from its executed notebook: title and
  time, what you will learn, the outline, its first and last figure (``img/NN_1.png``,
  ``img/NN_2.png``), the exercises, the summary and further reading.
- ``workshop/README.md``, the instructor guide: ``workshop/guide_template.md`` (the prose:
  what to live-code, what learners get wrong) with the lab table and two agendas filled in. Each
  agenda's slot for a lab is the README's time; the build fails if an agenda overruns its day.
- ``START_HERE.ipynb`` at the repository root: the labs as links, with time and needs.

``--time`` executes each lab with papermill at the given SCALE in a temporary folder (scripts/
run_notebooks.py's ``execute``), adds the seconds and the machine as a run to
``workshop/timings.json`` (the last five are kept) and regenerates the guide, whose table shows
each lab's time, or its fastest and slowest over the runs (or "not measured" before). Everything
else is deterministic: building twice gives the same bytes, which tests/test_workshop.py checks.
"""
from __future__ import annotations

import argparse
import base64
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from labkit.course import exercises

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
WORKSHOP = ROOT / "workshop"
SOLUTIONS = WORKSHOP / "solutions"
HANDOUTS = WORKSHOP / "handouts"
FIGURES = HANDOUTS / "img"
TEMPLATE = WORKSHOP / "guide_template.md"
ANSWERS = WORKSHOP / "answers.py"
TIMINGS = WORKSHOP / "timings.json"
GUIDE = WORKSHOP / "README.md"
LANDING = ROOT / "START_HERE.ipynb"

# What each lab needs beyond `pip install -e ".[dev]"` (the guide's table and the landing page).
NEEDS = {
    "04": "starts 2 and 4 local processes (gloo on the CPU), and a `torchrun` job",
    "05": "starts 2 and 4 local processes (gloo on the CPU)",
    "06": 'optional: bitsandbytes and torchao (`pip install -e ".[production]"`) for section 8; '
          "without them it shows labkit's rows only",
    "07": 'at SCALE="workshop" it compiles a FlexAttention kernel once',
    "08": "reads this host's settings (Linux /proc and /sys; changes nothing); `unshare` (user "
          "namespaces) for the small-/dev/shm run, which otherwise says why it did not run",
}
NOTHING_MORE = "nothing beyond the install"
GPU_NOTE = ("Every lab runs on a 2-core laptop CPU; a CUDA GPU is optional everywhere (its cells "
            "say so and skip without one).")

# The agendas: lab numbers, and (label, minutes) for breaks. A lab's slot is the README's time.
BREAK, LUNCH = "Break", "Lunch"


@dataclass(frozen=True)
class Day:
    name: str
    start: str              # "09:00"
    minutes: int            # the day's length: the agenda must fit
    plan: tuple             # lab numbers ("01") and (label, minutes) pauses, in order


HALF_DAY = Day("Half day: the core", "09:00", 4 * 60 + 15,
               ("00", "01", (BREAK, 10), "02", (BREAK, 10), "03", (BREAK, 10), "09"))
# every lab takes longer than a working day (labs_total in the guide): the full day leaves the
# three most specialised ones (05 parallelism layouts, 06 quantisation, 08 the host) to self-study
FULL_DAY = Day("Full day: seven labs", "09:00", 7 * 60 + 10,
               ("00", "01", (BREAK, 10), "02", (BREAK, 10), "03", (BREAK, 15), "04",
                (LUNCH, 45), "07", (BREAK, 10), "09"))
DAYS = (HALF_DAY, FULL_DAY)


# --- the course: the README's lab table, each lab's notebook ------------------------------------

@dataclass(frozen=True)
class Lab:
    number: str             # "01"
    name: str               # "parameter memory" (markdown, as the README writes it)
    minutes: int            # the README's time
    notebook: Path | None   # notebooks/01_parameter_memory.ipynb, if it exists

    @property
    def label(self) -> str:
        return f"{self.number} · {self.name}"

    @property
    def needs(self) -> str:
        return NEEDS.get(self.number, NOTHING_MORE)


def read_labs(readme: Path = ROOT / "README.md", notebooks: Path = NOTEBOOKS) -> list[Lab]:
    """The rows of the README's "## The labs" table (| # | lab | what you measure | time |)."""
    text = readme.read_text(encoding="utf-8")
    table = re.search(r"^## The labs\n(.*?)(?=^## |\Z)", text, re.M | re.S).group(1)
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in table.splitlines() if line.startswith("|")][2:]     # after header and ---
    labs = []
    for number, name, _, duration in rows:
        found = sorted(notebooks.glob(f"{number}_*.ipynb"))
        labs.append(Lab(number, name, int(re.match(r"(\d+) min", duration).group(1)),
                        found[0] if found else None))
    return labs


def notebook_cell(cell_type: str, source: str, cell_id: str):
    """A cell with a fixed id (nbformat's own ids are random: the files must not change)."""
    new = nbformat.v4.new_markdown_cell if cell_type == "markdown" else nbformat.v4.new_code_cell
    return new(source, id=cell_id)


def notebook_bytes(cells: list) -> bytes:
    nb = nbformat.v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.validate(nb)
    return (nbformat.writes(nb) + "\n").encode()


def title_of(nb) -> str:
    """The first "# " heading of the notebook's first cell."""
    return re.search(r"^# (.+)$", nb.cells[0].source, re.M).group(1).strip()


# --- 1. solution notebooks ----------------------------------------------------------------------

def answer_cells(path: Path = ANSWERS) -> dict[str, str]:
    """{exercise id: its cell's code} from the ``# %% <id>`` cells of workshop/answers.py."""
    parts = re.split(r"^# %% (\S+)\n", path.read_text(encoding="utf-8"), flags=re.M)
    return {i: code.strip() for i, code in zip(parts[1::2], parts[2::2])}


def split_imports(code: str) -> tuple[list[str], str]:
    """(the import lines at the top of a cell, the rest): imports go to the one import cell."""
    lines = code.splitlines()
    n = next((i for i, line in enumerate(lines) if not line.startswith(("import ", "from "))),
             len(lines))
    return lines[:n], "\n".join(lines[n:])


def one_line(text: str) -> str:
    return " ".join(text.split())


def solution_notebook(lab: Lab, ids: list[str], answers: dict[str, str]) -> bytes:
    nb_title = title_of(nbformat.read(lab.notebook, as_version=4))
    intro = (f"# Worked solutions: {nb_title}\n\n"
             f"The {len(ids)} exercises of lab {lab.number} (`notebooks/{lab.notebook.name}`), each "
             "with its question, the worked solution with labkit's numbers (`solution(id)`), and "
             "the answer computed with labkit and passed to `check(id, answer)`, which shows ✅ "
             "when it is right. For instructors: learners meet these questions in the lab with "
             "`None` in place of the answer.\n\n"
             "*Generated by `scripts/build_workshop.py` from `labkit.course.exercises` and "
             "`workshop/answers.py`; edit those, not this file.*")
    imports = {"import labkit as lk", "from labkit.course.exercises import check, solution"}
    cells = []
    for i in ids:
        ex = exercises.get(i)
        head, body = split_imports(answers[i])
        imports.update(head)
        question = (f"## `{i}`\n\n{ex.question}\n\n*Answer in {ex.unit}.*\n\n"
                    f"<details><summary>Hint</summary>\n\n{ex.hint}\n\n</details>")
        cells += [notebook_cell("markdown", question, f"{i}-question"),
                  notebook_cell("code", f'print(solution("{i}"))', f"{i}-solution"),
                  notebook_cell("code", f'{body}\ncheck("{i}", answer)', f"{i}-answer")]
    # `import x` lines first, then `from x import y`, each sorted: one import cell
    import_cell = "\n".join(sorted(imports, key=lambda line: (line.startswith("from"), line)))
    return notebook_bytes([notebook_cell("markdown", intro, "title"),
                           notebook_cell("code", import_cell, "imports"), *cells])


def solutions(labs: list[Lab]) -> dict[Path, bytes]:
    answers = answer_cells()
    missing = [i for i in exercises.exercises() if i not in answers]
    unknown = [i for i in answers if i not in exercises.exercises()]
    if missing or unknown:
        raise SystemExit(f"workshop/answers.py: add a '# %% <id>' cell for {missing or 'none'}; "
                         f"remove the cells of exercises that no longer exist: {unknown or 'none'}")
    files = {}
    for lab in labs:
        ids = exercises.exercises(f"{lab.number}-")
        if ids and lab.notebook:
            files[SOLUTIONS / f"{lab.number}_solutions.ipynb"] = solution_notebook(lab, ids, answers)
    return files


# --- 2. handouts ---------------------------------------------------------------------------------

def section_headings(nb) -> list[str]:
    """The notebook's "## " headings, in order (not the comments of a ``` code block)."""
    headings = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        fenced = False
        for line in cell.source.splitlines():
            fenced = fenced != line.startswith("```")
            if not fenced and line.startswith("## "):
                headings.append(line[3:].strip())
    return headings


def learning_goals(nb) -> str:
    """What the first cell says you will learn (its list, or lab 00's sentence)."""
    found = re.search(r"\*\*You will(?: learn)?:\*\*\s*(.*?)(?:\n\n|\Z)", nb.cells[0].source, re.S)
    goals = found.group(1).strip() if found else ""
    return goals[:1].upper() + goals[1:]                    # lab 00's is a sentence


def figures(nb) -> list[tuple[str, bytes]]:
    """(the section it is in, PNG bytes) of the notebook's first and last figure."""
    found, section = [], ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            headings = re.findall(r"^## (.+)$", cell.source, re.M)
            section = headings[-1].strip() if headings else section
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                found.append((section, base64.b64decode(png)))
    return found[:1] + found[1:][-1:]


def summary(nb) -> str:
    """The "## Summary" and "## Further reading" cells, without their headings."""
    return "\n\n".join(cell.source.split("\n", 1)[1].strip() for cell in nb.cells
                       if cell.cell_type == "markdown"
                       and cell.source.startswith(("## Summary", "## Further reading")))


def escape_number(heading: str) -> str:
    """"1. Bytes per number" as text, not as a numbered list inside the outline's list."""
    return re.sub(r"^(\d+)\.", r"\1\\.", heading)


def handout(lab: Lab) -> dict[Path, bytes]:
    nb = nbformat.read(lab.notebook, as_version=4)
    stated = re.search(r"\*\*Time:\*\*\s*(\d+) minutes", nb.cells[0].source)
    time_line = f"**Time:** {lab.minutes} min"
    if stated and int(stated.group(1)) != lab.minutes:
        time_line += f" (the notebook's first cell says {stated.group(1)} minutes)"
    parts = [f"# {title_of(nb)}",
             f"{time_line} · the lab: [`notebooks/{lab.notebook.name}`]"
             f"(../../notebooks/{lab.notebook.name}) · needs: {lab.needs}",
             f"## You will learn\n\n{learning_goals(nb)}",
             "## Outline\n\n" + "\n".join(f"- {escape_number(heading)}"
                                          for heading in section_headings(nb))]
    files, shown = {}, []
    for k, (section, png) in enumerate(figures(nb), 1):
        name = f"{lab.number}_{k}.png"
        files[FIGURES / name] = png
        shown.append(f"![lab {lab.number}, figure {k}](img/{name})\n\n*Figure {k}, from "
                     f"\"{section}\".*")
    if shown:
        parts.append("## Key figures\n\n" + "\n\n".join(shown))
    ids = exercises.exercises(f"{lab.number}-")
    if ids:
        parts.append("## Exercises\n\nIn the lab's last section; `check(id, answer)` says at once "
                     "whether an answer is right.\n\n" + "\n".join(
                         f"- **`{i}`**: {one_line(exercises.get(i).question)} "
                         f"*(answer in {exercises.get(i).unit})*" for i in ids))
    if summary(nb):
        parts.append(f"## Summary and further reading\n\n{summary(nb)}")
    parts.append("---\n*Generated by `scripts/build_workshop.py` from the committed notebook "
                 "(figures at SCALE=\"ci\").*")
    files[HANDOUTS / f"{lab.notebook.stem}.md"] = ("\n\n".join(parts) + "\n").encode()
    return files


def handouts(labs: list[Lab]) -> dict[Path, bytes]:
    files = {}
    for lab in labs:
        if lab.notebook:
            files.update(handout(lab))
    return files


# --- 3. agendas ----------------------------------------------------------------------------------

def agenda(day: Day, labs: list[Lab]) -> list[tuple[str, str, int]]:
    """(start, what, minutes) for each slot; a lab's slot is the README's time. Raises SystemExit
    when the slots overrun the day."""
    by_number = {lab.number: lab for lab in labs}
    clock = datetime.datetime.strptime(day.start, "%H:%M")
    slots = []
    for item in day.plan:
        what, minutes = ((f"Lab {by_number[item].label}", by_number[item].minutes)
                         if isinstance(item, str) else item)
        slots.append((clock.strftime("%H:%M"), what, minutes))
        clock += datetime.timedelta(minutes=minutes)
    total = sum(minutes for _, _, minutes in slots)
    if total > day.minutes:
        raise SystemExit(f"the {day.name.lower()} takes {hours(total)}, more than its "
                         f"{hours(day.minutes)}: shorten it in scripts/build_workshop.py")
    return slots


def hours(minutes: int) -> str:
    h, m = divmod(minutes, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min"


def agenda_table(day: Day, labs: list[Lab]) -> str:
    slots = agenda(day, labs)
    total = sum(minutes for _, _, minutes in slots)
    end = (datetime.datetime.strptime(day.start, "%H:%M")
           + datetime.timedelta(minutes=total)).strftime("%H:%M")
    in_labs = sum(minutes for _, what, minutes in slots if what.startswith("Lab "))
    rows = "\n".join(f"| {start} | {what} | {minutes} min |" for start, what, minutes in slots)
    return (f"**{day.name}**, {day.start}–{end}: {hours(total)} of a {hours(day.minutes)} day, "
            f"{hours(in_labs)} of it in the labs.\n\n| start | slot | length |\n| --- | --- | --- |\n"
            f"{rows}\n| {end} | end | |")


# --- 4. the instructor guide ---------------------------------------------------------------------

KEPT_RUNS = 5       # --time adds a run to workshop/timings.json and keeps the last five


def read_timings(path: Path = TIMINGS) -> dict | None:
    """workshop/timings.json - {"scale", "runs": [{"seconds", "failed", "machine"}, ...]} - if
    it was measured at SCALE="workshop", else None."""
    if not path.exists():
        return None
    timings = json.loads(path.read_text(encoding="utf-8"))
    return timings if timings.get("scale") == "workshop" else None


def seconds_text(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def run_time(stem: str, timings: dict | None) -> str:
    """How long the lab took at SCALE="workshop" in the runs that timed it, as the guide's
    table says it: one time, or the fastest and slowest of several runs."""
    runs = [run for run in (timings or {}).get("runs", [])
            if stem in run.get("seconds", {}) or stem in run.get("failed", {})]
    if not runs:
        return "not measured"
    seconds = sorted(run["seconds"][stem] for run in runs if stem in run.get("seconds", {}))
    if not seconds:
        return "did not finish"
    failed = len(runs) - len(seconds)
    text = seconds_text(seconds[0]) if len(seconds) == 1 else \
        f"{seconds_text(seconds[0])} - {seconds_text(seconds[-1])} ({len(seconds)} runs)"
    why = " (a cell passed the timer's limit: time it on the room's machines before class)"
    return text + (f"; did not finish in {failed} of {len(runs)} runs{why}" if failed else "")


def spread_note(runs: list[dict]) -> str:
    """How far the slowest run of a lab was from its fastest, over the labs timed twice or more."""
    per_lab = {}
    for run in runs:
        for stem, seconds in run.get("seconds", {}).items():
            per_lab.setdefault(stem, []).append(seconds)
    ratios = [max(s) / min(s) for s in per_lab.values() if len(s) > 1]
    if not ratios:
        return ""
    return (f" From one run to another the same lab took up to {max(ratios):.1f} times as long "
            "(other work on the machine, a different host): time the labs on the learners' "
            "machines.")


def lab_table(labs: list[Lab], timings: dict | None) -> str:
    rows = []
    for lab in labs:
        if not lab.notebook:
            rows.append(f"| {lab.label} (not yet written) | {lab.minutes} min | | | | |")
            continue
        ids = exercises.exercises(f"{lab.number}-")
        rows.append(
            f"| [{lab.label}](../notebooks/{lab.notebook.name}) | {lab.minutes} min | "
            f"{run_time(lab.notebook.stem, timings)} | "
            + (f"[{len(ids)}](solutions/{lab.number}_solutions.ipynb)" if ids else "none")
            + f" | [handout](handouts/{lab.notebook.stem}.md) | {lab.needs} |")
    header = ("| lab | time (README) | runs in, SCALE=\"workshop\" | exercises | handout | needs |\n"
              "| --- | --- | --- | --- | --- | --- |")
    runs = (timings or {}).get("runs", [])
    if runs:
        machines = sorted({f"{m['cpus']} CPUs, torch {m['torch']}, {m['gpu'] or 'no GPU'}"
                           for m in (run["machine"] for run in runs)})
        dates = sorted({run["machine"]["date"] for run in runs})
        note = (f"Measured with `--time` in {len(runs)} run{'s' * (len(runs) > 1)} "
                f"({', '.join(dates)}) on {'; '.join(machines)}: the seconds a whole lab takes to "
                "execute, not to teach." + spread_note(runs))
    else:
        note = ("The labs' run times at SCALE=\"workshop\" are not measured yet: "
                "`python scripts/build_workshop.py --time --scale workshop` on a machine like the "
                "learners' fills that column.")
    return f"{header}\n" + "\n".join(rows) + f"\n\n{note} {GPU_NOTE}"


def fill(template: str, parts: dict[str, str]) -> str:
    """Replace each ``{{ name }}``; an unknown or unused name is an error."""
    used = set(re.findall(r"\{\{ (\w+) \}\}", template))
    if used != set(parts):
        raise SystemExit(f"{TEMPLATE.name}: placeholders {sorted(used)} != {sorted(parts)}")
    return re.sub(r"\{\{ (\w+) \}\}", lambda m: parts[m.group(1)], template)


def guide(labs: list[Lab]) -> dict[Path, bytes]:
    text = fill(TEMPLATE.read_text(encoding="utf-8"), {
        "lab_table": lab_table(labs, read_timings()),
        "half_day": agenda_table(HALF_DAY, labs),
        "full_day": agenda_table(FULL_DAY, labs),
        "labs_total": hours(sum(lab.minutes for lab in labs)),
    })
    note = ("<!-- Generated by scripts/build_workshop.py from workshop/guide_template.md: edit "
            "the template, then run the script. -->\n")
    return {GUIDE: (note + text).encode()}


# --- 5. the landing notebook ---------------------------------------------------------------------

def landing(labs: list[Lab]) -> dict[Path, bytes]:
    intro = ("# GPU Memory Labs: start here\n\n"
             "**Runnable labs on where GPU memory goes when you train and fine-tune large language "
             "models.**\n\n"
             "- **What a lab does**: it predicts a training step's memory with a formula, measures "
             "it, and explains the difference tensor by tensor. Small models' steps are real "
             "PyTorch steps on this machine. Full-size models' steps run on fake tensors (shapes "
             "without memory), with what a CUDA run does by default.\n"
             "- **How to run one**: open a lab below (the link opens it in JupyterLab) and run it "
             "from the top (*Run ▸ Run All Cells*). Read the prose between the cells, then change "
             "the parameters and move the panel's controls.\n"
             "- **The order**: take them in order, as each lab builds on the ones before; lab 09 "
             "puts them together. The exercises at the end of labs 01-09 check your answer at "
             "once.\n"
             "- **CPU or GPU**: " + GPU_NOTE + " The small models' steps run on this machine's "
             "GPU when there is one.")
    rows = [f"| [{lab.label}](notebooks/{lab.notebook.name}) | {lab.minutes} min | {lab.needs} |"
            if lab.notebook else f"| {lab.label} (not yet written) | {lab.minutes} min | |"
            for lab in labs]
    table = ("## The labs\n\n| lab | time | needs |\n| --- | --- | --- |\n" + "\n".join(rows))
    more = ("## Before you start, and more\n\n"
            "- Set up once: `pip install -e \".[dev]\" --extra-index-url "
            "https://download.pytorch.org/whl/cpu` on a machine without an NVIDIA GPU, "
            "`pip install -e \".[dev]\"` on one with it; then `jupyter lab START_HERE.ipynb` "
            "in the repository's folder opens JupyterLab on this page.\n"
            "- Pre-flight check: `python -m labkit doctor --course` says whether every lab runs "
            "on this machine, with a fix for each problem.\n"
            "- The course as a website (the notebooks as committed, no kernel needed): "
            "`python scripts/build_site.py`, then open `site/index.html`. Its "
            "`calculator.html` (served: `python -m http.server -d site`) runs labkit's estimate "
            "and planner in the browser with Pyodide: the way in for someone without Python.\n"
            "- Teaching it: [workshop/README.md](workshop/README.md), the instructor guide "
            "(agendas, solutions, handouts).\n\n"
            "<!-- Generated by scripts/build_workshop.py from the README's lab table. -->")
    return {LANDING: notebook_bytes([notebook_cell("markdown", intro, "start-here"),
                                     notebook_cell("markdown", table, "labs"),
                                     notebook_cell("markdown", more, "more")])}


# --- 6. timing the labs --------------------------------------------------------------------------

def run_notebooks():
    """scripts/run_notebooks.py as a module (its ``execute``), loaded as the tests load it."""
    spec = importlib.util.spec_from_file_location("run_notebooks",
                                                  Path(__file__).resolve().parent / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine() -> dict:
    import torch
    return {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def time_labs(paths: list[Path], scale: str, out: Path = TIMINGS) -> dict:
    """Execute each notebook at SCALE=``scale``, from a copy in a temporary folder; add the run,
    {"seconds": {stem: seconds}, "failed": {stem: why}, "machine"}, to ``out``'s runs at that
    scale (the last ``KEPT_RUNS``) and return it. A lab whose cell fails or hangs is noted, and
    the others still run."""
    runner = run_notebooks()
    seconds, failed = {}, {}
    with tempfile.TemporaryDirectory(prefix="workshop-timing-") as folder:
        for path in paths:
            copy = Path(folder) / path.name
            shutil.copy(path, copy)
            start = time.perf_counter()
            try:
                runner.execute(copy, {"SCALE": scale}, output=Path(folder) / f"run-{path.name}")
            except runner.PapermillExecutionError as error:
                failed[path.stem] = f"cell [{error.exec_count}]: {error.ename}: {error.evalue}"
            except runner.CellTimeoutError as error:
                failed[path.stem] = str(error).strip().splitlines()[0]
            if path.stem in failed:
                print(f"   failed  {path.name}, {failed[path.stem]}", flush=True)
                continue
            seconds[path.stem] = round(time.perf_counter() - start, 1)
            print(f"{seconds[path.stem]:7.1f} s  {path.name}", flush=True)
    run = {"seconds": seconds, "failed": failed, "machine": machine()}
    earlier = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
    runs = earlier.get("runs", []) if earlier.get("scale") == scale else []
    out.write_text(json.dumps({"scale": scale, "runs": (runs + [run])[-KEPT_RUNS:]}, indent=1)
                   + "\n", encoding="utf-8")
    return run


# --- building ------------------------------------------------------------------------------------

KINDS = {"solutions": solutions, "handouts": handouts, "guide": guide, "landing": landing}
GENERATED_FOLDERS = {SOLUTIONS: "*.ipynb", HANDOUTS: "*.md", FIGURES: "*.png"}


def generate(kinds=KINDS) -> dict[Path, bytes]:
    """Every file the build writes: {path: bytes}."""
    labs = read_labs()
    files = {}
    for kind in kinds:
        files.update(KINDS[kind](labs))
    return files


def differences(files: dict[Path, bytes]) -> list[str]:
    """The files that differ from ``files`` as generated, and generated-looking files left over."""
    problems = [str(path.relative_to(ROOT)) + (" differs" if path.exists() else " is missing")
                for path, data in files.items() if not path.exists() or path.read_bytes() != data]
    for folder, pattern in GENERATED_FOLDERS.items():
        if any(path.parent == folder for path in files):
            problems += [f"{path.relative_to(ROOT)} is not generated any more"
                         for path in sorted(folder.glob(pattern)) if path not in files]
    return problems


def write(files: dict[Path, bytes]) -> None:
    for folder, pattern in GENERATED_FOLDERS.items():      # what a removed lab left behind
        for path in folder.glob(pattern):
            if path not in files:
                path.unlink()
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare the generated files with the committed ones; write nothing")
    parser.add_argument("--time", action="store_true",
                        help="execute each lab at --scale, write the seconds, then regenerate")
    parser.add_argument("--scale", default="workshop", help='the labs\' SCALE for --time')
    parser.add_argument("--timings", type=Path, default=TIMINGS,
                        help="where --time writes its JSON (another path: nothing is regenerated)")
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="with --time: these notebooks instead of every lab")
    args = parser.parse_args(argv)
    if args.notebooks and not args.time:
        parser.error("notebooks are only taken with --time")
    failed = {}
    if args.time:
        paths = args.notebooks or [lab.notebook for lab in read_labs() if lab.notebook]
        failed = time_labs(paths, args.scale, args.timings)["failed"]
        if args.timings.resolve() != TIMINGS:               # a trial run: the guide stays as it is
            return 1 if failed else 0
    files = generate()
    if args.check:
        problems = differences(files)
        print("\n".join(problems) or "the workshop files are up to date")
        return 1 if problems else 0
    write(files)
    print(f"wrote {len(files)} files: " + ", ".join(sorted(
        {str(path.parent.relative_to(ROOT)) for path in files})))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
