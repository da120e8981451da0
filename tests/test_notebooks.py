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


#: A float printed to 6 or more decimals (1.2858909368515015): its last digits are rounding, which
#: differs between CPUs' kernels, so nbval would fail on another machine.
_UNROUNDED = re.compile(r"(?<![\w.])-?\d+\.\d{6,}(?![\d])")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_stored_output_prints_rounding_digits(path):
    """What nbval compares must be what every correct CPU prints: a bound, a count, a rounded figure.
    Cells whose output is ignored (hardware reports) are exempt."""
    nb = nbformat.read(path, as_version=4)
    found = []
    for index, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        if "NBVAL_IGNORE_OUTPUT" in cell.source:
            continue
        for out in cell.get("outputs", []):
            text = out.get("text", "") + out.get("data", {}).get("text/plain", "")
            found += [f"cell {index}: {m.group()}" for m in _UNROUNDED.finditer(text)]
    assert found == []


def test_ci_checks_the_notebooks_with_another_cpus_kernels():
    """CI validates the notebooks a second time with PyTorch's portable kernels (in make stress, with
    fresh-interpreter ranks), so an output that only one CPU's kernels print cannot land;
    make nbval-portable runs that pass alone."""
    import test_fresh_starts
    from test_pins import ci_commands

    assert test_fresh_starts.PORTABLE_KERNELS == {"ATEN_CPU_CAPABILITY": "default"}
    # make stress whole, or tests/test_fresh_starts.py in a run of its own (STRESS_TESTS) beside the rest
    stress = [c for c in ci_commands() if c.startswith("make stress")]
    alone = [c for c in stress if "STRESS_TESTS=tests/test_fresh_starts.py" in c]
    assert "make stress" in stress or alone, stress
    assert not any("--ignore=tests/test_fresh_starts.py" in c for c in stress) or alone, stress
    makefile = (ROOT / "Makefile").read_text()
    target = re.search(r"^nbval-portable:.*\n\t(.+)$", makefile, re.MULTILINE)
    assert target and "ATEN_CPU_CAPABILITY=default" in target.group(1) and "notebooks" in target.group(1)


def _sanitized(text: str) -> str:
    """``text`` after the sanitizer's rules, read and applied as nbval reads and applies them."""
    from nbval.plugin import get_sanitize_patterns

    rules = get_sanitize_patterns(Path(__file__).with_name("nbval_sanitize.cfg").read_text(encoding="utf-8"))
    assert len(rules) >= 6, rules  # every section was read
    for regex, replace in rules:
        text = re.sub(regex, replace, text)
    return text


def test_the_sanitizer_masks_what_varies_and_nothing_a_lesson_is_about():
    # a progress bar's last line carries tqdm's padding when its rate came out shorter than the
    # rate before it (seen on a clean clone: one trailing space more than the stored output)
    padded = "epochs: 100%|##########| 15/15 [00:01<00:00, 9.87it/s]   \n240 steps; last loss 0.0028\n"
    plain = "epochs: 100%|##########| 15/15 [00:00<00:00, 12.34it/s]\n240 steps; last loss 0.0028\n"
    assert _sanitized(padded) == _sanitized(plain)
    assert "last loss 0.0028" in _sanitized(plain)  # the lesson's value stays compared
    assert _sanitized("step took 12.5 ms") == _sanitized("step took 3 ms") == "step took <DURATION>"
    assert _sanitized("3 of 4 ranks agree") == "3 of 4 ranks agree"


def test_the_scopes_handed_out_first_and_last_exist():
    """tests/conftest.py orders the scopes by path: a path that names nothing orders nothing."""
    from conftest import LAST, LONGEST_FIRST

    assert len(set(LONGEST_FIRST + LAST)) == len(LONGEST_FIRST + LAST)
    assert [path for path in LONGEST_FIRST + LAST if not (ROOT / path).is_file()] == []
