"""The exercises: every reference solution passes its check, every listed wrong answer gets its
hint, an unanswered exercise reads "not attempted yet", each notebook carries its exercises' cells,
and the solutions edition is generated from the one place the solutions live."""

import re
import sys
import types
from pathlib import Path

import nbformat
import pytest

from course_utils.exercises import Exercise, bank, check, core, find, load_bank, progress, run_source, verdict
from course_utils.exercises import time_limit as limits
from course_utils.exercises.together import run_sources
from course_utils.tools.solutions import BANNER, answer_key, build

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {p.name[:2]: p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
ALL = bank("all")
IDS = [ex.key for ex in ALL]


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_the_reference_solution_is_right_and_far_from_its_limit(ex):
    """Right, and the check uses at most a quarter of the exercise's time limit, first call included
    (a slower machine, or one busy with other work, must not cut a right answer off)."""
    result = run_source(ex.key, ex.solution)
    assert result.status == "right", str(result)
    assert limits._LAST.used < ex.time_limit / 4, (limits._LAST.used, ex.time_limit)


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_the_starter_reads_not_attempted_and_fails_nothing(ex):
    result = run_source(ex.key, ex.starter)
    assert result.status == "not attempted yet", str(result)
    assert not result.right


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_every_also_right_answer_is_right(ex):
    """Judged together where the check runs a plan on ranks (one launch per world size), as each
    would be judged alone (make stress judges each alone too)."""
    for source, result in zip(ex.also_right, run_sources(ex.key, list(ex.also_right)), strict=True):
        assert result.status == "right", (source, str(result))


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_every_exercise_says_what_it_teaches_and_accepts_other_right_answers(ex):
    assert ex.teaches.strip(), ex.key
    assert ex.teaches.rstrip().endswith(".") and ex.teaches.count(". ") == 0, ex.teaches  # one sentence
    assert ex.also_right, f"{ex.key}: no also_right answers"
    assert all(src.strip() != ex.solution.strip() for src in ex.also_right)


@pytest.mark.parametrize("number", sorted({ex.notebook for ex in ALL}))
def test_each_notebook_has_three_exercises_of_two_kinds(number):
    exercises = bank(number)
    assert [ex.key for ex in exercises] == [f"{number}.{i}" for i in range(1, len(exercises) + 1)]
    if number == "00":  # the environment check asks one warm-up prediction
        assert [ex.kind for ex in exercises] == ["predict"]
        return
    assert len(exercises) >= 3, [ex.key for ex in exercises]
    assert len({ex.kind for ex in exercises}) >= 2, [ex.kind for ex in exercises]


def _cells(number):
    assert number in NOTEBOOKS, f"exercises for notebook {number}, which does not exist"
    return nbformat.read(NOTEBOOKS[number], as_version=4).cells


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_the_notebook_asks_answers_and_checks_in_three_cells(ex):
    cells = _cells(ex.notebook)
    where = [i for i, c in enumerate(cells) if answer_key(c) == ex.key]
    assert len(where) == 1, f"{ex.key}: expected one answer cell tagged answer:{ex.key}, found {len(where)}"
    i = where[0]
    assert cells[i].source == ex.starter.rstrip("\n"), f"{ex.key}: the answer cell is not the starter"
    assert cells[i - 1].cell_type == "markdown"
    assert cells[i - 1].source.startswith(f"#### Exercise {ex.key} · {ex.kind} · "), cells[i - 1].source[:80]
    assert cells[i + 1].cell_type == "code"
    assert f'check("{ex.key}", {ex.answer})' in cells[i + 1].source
    outputs = "".join(o.get("text", "") for o in cells[i + 1].get("outputs", []))
    assert f"Exercise {ex.key} ({ex.kind}): not attempted yet" in outputs, outputs


@pytest.mark.parametrize("number", sorted({ex.notebook for ex in ALL}))
def test_the_last_code_cell_shows_progress(number):
    code = [c for c in _cells(number) if c.cell_type == "code"]
    assert code[-1].source.strip().endswith(f'progress("{number}")')
    text = "".join(o.get("text", "") for o in code[-1].get("outputs", []))
    assert f"Exercises of notebook {number}: 0 of {len(bank(number))} right" in text


def test_check_prints_and_records_what_progress_shows(capsys):
    check("01.2", ...)
    check("01.1", find("01.1").judge)  # not a valid answer: a hint, never an exception
    progress("01")
    out = capsys.readouterr().out
    assert "· Exercise 01.2 (predict): not attempted yet." in out
    assert "✗ Exercise 01.1 (implement): not yet." in out
    assert re.search(r"01\.1\s+implement\s+not yet", out)
    assert re.search(r"01\.3\s+fix\s+not checked yet", out)
    assert "Exercises of notebook 01: 0 of 3 right" in out


def test_an_answer_that_raises_gets_a_hint_not_an_exception():
    def to_target(model, inputs, targets, target):
        raise KeyError("boom")

    result = verdict("01.3", to_target)
    assert result.status == "not yet" and "KeyError" in result.hint and "boom" in result.hint


@pytest.mark.parametrize("ex", [ex for ex in ALL if ex.kind != "predict"],
                         ids=[ex.key for ex in ALL if ex.kind != "predict"])
def test_a_fix_or_implement_answered_with_a_value_is_told_to_stay_a_function(ex):
    result = verdict(ex, 3)
    assert (result.status, result.hint) == ("not yet", f"{ex.answer} must stay a function, got int")


#: one exercise's entry in a bank file, for the loader's tests
_ENTRY = ('[[exercise]]\nkey = "{number}.1"\nkind = "predict"\ntitle = "t"\nanswer = "a"\n{teaches}'
          'judge = "{judge}"\nstarter = "a = ..."\nsolution = "a = 1"\n'
          '[[exercise.wrong]]\nsource = "a = 2"\nhint = "x"\n'
          '[[exercise.wrong]]\nsource = "a = 3"\nhint = "y"\n'
          '[[exercise.also_right]]\nsource = "a = 1.0"\n')


def _bank_module(tmp_path, monkeypatch, number):
    """A bank module nbNN (not a file: registered as imported), whose .toml the test writes."""
    module = types.ModuleType(f"course_utils.exercises.nb{number}")
    module.__file__ = str(tmp_path / f"nb{number}.py")
    module._judge_known = lambda answer: None
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module, tmp_path / f"nb{number}.toml"


def test_a_bank_file_that_names_a_missing_judge_is_refused(tmp_path, monkeypatch):
    module, toml = _bank_module(tmp_path, monkeypatch, "99")
    toml.write_text(_ENTRY.format(number="99", teaches='teaches = "Counting."\n', judge="_judge_known"))
    [ex] = load_bank(module.__name__)
    assert (ex.key, ex.judge, ex.wrong) == ("99.1", module._judge_known, (("a = 2", "x"), ("a = 3", "y")))
    assert (ex.teaches, ex.also_right, ex.time_limit) == ("Counting.", ("a = 1.0",), core.TIME_LIMIT_S)
    toml.write_text(_ENTRY.format(number="99", teaches='teaches = "Counting."\n', judge="_judge_typo"))
    with pytest.raises(ValueError, match="exercise 99.1 names judge '_judge_typo', which "
                                         "course_utils.exercises.nb99 does not define"):
        load_bank(module.__name__)


def test_a_bank_file_that_does_not_say_what_an_exercise_teaches_is_refused(tmp_path, monkeypatch):
    module, toml = _bank_module(tmp_path, monkeypatch, "98")
    toml.write_text(_ENTRY.format(number="98", teaches="", judge="_judge_known"))
    with pytest.raises(ValueError, match="exercise 98.1 does not say what it teaches"):
        load_bank(module.__name__)


def test_a_fix_left_as_shipped_is_not_attempted_even_with_new_comments():
    shipped = find("01.3").starter
    starter = shipped.replace("    model.to(target)\n", "    # looked at it\n    model.to(target)\n")
    assert starter != shipped
    assert run_source("01.3", starter).status == "not attempted yet"


def test_bad_exercise_definitions_are_refused():
    good = dict(key="01.9", kind="predict", title="t", answer="a", starter="a = ...",
                solution="a = 1", judge=lambda a: None, wrong=(("a = 2", "x"), ("a = 3", "y")))
    Exercise(**good)
    for change, message in [({"key": "1.9"}, "key must look like"),
                            ({"kind": "guess"}, "kind must be one of"),
                            ({"answer": "a b"}, "answer must be the name"),
                            ({"wrong": (("a = 2", "x"),)}, "at least two"),
                            ({"solution": "a = ..."}, "the solution is the starter"),
                            ({"time_limit": 0}, "time_limit must be seconds"),
                            ({"time_limit": True}, "time_limit must be seconds")]:
        with pytest.raises(ValueError, match=message):
            Exercise(**{**good, **change})
    with pytest.raises(TypeError, match="also_right must list answer-cell sources"):
        Exercise(**{**good, "also_right": (3,)})
    with pytest.raises(TypeError, match="teaches must be a str"):
        Exercise(**{**good, "teaches": None})


def test_the_solutions_edition_replaces_exactly_the_answer_cells(tmp_path):
    sources = [NOTEBOOKS[n] for n in sorted({ex.notebook for ex in ALL})]
    written = build(sources, tmp_path)
    assert [p.name for p in written] == [p.name for p in sources]
    for original, edition in zip(sources, written, strict=True):
        before = nbformat.read(original, as_version=4).cells
        after = nbformat.read(edition, as_version=4).cells
        assert len(before) == len(after)
        assert after[0].source == BANNER + before[0].source
        for old, new in zip(before[1:], after[1:], strict=True):
            key = answer_key(old)
            assert new.source == (find(key).solution.rstrip("\n") if key else old.source)
            assert not new.get("outputs")


def test_a_fix_starter_that_imports_and_calls_a_module_reads_not_attempted():
    """IPython compiles a cell statement by statement; so must the checks, or Python 3.11's
    compiler (LOAD_ATTR for a module imported in the same unit) makes an untouched starter
    look changed."""
    starter = "import torch\n\n\ndef make():\n    return torch.ones(2)\n"
    ex = Exercise(key="01.9", kind="fix", title="t", answer="make", starter=starter,
                  solution=starter.replace("ones", "zeros"), judge=lambda f: None,
                  wrong=(("def make():\n    return 1\n", "x"), ("def make():\n    return 2\n", "y")))
    import ast

    namespace: dict = {}
    for node in ast.parse(starter).body:  # as IPython runs the cell
        exec(compile(ast.Module([node], type_ignores=[]), "<cell>", "exec"), namespace)
    assert verdict(ex, namespace["make"]).status == "not attempted yet"


def test_every_notebook_has_exercises():
    numbers = sorted(NOTEBOOKS)
    assert numbers[0] == "00" and len(bank("00")) == 1  # the environment check: one warm-up
    for number in numbers[1:]:
        assert len(bank(number)) >= 3, f"notebook {number} needs at least three exercises"



def _imported_names(source: str) -> set[str]:
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:  # a cell with a magic or a shell line imports nothing the answer relies on
        return set()
    return {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}


@pytest.mark.parametrize("ex", ALL, ids=IDS)
def test_the_notebook_imports_what_the_check_gives_the_answer(ex):
    """A check runs the answer after the exercise's context (the imports its solution uses); in the
    notebook the answer runs after the notebook's own cells, which must import the same, or the
    solution the check accepts raises NameError there (07.3's did, in the solutions edition)."""
    nb = nbformat.read(NOTEBOOKS[ex.notebook], as_version=4)
    sources = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    check_cell = next(i for i, s in enumerate(sources) if f'check("{ex.key}"' in s)
    before = set().union(*(_imported_names(s) for s in sources[:check_cell]))
    assert _imported_names(ex.context) <= before, (ex.key, _imported_names(ex.context) - before)
