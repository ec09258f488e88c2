"""The exercises' registry and checker: ``register`` adds one, ``check`` answers it."""
from __future__ import annotations

import functools
import html
import math
import numbers
from dataclasses import dataclass
from typing import Callable


GiB = 2**30
BILLION = 10**9


@dataclass(frozen=True)
class Exercise:
    """One question; ``compute`` returns the answer (and the numbers its solution quotes), computed
    once per process: the check and the solution quote the same numbers (some take seconds)."""

    id: str
    question: str
    unit: str
    hint: str
    solution: str
    compute: Callable[[], dict]
    rtol: float = 0.01

    def answer(self) -> float:
        return self.compute()["answer"]


_REGISTRY: dict[str, Exercise] = {}


def register(id: str, *, question: str, unit: str, hint: str, solution: str, rtol: float = 0.01):
    """Decorator: add the exercise ``id`` whose decorated function computes the answer."""
    def add(compute: Callable[[], dict]) -> Callable[[], dict]:
        if id in _REGISTRY:
            raise ValueError(f"exercise {id!r} is already registered")
        _REGISTRY[id] = Exercise(id, question.strip(), unit, hint.strip(), solution.strip(),
                                 functools.cache(compute), rtol)
        return compute
    return add


def exercises(prefix: str = "") -> list[str]:
    """The exercise ids, in order; ``prefix="01"`` keeps one lab's."""
    return [i for i in _REGISTRY if i.startswith(prefix)]


def get(id: str) -> Exercise:
    """The exercise ``id``; an unknown id raises ValueError naming the known ones."""
    if id not in _REGISTRY:
        raise ValueError(f"unknown exercise {id!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[id]


def question(id: str) -> str:
    """The question, with the unit its answer is expected in."""
    return f"{get(id).question}\n(answer in {get(id).unit})"


def solution(id: str) -> str:
    """The worked solution, with the numbers labkit computes."""
    ex = get(id)
    return ex.solution.format(**ex.compute())


# ---- checking -------------------------------------------------------------------------------
@dataclass
class Result:
    """The verdict on one answer; the last expression of a cell shows it as one clear line."""

    correct: bool
    message: str
    hint: str = ""

    def __bool__(self):
        return self.correct

    def __repr__(self):
        return self.message + (f"\nHint: {self.hint}" if self.hint else "")

    def _repr_html_(self):
        hint = f"<br><i>Hint:</i> {html.escape(self.hint)}" if self.hint else ""
        message = html.escape(self.message).replace("\n", "<br>")
        return f"<p><b>{message}</b>{hint}</p>"


def _as_number(answer) -> float | None:
    """A finite float from an int, float, numpy/torch scalar or numeric string; else None."""
    if isinstance(answer, str):
        try:
            answer = float(answer.replace(",", "").replace("_", ""))
        except ValueError:
            return None
    elif not isinstance(answer, numbers.Real) and hasattr(answer, "item"):
        try:
            answer = answer.item()             # a one-element numpy array or torch tensor
        except (ValueError, RuntimeError):
            return None
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
        return None
    return float(answer) if math.isfinite(answer) else None


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:.6g}"


def check(id: str, answer) -> Result:
    """Is ``answer`` within the exercise's relative tolerance of labkit's value?"""
    ex = get(id)
    if answer is None:                         # the notebook's placeholder, not yet answered
        return Result(False, f"✏️ {id}: replace None with your answer.\n{question(id)}")
    given = _as_number(answer)
    if given is None:
        return Result(False, f"❌ {id}: expected one number (in {ex.unit}), got {answer!r} "
                             f"of type {type(answer).__name__}. Give just the number, e.g. 12.5.")
    expected = ex.answer()
    if abs(given - expected) <= ex.rtol * abs(expected) + 1e-12:
        return Result(True, f"✅ {id}: {_fmt(given)} {ex.unit} is right.")
    off = "too high" if given > expected else "too low"
    if expected and abs(given / expected - GiB / BILLION) < 0.01 * GiB / BILLION:
        off += "; it looks like GB (10^9 bytes): GiB is 2^30 bytes"
    return Result(False, f"❌ {id}: {_fmt(given)} {ex.unit} is {off}.", ex.hint)
