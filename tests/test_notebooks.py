"""Every notebook is collected by nbval, stored cleanly, and listed in the README."""

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_utils.tools.nbtools import badge_markdown, hygiene_problems

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks_and_they_are_numbered():
    names = [p.name for p in NOTEBOOKS]
    assert names, "no notebooks found"
    for name in names:
        assert re.match(r"^\d\d_[a-z0-9_]+\.ipynb$", name), f"{name} is not NN_topic.ipynb"
    numbers = [int(n[:2]) for n in names]
    assert numbers[0] == 0 and len(set(numbers)) == len(numbers), names


def collected_cells(request) -> list[str]:
    """The notebook cells this pytest run collected (`make test` collects every notebook beside this
    test), or, in a run that did not collect each notebook (``pytest tests``, ``-k``), a fresh
    collection of notebooks/ in a subprocess."""
    ids = [item.nodeid for item in request.session.items if item.nodeid.startswith("notebooks/")]
    if {i.split("::")[0] for i in ids} == {f"notebooks/{p.name}" for p in NOTEBOOKS} and not (
            request.config.option.keyword):
        return ids
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "notebooks"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return [line.strip() for line in out.stdout.splitlines()]


def test_nbval_collects_every_code_cell_of_every_notebook(request):
    """`make test` runs plain `pytest`; nbval must pick up every notebook in notebooks/."""
    collected: dict[str, int] = {}
    for line in collected_cells(request):
        match = re.match(r"^notebooks/([^:]+\.ipynb)::Cell \d+$", line)
        if match:
            collected[match.group(1)] = collected.get(match.group(1), 0) + 1
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code_cells = sum(1 for c in nb.cells if c.cell_type == "code")
        assert collected.get(path.name) == code_cells, (path.name, collected)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_hygiene(path):
    assert hygiene_problems(path) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_readme_lists_the_notebook_with_its_badge(path):
    readme = (ROOT / "README.md").read_text()
    assert f"notebooks/{path.name}" in readme
    assert badge_markdown(path.name).split("](")[1].rstrip(")") in readme


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_opens_with_title_learning_goals_and_hardware(path):
    title = nbformat.read(path, as_version=4).cells[0].source
    assert re.search(r"^# \d\d · ", title, re.M), "the first cell starts with the numbered title"
    assert "**What you will learn**" in title
    assert "**Hardware:**" in title
