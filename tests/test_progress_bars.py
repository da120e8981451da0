"""The course's progress bars: tqdm's widget in a front end that draws widgets, text elsewhere."""

import sys
import types

import nbformat
import pytest

from course_utils import progress_bars
from course_utils.progress_bars import PROGRESS_VARIABLE, bar_kind, tqdm
from course_utils.tools.nbtools import merge_streams, run_in_memory


@pytest.fixture
def kernel(monkeypatch):
    """A stand-in for an IPython kernel whose front end lets it ask for input (or not)."""
    monkeypatch.delenv(PROGRESS_VARIABLE, raising=False)
    kernel = types.SimpleNamespace(_allow_stdin=True)
    fake = types.SimpleNamespace(get_ipython=lambda: types.SimpleNamespace(kernel=kernel))
    monkeypatch.setitem(sys.modules, "IPython", fake)
    return kernel


def test_plain_python_gets_tqdms_text_bar_on_stderr(monkeypatch, capsys):
    monkeypatch.delenv(PROGRESS_VARIABLE, raising=False)
    monkeypatch.setattr(progress_bars, "_kernel", lambda: None)
    assert bar_kind() == "text"
    assert list(tqdm(range(3), desc="steps")) == [0, 1, 2]
    captured = capsys.readouterr()
    assert captured.out == "" and "steps: 100%" in captured.err


def test_a_front_end_that_can_ask_for_input_gets_the_widget(kernel):
    assert bar_kind() == "widget"
    kernel._allow_stdin = False  # nbval, make execute, nbconvert
    assert bar_kind() == "text-stdout"


def test_the_environment_variable_wins(kernel, monkeypatch):
    monkeypatch.setenv(PROGRESS_VARIABLE, "text")
    assert bar_kind() == "text-stdout"
    monkeypatch.setenv(PROGRESS_VARIABLE, "Widget")
    assert bar_kind() == "widget"
    monkeypatch.setenv(PROGRESS_VARIABLE, "fancy")
    with pytest.raises(ValueError, match="COURSE_PROGRESS must be 'widget', 'text' or unset, got 'fancy'"):
        bar_kind()


def test_a_notebook_run_in_batch_stores_the_text_bar_on_stdout(tmp_path):
    """What make execute stores and nbval compares: no stderr, no widget, the bar's last state."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from course_utils.progress_bars import bar_kind, tqdm\n"
        "print(bar_kind())\n"
        "for _ in tqdm(range(4), desc='epochs', mininterval=0, miniters=1):\n"
        "    pass\n"
        "print('done')")]
    error, _ = run_in_memory(nb, tmp_path, 120)
    assert error == ""
    merge_streams(nb)
    outputs = nb.cells[0].outputs
    assert [(o.output_type, o.name) for o in outputs] == [("stream", "stdout")]
    lines = outputs[0].text.splitlines()
    assert lines[0] == "text-stdout" and lines[2] == "done"
    assert lines[1].startswith("epochs: 100%|██████████| 4/4 [") and "\r" not in lines[1]
