"""The course's Dockerfiles: they parse as the builder parses them, every COPY finds its files,
the image runs JupyterLab as a non-root user on port 8888, and (slow) the CPU image's RUN
steps succeed on this machine in order. There is no Docker engine here: scripts/dockerfile_run.py
stands in for `docker build`."""
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("dockerfile_run", REPO / "scripts" / "dockerfile_run.py")
dr = importlib.util.module_from_spec(_spec)
sys.modules["dockerfile_run"] = dr          # dataclasses look their module up by name
_spec.loader.exec_module(dr)

CPU = REPO / "Dockerfile"
CUDA = REPO / "container" / "cuda.Dockerfile"


def by_keyword(instructions, keyword):
    return [i for i in instructions if i.keyword == keyword]


# --- the parser, on hand-written cases ------------------------------------------------------

def test_continuations_join_lines_and_drop_the_comments_between_them():
    text = ("# a comment\n"
            "FROM python:3.11-slim AS base\n"
            "\n"
            "RUN apt-get update \\\n"
            "# a comment inside the command\n"
            "\n"
            "    && echo done\n"
            "run echo lower-case keywords are allowed\n")
    ins = dr.parse(text)
    assert [(i.keyword, i.line) for i in ins] == [("FROM", 2), ("RUN", 4), ("RUN", 8)]
    assert ins[1].text == "apt-get update && echo done"
    assert ins[0].comments == ("# a comment",)
    assert dr.stage_names(ins) == ["base"]


def test_the_escape_directive_changes_the_continuation_character():
    ins = dr.parse("# escape=`\nFROM scratch\nRUN a `\n  b\n")
    assert ins[1].text == "a b"


def test_an_unknown_instruction_is_refused_with_the_known_ones_listed():
    with pytest.raises(ValueError, match=r"line 2: unknown instruction 'INSTALL'.*WORKDIR"):
        dr.parse("FROM scratch\nINSTALL torch\n")


def test_substitution_follows_the_builders_rules():
    env = {"A": "1", "EMPTY": ""}
    assert dr.substitute("$A-${A}-${B:-two}-${EMPTY:-x}", env) == "1-1-two-x"
    assert dr.substitute("${A:+set}|${EMPTY:+set}|${B:+set}", env) == "set||"
    assert dr.substitute(r"\$A costs $$", env) == "$A costs $$"
    assert dr.substitute("${B:-$A}", env) == "1"                  # the default is expanded too


def test_json_is_the_exec_form_and_anything_else_the_shell_form():
    cmd, shell, bad = dr.parse('FROM scratch\nCMD ["jupyter", "lab"]\nCMD jupyter lab\n'
                               'CMD [jupyter]\n')[1:]
    assert cmd.exec_form == ["jupyter", "lab"]
    assert shell.exec_form is None and bad.exec_form is None      # not JSON: a shell command


def test_env_takes_both_forms_and_quotes():
    assert dr.assignments('A=1 B="two words" C=${A}', {"A": "0"}, "ENV") == \
        {"A": "1", "B": "two words", "C": "0"}                    # one ENV sees the old A
    assert dr.assignments("PATH /opt/bin", {}, "ENV") == {"PATH": "/opt/bin"}
    with pytest.raises(ValueError, match="NAME=value"):
        dr.assignments("A=1 B", {}, "ENV")


def test_dockerignore_patterns_cover_folders_and_any_depth():
    patterns = [".venv", "**/__pycache__", "*.log", "!keep.log"]
    assert dr.ignored(".venv/bin/python", patterns)
    assert dr.ignored("labkit/parallel/__pycache__/zero.cpython-311.pyc", patterns)
    assert dr.ignored("run.log", patterns) and not dr.ignored("keep.log", patterns)
    assert not dr.ignored("labkit/core/units.py", patterns)


