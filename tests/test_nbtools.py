import sys

import nbformat
import pytest

from course_utils import REPO
from course_utils.tools.nbtools import (
    SETUP_SOURCE,
    badge_markdown,
    clean_metadata,
    hygiene_problems,
    merge_streams,
    sync_header,
)


def make_notebook(path, *, outputs=True, counts=(1, 2), error=False, text="ok\n"):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(f"{badge_markdown(path.name)}\n\n# 99 · Test"),
        nbformat.v4.new_code_cell(SETUP_SOURCE, execution_count=counts[0]),
        nbformat.v4.new_code_cell("print('ok')", execution_count=counts[1]),
    ]
    if outputs:
        nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    if error:
        nb.cells[2].outputs.append(nbformat.v4.new_output("error", ename="ValueError",
                                                          evalue="boom", traceback=[]))
    nbformat.write(nb, path)
    return path


def test_badge_points_at_the_notebook_in_the_repo():
    badge = badge_markdown("00_environment_check.ipynb")
    assert f"github/{REPO}/blob/main/notebooks/00_environment_check.ipynb" in badge
    with pytest.raises(ValueError, match="notebook file name"):
        badge_markdown("notebooks/00.ipynb")


def test_clean_notebook_has_no_problems(tmp_path):
    assert hygiene_problems(make_notebook(tmp_path / "99_test.ipynb")) == []


@pytest.mark.parametrize("kwargs, expected", [
    ({"outputs": False}, "no stored outputs"),
    ({"counts": (1, 3)}, "not one clean run"),
    ({"error": True}, "stores an error"),
    ({"text": "saved to /home/someone/work/file.pt\n"}, "shows a path"),
    ({"text": "[ipykernel_1234]\n"}, "shows a path"),
])
def test_hygiene_catches_problems(tmp_path, kwargs, expected):
    problems = hygiene_problems(make_notebook(tmp_path / "99_test.ipynb", **kwargs))
    assert any(expected in p for p in problems), problems


def test_hygiene_allows_urls_and_catches_stale_headers(tmp_path):
    path = make_notebook(tmp_path / "99_test.ipynb", text="see https://pytorch.org/docs/a/b\n")
    assert hygiene_problems(path) == []
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source = "import sys"
    nb.cells[0].source = "# 99 · no badge"
    nbformat.write(nb, path)
    problems = hygiene_problems(path)
    assert any("Colab badge" in p for p in problems)
    assert any("set-up cell" in p for p in problems)
    assert sync_header(path) is True
    assert hygiene_problems(path) == []
    assert sync_header(path) is False


def test_clean_metadata_drops_widget_state_and_timings(tmp_path):
    path = make_notebook(tmp_path / "99_test.ipynb")
    nb = nbformat.read(path, as_version=4)
    nb.metadata["widgets"] = {"state": {}}
    nb.cells[2].metadata["execution"] = {"iopub.execute_input": "2026-01-01"}
    nb.cells[2].metadata["tags"] = ["raises-exception"]
    clean_metadata(nb)
    assert "widgets" not in nb.metadata
    assert nb.cells[2].metadata == {"tags": ["raises-exception"]}


def test_missing_notebook_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no notebook at"):
        hygiene_problems(tmp_path / "nope.ipynb")


@pytest.mark.parametrize("returncode", [0, 1])
def test_the_setup_cell_installs_in_colab_and_explains_a_failure(monkeypatch, capsys, returncode):
    """In Colab the set-up cell installs the helpers at the notebook's ref; a failed install ends
    in one sentence saying what to do, not a CalledProcessError traceback."""
    import subprocess
    import types

    from course_utils import BRANCH

    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, returncode, "", "ERROR: network is unreachable")

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(subprocess, "run", fake_run)
    exec(SETUP_SOURCE, {})
    assert calls and calls[0][-1] == f"git+https://github.com/{REPO}@{BRANCH}"
    out = capsys.readouterr().out
    if returncode:
        assert out.startswith("Could not install the course's helpers from git+https://github.com/")
        assert "(pip: ERROR: network is unreachable)" in out and out.count("\n") == 1
    else:
        assert out == ""


def test_merge_streams_keeps_what_a_front_end_shows(tmp_path):
    """A text bar's redraws become its last state; stdout and stderr, and other outputs, keep their order."""
    out = nbformat.v4.new_output
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("...")]
    nb.cells[0].outputs = [
        out("stream", name="stdout", text="\repochs:   0%|   | 0/2"),
        out("stream", name="stdout", text="\repochs:  50%|#  | 1/2"),
        out("stream", name="stdout", text="\repochs: 100%|## | 2/2\n"),
        out("stream", name="stdout", text="2 steps\r\n"),
        out("stream", name="stderr", text="a warning\n"),
        out("display_data", data={"text/plain": "<Figure>"}),
        out("stream", name="stdout", text="after the figure\n"),
    ]
    merge_streams(nb)
    assert [(o.output_type, o.get("name"), o.get("text")) for o in nb.cells[0].outputs] == [
        ("stream", "stdout", "epochs: 100%|## | 2/2\n2 steps\r\n"),
        ("stream", "stderr", "a warning\n"),
        ("display_data", None, None),
        ("stream", "stdout", "after the figure\n"),
    ]


def test_hygiene_catches_a_stored_widget(tmp_path):
    path = make_notebook(tmp_path / "99_test.ipynb")
    nb = nbformat.read(path, as_version=4)
    nb.cells[2].outputs.append(nbformat.v4.new_output("display_data", data={
        "text/plain": "HBox(children=(HTML(value='epochs'), FloatProgress(value=0.0, max=2.0)))",
        "application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2,
                                                     "version_minor": 0}}))
    nbformat.write(nb, path)
    assert hygiene_problems(path) == ["99_test.ipynb: code cell 1 stores a widget (run make execute)"]
