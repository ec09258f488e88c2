"""The README's code runs as written: its Python snippet saved as a script, and each of its
command lines pasted into a shell."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def fenced(after: str, language: str) -> str:
    """The first ```language block after the heading or sentence ``after``."""
    rest = README[README.index(after):]
    return re.search(rf"```{language}\n(.*?)```", rest, re.S).group(1)


def run_as_script(after: str, folder: Path) -> str:
    """The ```python block after ``after``, saved alone in ``folder`` and run: its stdout."""
    script = folder / "snippet.py"
    script.write_text(fenced(after, "python"))
    out = subprocess.run([sys.executable, str(script)], cwd=folder, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def command_lines() -> list[str]:
    """The command lines under "or from the command line:", their comments dropped."""
    block = fenced("or from the command line:", "bash")
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_command_lines_are_written_to_be_pasted():
    lines = command_lines()
    assert lines and all(line.startswith("python -m labkit ") for line in lines)
    assert not [line for line in lines if re.search(r"\[--|<\w+>", line)], "placeholders"


@pytest.mark.slow
def test_the_own_scripts_snippet_runs_as_a_script(tmp_path):
    pytest.importorskip("transformers")
    assert "15706484224" in run_as_script("## labkit from your own scripts", tmp_path)  # exact


@pytest.mark.slow
@pytest.mark.parametrize("line", [l for l in command_lines() if "--course" not in l])
def test_each_command_line_runs(line):
    """(doctor --course is run by tests/test_doctor.py; it takes a smoke run)"""
    out = subprocess.run([sys.executable, *shlex.split(line)[1:]], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()


@pytest.mark.slow
def test_the_allocator_snippet_runs_as_a_script(tmp_path):
    """Saved alone (its own imports), it replays a fake LLaMA-2-7B step and writes the snapshot."""
    run_as_script("A step's storages replayed", tmp_path)
    assert (tmp_path / "step.pickle").stat().st_size > 0


@pytest.mark.slow
def test_the_own_module_snippet_runs_its_own_function_on_two_ranks(tmp_path):
    """A script's own training function, its model not labkit's, under labkit's FSDP on 2 ranks."""
    out = run_as_script("labkit's mechanisms on your own", tmp_path)
    assert out.count("holds 1064 of 2128 parameters") == 2
    assert "saves ['0.weight', '0.bias', '2.weight', '2.bias']" in out
