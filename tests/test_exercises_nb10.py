"""Notebook 10's exercises: every reference solution is right, every listed wrong answer gets its
hint, every starter reads "not attempted yet", also when the answer cell runs as a notebook runs it
(statement by statement, after its context cell), and the notebook has each exercise's cells.

``tests/test_exercises.py`` checks every notebook's bank in general; this file keeps notebook 10's
own promises, including that no wrong answer can hang (each check runs ranks under a timeout).
"""

import ast

import nbformat
import pytest

from course_utils.exercises import bank, run_source, verdict

EXERCISES = bank("10")
NOTEBOOK = "notebooks/10_debugging_distributed.ipynb"


def test_at_least_ten_exercises_of_every_kind():
    assert len(EXERCISES) >= 10
    assert {ex.kind for ex in EXERCISES} == {"predict", "fix", "implement"}
    assert [ex.key for ex in EXERCISES] == [f"10.{i}" for i in range(1, len(EXERCISES) + 1)]


@pytest.mark.parametrize("ex", EXERCISES, ids=[ex.key for ex in EXERCISES])
def test_solution_right_wrong_answers_hinted(ex):
    result = run_source(ex.key, ex.solution)
    assert result.right, result
    for source, fragment in ex.wrong:
        result = run_source(ex.key, source)
        assert result.status == "not yet" and fragment in result.hint, (source, result)


@pytest.mark.parametrize("ex", EXERCISES, ids=[ex.key for ex in EXERCISES])
def test_starter_reads_not_attempted_as_a_notebook_runs_it(ex):
    namespace = {"__name__": "__main__"}
    exec(compile(ex.context, "<context cell>", "exec"), namespace)  # noqa: S102
    for node in ast.parse(ex.starter).body:  # IPython compiles a cell statement by statement
        exec(compile(ast.Module([node], []), "<answer cell>", "exec"), namespace)  # noqa: S102
    assert verdict(ex.key, namespace[ex.answer]).status == "not attempted yet"


def test_notebook_has_every_exercise_in_order():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    tagged = [(i, t.split(":", 1)[1]) for i, c in enumerate(nb.cells)
              for t in c.metadata.get("tags", []) if t.startswith("answer:")]
    assert [key for _, key in tagged] == [ex.key for ex in EXERCISES]
    for (i, key), ex in zip(tagged, EXERCISES, strict=True):
        assert nb.cells[i].source == ex.starter.rstrip("\n")
        assert nb.cells[i + 1].source == f'check("{key}", {ex.answer})'
        assert nb.cells[i - 1].source.startswith(f"#### Exercise {key} · {ex.kind}")
        if ex.context.strip():  # the names the answer cell uses come in the cell before the question
            assert nb.cells[i - 2].source.endswith(ex.context.strip())
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[-1].source == 'progress("10")'