def test_problems_names_each_fault_and_its_fix(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("ARG TAG\nFROM python:${TAG}\nCOPY no_such_folder/ /x/\nCOPY .venv/ /venv/\n"
                   "COPY --from=builder /a /b\nRUN true\n")
    found = dr.problems(bad, REPO)
    assert found == ["line 1: ARG TAG has no default; write ARG TAG=...",
                     "line 3: COPY source no_such_folder/ is not in the repository",
                     "line 4: .venv/ is excluded by .dockerignore",
                     "line 5: COPY --from=builder names no earlier stage",
                     "the final stage has no EXPOSE", "the final stage has no CMD",
                     "the final stage has no USER"]


def test_run_replays_a_stage_in_a_temporary_root(tmp_path):
    """ARG and ENV reach RUN through its environment, WORKDIR and COPY land under the temporary
    root, a build-arg overrides a default, a marked step is skipped and a failing one stops."""
    ctx = tmp_path / "ctx"
    (ctx / "src").mkdir(parents=True)
    (ctx / "src" / "a.txt").write_text("hello\n")
    (ctx / "Dockerfile").write_text(
        "FROM python:3.11-slim\nARG GREETING=hi\nARG WHO=world\nENV OUT=out.txt\n"
        "WORKDIR /app\nCOPY src/ data/\n"
        'RUN echo "$GREETING $WHO" > "$OUT" && cat data/a.txt >> "$OUT"\n'
        "# dockerfile_run: skip (would fail on the host)\nRUN exit 3\n"
        "RUN false\nRUN echo never > never.txt\n"
        'USER nobody\nEXPOSE 8888\nCMD ["true"]\n')
    build = dr.run(ctx / "Dockerfile", tmp_path / "build", {"WHO": "labs"}, repo=ctx,
                   with_pip=False)
    app = build.root / "app"
    assert (app / "out.txt").read_text() == "hi labs\nhello\n"
    assert [(s.keyword, s.returncode, s.skipped) for s in build.steps] == \
        [("COPY", 0, False), ("RUN", 0, False), ("RUN", 0, True), ("RUN", 1, False)]
    assert not (app / "never.txt").exists() and not build.ok
    assert build.workdir == "/app" and build.env == {"OUT": "out.txt"}


# --- the course's Dockerfiles ---------------------------------------------------------------

def test_the_cpu_dockerfile_has_no_problems_and_the_settings_it_promises():
    assert dr.problems(CPU) == []
    ins = dr.parse(CPU.read_text())
    assert by_keyword(ins, "FROM")[0].text == "python:3.11-slim"
    args = dict(a.text.split("=", 1) for a in by_keyword(ins, "ARG"))
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH_VERSION"] == "2.13.0"
    assert [e.text for e in by_keyword(ins, "EXPOSE")] == ["8888"]
    assert by_keyword(ins, "USER")[-1].text not in ("root", "0")
    assert by_keyword(ins, "CMD")[-1].exec_form == \
        ["jupyter", "lab", "--ip=0.0.0.0", "--no-browser", "START_HERE.ipynb"]


@pytest.mark.parametrize("dockerfile", [CPU, CUDA], ids=["cpu", "cuda"])
def test_jupyterlab_opens_at_the_course_root_on_start_here(dockerfile):
    """The server's root is the working folder (the whole course, START_HERE.ipynb included)
    and the page it opens is the landing page, which the build context holds."""
    ins = dr.parse(dockerfile.read_text())
    cmd = by_keyword(ins, "CMD")[-1].exec_form
    assert by_keyword(ins, "WORKDIR")[-1].text == "/labs"
    assert cmd[:2] == ["jupyter", "lab"] and cmd[-1] == "START_HERE.ipynb"
    assert not [a for a in cmd if a.startswith("--notebook-dir") or a.startswith("--ServerApp.root_dir")]
    assert "START_HERE.ipynb" in dr.context_files(REPO)


def test_the_cpu_dockerfile_installs_torch_first_then_the_project_then_checks_it():
    runs = by_keyword(dr.parse(CPU.read_text()), "RUN")
    torch_step = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r.text)
    project = next(i for i, r in enumerate(runs) if '-e ".[${EXTRAS}]"' in r.text)
    check = next(i for i, r in enumerate(runs) if "python -m labkit" in r.text)
    assert torch_step < project < check
    assert "${TORCH_INDEX_URL:+--index-url" in runs[torch_step].text   # empty ARG: no index flag
    assert all("--no-cache-dir" in r.text for r in runs if "pip install" in r.text)
    assert [r.skipped for r in runs] == ["useradd" in r.text for r in runs]


