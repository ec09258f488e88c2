"""Auto-checked exercises, in the spirit of srush's LLM Training Puzzles: every answer is
computed by labkit, and ``check(id, answer)`` says at once whether yours is right.

    from labkit.course.exercises import check, solution
    check("01-adamw-bytes", 16)          # ✅ ... (a wrong answer shows a hint instead)
    solution("01-adamw-bytes")           # the worked solution, with labkit's numbers

A later lab adds its own with ``@register("05-...", question=..., unit=..., hint=...,
solution=...)`` on a function that returns ``{"answer": value, ...}``; the other names it
returns fill the ``{placeholders}`` of the solution text.
"""
from labkit.course.exercises.core import (Exercise, Result, check, exercises, get, question,
                                          register, solution)
# each lab's module registers its exercises when imported, in the labs' order
from labkit.course.exercises import (lab01, lab02, lab03, lab04, lab05, lab06, lab07,  # noqa: F401
                                     lab08, lab09)

__all__ = ["Exercise", "Result", "check", "exercises", "get", "question", "register", "solution"]
