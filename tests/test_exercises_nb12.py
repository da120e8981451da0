"""Notebook 12's own promises about its exercises: at least ten, of every kind, in the notebook's
order, each answer cell after the cell that holds its context.

``tests/test_exercises.py`` proves for every notebook's bank (this one included) that each
solution is right, each listed wrong answer gets its hint (a wrong answer that hangs comes back
as a hint: the checks run ranks under a timeout) and each starter reads "not attempted yet" when
run as a notebook runs it.
"""

import nbformat

from course_utils.exercises import bank

EXERCISES = bank("12")
NOTEBOOK = "notebooks/12_debugging_distributed.ipynb"


def test_at_least_ten_exercises_of_every_kind():
    assert len(EXERCISES) >= 10
    assert {ex.kind for ex in EXERCISES} == {"predict", "fix", "implement"}
    assert [ex.key for ex in EXERCISES] == [f"12.{i}" for i in range(1, len(EXERCISES) + 1)]


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
    assert code[-1].source == 'progress("12")'