def test_every_instruction_of_the_cpu_dockerfile_sits_under_a_comment_saying_why():
    """After FROM, each instruction's block of lines (up to the blank line above) has a comment."""
    lines = CPU.read_text().splitlines()
    for ins in dr.parse(CPU.read_text())[1:]:
        block, k = [], ins.line - 2
        while k >= 0 and lines[k].strip():
            block.append(lines[k].strip())
            k -= 1
        assert any(b.startswith("#") for b in block), f"line {ins.line}: {ins.keyword} says not why"


def test_the_cuda_variant_parses_and_carries_the_run_line():
    assert dr.problems(CUDA) == []
    ins = dr.parse(CUDA.read_text())
    tag = ins[0].text.split("=", 1)[1]
    assert re.fullmatch(r"\d+\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime", tag)
    assert dr.substitute(by_keyword(ins, "FROM")[0].text, {"PYTORCH_TAG": tag}) == \
        f"pytorch/pytorch:{tag}"
    assert not any("TORCH_INDEX_URL" in r.text for r in by_keyword(ins, "RUN"))  # keeps its torch
    run_line = "docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864"
    assert run_line in " ".join(l.strip("# \\") for l in CUDA.read_text().splitlines())
    assert (REPO / "container" / "README.md").exists()


def test_the_context_leaves_out_environments_and_git_but_keeps_the_course():
    files = dr.context_files()
    assert {"Dockerfile", "pyproject.toml", "labkit/core/units.py", "README.md"} <= set(files)
    assert any(f.startswith("notebooks/") for f in files) and any(f.startswith("data/models/") for f in files)
    assert not [f for f in files if f.startswith((".venv/", ".git/")) or "__pycache__" in f]


# --- the CPU image's steps, run here ---------------------------------------------------------

@pytest.fixture
def scratch():
    """A temporary folder removed at the end: the replay's venv holds about 1 GB, more than
    pytest's kept tmp_path folders should pile up."""
    with tempfile.TemporaryDirectory(prefix="test_container-") as tmp:
        yield Path(tmp)


@pytest.mark.container
def test_the_cpu_dockerfiles_run_steps_succeed_here_in_order(scratch, record_property):
    """The RUN steps in order, in a fresh venv, with the torch index empty as
    `docker build --build-arg TORCH_INDEX_URL=` would set it (this machine's torch wheel is
    local); 2.5-4.5 minutes on 2 shared cores, nearly all of it pip."""
    build = dr.run(CPU, scratch, {"TORCH_INDEX_URL": ""})
    record_property("dockerfile_seconds", round(build.seconds, 1))
    failed = [s for s in build.steps if s.returncode]
    assert not failed, f"line {failed[0].line}: {failed[0].command}\n{failed[0].output_tail}"
    runs = [s for s in build.steps if s.keyword == "RUN"]
    assert [s.skipped for s in runs] == [False, False, False, True]      # useradd stays in images
    labs = build.root / "labs"
    assert (labs / "notebooks").is_dir() and build.workdir == "/labs" and build.user == "learner"
    assert (build.venv / "bin" / build.cmd[0]).exists()                   # CMD's jupyter installed
    assert (labs / build.cmd[-1]).is_file()                               # and the page it opens
    assert "deepseek-v2-lite" in runs[2].output_tail                      # `labkit presets` ran
