"""The exercise format: an :class:`Exercise`, its judge, and the checks a notebook calls."""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..env import random_state_kept
from .answer_cells import _execute, _unattempted
from .evidence import calls_recorded, changed, snapshot
from .time_limit import _Stopped, _within_limit, untimed

__all__ = ["KINDS", "TIME_LIMIT_S", "Exercise", "Verdict", "answer_defined", "bank", "calls_recorded",
           "changed", "check", "find", "load_bank", "progress", "reference", "run_source", "snapshot",
           "untimed", "verdict"]

#: predict: write a number or shape down before running; fix: repair a cell broken on purpose;
#: implement: write a small piece of the lesson.
KINDS = ("predict", "fix", "implement")

_KEY = re.compile(r"^(\d\d)\.(\d+)$")

_TODO = {
    "predict": "Replace the ... in the answer cell with your prediction, run it, then run this check",
    "fix": "Repair the code in the answer cell (it is still as shipped), run it, then run this check",
    "implement": "Write the body in the answer cell (it still raises NotImplementedError), "
                 "run it, then run this check",
}

#: What ``check`` found, by exercise key, in this Python session (``progress`` reads it).
_RESULTS: dict[str, Verdict] = {}

#: How long, by default, a check lets the learner's code run (seconds). Time on ranks (which have
#: the launch timeout) and what a judge computes from the course alone (``untimed``) do not count.
TIME_LIMIT_S = 5.0

