"""`show` prints the course's code in notebooks; every region a notebook shows exists."""

import ast
import re
from pathlib import Path

import nbformat
import pytest

from course_utils import show

ROOT = Path(__file__).resolve().parents[1]


def _marked(x):
    y = x + 1
    # region: middle
    z = y * 2
    if z:
        z += 1
    # endregion
    return z


def test_source_of_a_region_is_its_lines_dedented_without_markers():
    assert show.regions(_marked) == ["middle"]
    assert show.source(_marked, "middle") == "z = y * 2\nif z:\n    z += 1"


def test_source_of_the_whole_function_drops_the_markers():
    text = show.source(_marked)
    assert "# region" not in text and "# endregion" not in text
    assert text.startswith("def _marked(x):") and "return z" in text


def test_show_prints_where_the_code_lives(capsys):
    show.show(_marked, "middle")
    out = capsys.readouterr().out
    assert out.startswith("# tests.test_show._marked  (region 'middle')\n") or \
        out.startswith("# test_show._marked  (region 'middle')\n"), out
    assert "z = y * 2" in out


def test_an_unclosed_region_is_refused():
    def broken():
        # region: open
        return 1

    with pytest.raises(ValueError, match="region 'open' is not closed"):
        show.source(broken, "open")


def _show_calls():
    """Every show(...) call in the notebooks, with the course_utils imports of its notebook."""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        imports, calls = [], []
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            lines = cell.source.splitlines()
            tree = ast.parse("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!"))))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_utils"):
                    imports.append(ast.unparse(node))
                elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "show":
                    calls.append(ast.unparse(node))
        for call in calls:
            yield path.name, "\n".join(imports), call


CALLS = list(_show_calls())


def test_notebooks_show_code_with_show_not_by_slicing_text():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert not re.search(r"getsource\(|\.index\([\"']|\.split\([\"']\s+def ", cell.source), \
                    f"{path.name} slices source text: {cell.source[:120]}"


#: An argument check: a raise of the errors bad arguments get, or a _checks helper.
ARGUMENT_CHECK = re.compile(r"raise (ValueError|TypeError|FileNotFoundError)\b|\bcheck_\w+\(")
#: Another notebook's plumbing: notebook 04's memory notes.
PLUMBING = ("note_memory", "record_memory", "recording(")


def test_notebook_03_shows_the_four_primitives():
    shown = {call for notebook, _, call in CALLS if notebook.startswith("03_")}
    assert {"show(scatter)", "show(replicate)", "show(parallel_apply)", "show(gather)"} <= shown, shown


@pytest.mark.parametrize(("notebook", "imports", "call"), CALLS, ids=[f"{n}:{c}" for n, _, c in CALLS])
def test_what_a_notebook_shows_is_rendered_and_reads_like_the_lesson(notebook, imports, call, capsys):
    namespace: dict = {}
    exec(imports, namespace)  # the notebook's own imports from course_utils
    namespace["show"] = show.source
    text = eval(call, namespace)  # show(...) -> source(...): raises if the object or region is gone
    namespace["show"] = show.show
    eval(call, namespace)
    header, _, printed = capsys.readouterr().out.partition("\n")
    assert header.startswith("# course_utils.") and printed.rstrip("\n") == text  # what show() prints
    assert len(text.splitlines()) >= 2, text
    checks = [line for line in text.splitlines() if ARGUMENT_CHECK.search(line)]
    assert checks == [], f"{notebook} shows argument checks: {checks}"
    assert [p for p in PLUMBING if p in text] == [], f"{notebook} shows another notebook's plumbing"