@dataclass(frozen=True)
class Exercise:
    """One exercise: the answer cell as shipped, its reference solution, and how it is judged.

    ``judge(answer)`` returns None when the answer is right, else a hint aimed at the mistake
    (never the solution, nor the value or formula asked for). ``teaches`` says in one sentence
    what the exercise practises. ``wrong`` lists answer-cell sources that learners commonly
    write, each with a fragment of the hint it must get; ``also_right`` lists right answers that
    differ from the solution. ``context`` is the code that the answer cell relies on from the
    notebook (imports, names); the tests run it before each answer source. ``time_limit`` is how
    many seconds the check lets the answer run before it stops it (see :func:`untimed`).
    """

    key: str
    kind: str
    title: str
    answer: str
    starter: str
    solution: str
    judge: Callable[[Any], str | None]
    wrong: tuple[tuple[str, str], ...] = ()
    context: str = ""
    teaches: str = ""
    also_right: tuple[str, ...] = ()
    time_limit: float = TIME_LIMIT_S
    notebook: str = field(init=False)

    def __post_init__(self) -> None:
        match = _KEY.match(self.key) if isinstance(self.key, str) else None
        if not match:
            raise ValueError(f"key must look like '05.2' (notebook . number), got {self.key!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not (isinstance(self.answer, str) and self.answer.isidentifier()):
            raise ValueError(f"answer must be the name the answer cell defines, got {self.answer!r}")
        if not callable(self.judge):
            raise TypeError(f"judge must be callable, got {type(self.judge).__name__}")
        for name in ("title", "starter", "solution", "context", "teaches"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        also_right = tuple(self.also_right)
        if not all(isinstance(src, str) for src in also_right):
            raise TypeError(f"exercise {self.key}: also_right must list answer-cell sources (str), "
                            f"got {self.also_right!r}")
        object.__setattr__(self, "also_right", also_right)
        limit = self.time_limit
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit <= 600:
            raise ValueError(f"exercise {self.key}: time_limit must be seconds, more than 0 and at most "
                             f"600, got {limit!r}")
        if self.starter.strip() == self.solution.strip():
            raise ValueError(f"exercise {self.key}: the solution is the starter")
        wrong = tuple(tuple(w) for w in self.wrong)
        if len(wrong) < 2 or any(len(w) != 2 or not all(isinstance(s, str) for s in w) for w in wrong):
            raise ValueError(f"exercise {self.key}: wrong must list at least two (source, hint fragment) "
                             f"pairs, got {self.wrong!r}")
        object.__setattr__(self, "wrong", wrong)
        object.__setattr__(self, "notebook", match.group(1))


@dataclass(frozen=True)
class Verdict:
    """What a check found: ``status`` is ``"right"``, ``"not yet"`` or ``"not attempted yet"``."""

    key: str
    kind: str
    status: str
    hint: str = ""

    @property
    def right(self) -> bool:
        return self.status == "right"

    def __str__(self) -> str:
        mark = {"right": "✓", "not yet": "✗"}.get(self.status, "·")
        text = f"{mark} Exercise {self.key} ({self.kind}): {self.status}"
        return f"{text}. {self.hint}" if self.hint else f"{text}."


def not_a_pair(answer: Any, what: str, whole: bool = True) -> str | None:
    """For the judges of predictions answered with two numbers: the hint when ``answer`` is not a
    pair (of whole numbers, unless ``whole`` is False; ``what`` says what the two are), else ``None``."""
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
        return f"write a pair: {what}"
    if whole and any(isinstance(v, bool) or not isinstance(v, int) for v in answer):
        return f"write both as whole numbers: {what}"
    return None


_REFERENCES: dict[str, Any] = {}


def reference(key: str) -> Any:
    """What the reference solution of exercise ``key`` defines (its function): the judges run it
    beside the answer on the same cases and compare."""
    if key not in _REFERENCES:
        ex = find(key)
        _REFERENCES[key] = _execute(ex, ex.solution, "solution")[ex.answer]
    return _REFERENCES[key]


def _notebook_id(notebook: Any) -> str:
    text = str(notebook) if isinstance(notebook, (int, str)) and not isinstance(notebook, bool) else ""
    match = re.match(r"^(\d{1,2})(?:_\w+(?:\.ipynb)?)?$", text)
    if not match:
        raise ValueError(f"notebook must be a number such as '05' or 5 (or a name '05_...'), "
                         f"got {notebook!r}")
    return f"{int(match.group(1)):02d}"


def _banks() -> list[str]:
    import course_utils.exercises as package

    return sorted(m.name[2:] for m in pkgutil.iter_modules(package.__path__) if re.match(r"nb\d\d$", m.name))


def bank(notebook: Any) -> list[Exercise]:
    """The exercises of one notebook, in order (``bank("05")``); ``bank("all")`` gives every one."""
    if notebook == "all":
        return [ex for nb in _banks() for ex in bank(nb)]
    number = _notebook_id(notebook)
    if number not in _banks():
        raise ValueError(f"notebook {number} has no exercises; these do: {_banks()}")
    exercises = importlib.import_module(f"course_utils.exercises.nb{number}").EXERCISES
    for ex in exercises:
        if ex.notebook != number:
            raise ValueError(f"exercise {ex.key} is listed in the bank of notebook {number}")
    return list(exercises)


def load_bank(module_name: str) -> list[Exercise]:
    """The exercises of bank module ``module_name`` (``course_utils.exercises.nb05``), in order.

    Their content (answer cell as shipped, solution, wrong answers with their hint fragments) is
    data, in ``nb05.toml`` beside the module; each entry names its judge, a function of the module.
    """
    import tomllib
    from pathlib import Path

    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    if module is None or not getattr(module, "__file__", None):
        raise ValueError(f"module_name must name an imported bank module (call load_bank(__name__) at "
                         f"the end of one), got {module_name!r}")
    path = Path(module.__file__).with_suffix(".toml")
    if not path.is_file():
        raise ValueError(f"{module_name} has no exercise file {path.name} beside it")
    exercises = []
    for entry in tomllib.loads(path.read_text(encoding="utf-8"))["exercise"]:
        entry = dict(entry)
        judge = getattr(module, entry["judge"], None)
        if judge is None:
            raise ValueError(f"{path.name}: exercise {entry.get('key')} names judge {entry['judge']!r}, "
                             f"which {module_name} does not define")
        entry["judge"] = judge
        entry["wrong"] = tuple((w["source"], w["hint"]) for w in entry.get("wrong", ()))
        entry["also_right"] = tuple(a["source"] for a in entry.get("also_right", ()))
        teaches = entry.get("teaches")
        if not (isinstance(teaches, str) and teaches.strip()):
            raise ValueError(f"{path.name}: exercise {entry.get('key')} does not say what it teaches: "
                             f"give it a one-sentence `teaches`")
        exercises.append(Exercise(**entry))
    return exercises


def find(key: str) -> Exercise:
    """The exercise with this key (``"05.2"``)."""
    match = _KEY.match(key) if isinstance(key, str) else None
    if not match:
        raise ValueError(f"key must look like '05.2' (notebook . number), got {key!r}")
    for ex in bank(match.group(1)):
        if ex.key == key:
            return ex
    raise ValueError(f"notebook {match.group(1)} has no exercise {key}; "
                     f"it has {[ex.key for ex in bank(match.group(1))]}")


def _timeout_hint(ex: Exercise) -> str:
    where = "working out your answer's value" if ex.kind == "predict" else f"running {ex.answer}"
    return (f"the check stopped {where} after {ex.time_limit:g} s, unfinished: look for a loop that "
            f"never ends (a condition that never changes), or far more work than the check needs")


def verdict(key: str | Exercise, answer: Any) -> Verdict:
    """Judge ``answer`` to exercise ``key`` (or to an :class:`Exercise`) without printing; never
    raises for a wrong answer, and comes back within the exercise's ``time_limit``."""
    ex = key if isinstance(key, Exercise) else find(key)
    if _unattempted(ex, answer):
        return Verdict(ex.key, ex.kind, "not attempted yet", _TODO[ex.kind])
    if ex.kind != "predict" and not callable(answer):  # every fix and implement defines a function
        return Verdict(ex.key, ex.kind, "not yet",
                       f"{ex.answer} must stay a function, got {type(answer).__name__}")
    try:
        with random_state_kept():  # a judge seeds what it draws: the learner's generators stay as they were
            hint = _within_limit(ex.time_limit, ex.judge, answer)
    except NotImplementedError:
        return Verdict(ex.key, ex.kind, "not attempted yet", _TODO[ex.kind])
    except _Stopped:
        hint = _timeout_hint(ex)
    except Exception as err:  # the learner's code failed inside the check: say how, do not raise
        detail = str(err).strip().splitlines()
        hint = f"running your answer raised {type(err).__name__}" + (f": {detail[0]}" if detail else "")
    if hint is not None and not isinstance(hint, str):
        raise TypeError(f"the judge of {ex.key} must return None or a hint str, got {type(hint).__name__}")
    return Verdict(ex.key, ex.kind, "right" if hint is None else "not yet", hint or "")


#: ``check`` wraps its message at word boundaries to this width: a JupyterLab output in a laptop's
#: window shows about 90 columns and would otherwise break a long hint inside a word.
_MESSAGE_WIDTH = 88


def _wrapped(message: str, width: int = _MESSAGE_WIDTH) -> str:
    """``message`` wrapped at spaces, never inside a word, code or path; later lines indented by 2.

    The first line keeps the form ``"✓ Exercise NN.N (kind): status."`` that ``make compat`` reads.
    """
    import textwrap

    return "\n".join(textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False,
                                    break_on_hyphens=False) for line in message.splitlines())


def check(key: str, answer: Any = Ellipsis) -> None:
    """Print whether ``answer`` to exercise ``key`` is right, with a hint when it is not."""
    result = verdict(key, answer)
    _RESULTS[result.key] = result
    print(_wrapped(str(result)))


def progress(notebook: Any) -> None:
    """Print which of a notebook's exercises pass, as checked in this session."""
    exercises = bank(notebook)
    results = [_RESULTS.get(ex.key) for ex in exercises]
    right = sum(1 for r in results if r is not None and r.right)
    print(f"Exercises of notebook {_notebook_id(notebook)}: {right} of {len(exercises)} right")
    for ex, result in zip(exercises, results, strict=True):
        status = result.status if result is not None else "not checked yet (run its check cell)"
        print(f"  {ex.key:<6} {ex.kind:<10} {status:<18} {ex.title}")


def run_source(key: str, src: str) -> Verdict:
    """Run an answer cell's source (after the exercise's context) and judge what it defines.

    The tests use it to prove every reference solution right and every listed wrong answer
    flagged with its hint; the solutions edition relies on it.
    """
    return verdict(key, answer_defined(find(key), src))


def answer_defined(ex: Exercise, src: str) -> Any:
    """What an answer cell's source ``src`` defines as the answer of ``ex``, run after its context."""
    if not isinstance(src, str):
        raise TypeError(f"src must be an answer cell's source (str), got {type(src).__name__}")
    namespace = _execute(ex, src, "answer")
    if ex.answer not in namespace:
        raise ValueError(f"this source does not define {ex.answer!r}, the answer of exercise {ex.key}")
    return namespace[ex.answer]


