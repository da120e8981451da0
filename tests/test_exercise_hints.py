"""No hint gives the answer away: not the value a prediction asks for (in any notation: 24,576,
3/4, 75%, a list written out), not a formula the reference solution works it out with (names and
symbols alike: 2Ψ + (2 + 12)Ψ/N matches 2 * parameters + (2 + 12) * parameters / gpus), not the
code a fix or an implementation adds.

The hints looked at are those of every listed wrong answer, of the starter, and of probes: for a
prediction, values near the right one (off by one, doubled, halved, in other units, one element
changed); for a function, one that returns nothing. Every bank is checked, those of notebooks 10
and 12 too. A rule stated in words ("add three terms: ...") is beyond this test: reviewing the
hints is still needed.
"""

import ast
import functools
import math
import re

import pytest

from course_utils.exercises import bank, find, run_source, verdict
from course_utils.exercises.core import answer_defined
from course_utils.exercises.together import judged_by_plan, verdicts

ALL = bank("all")
#: notebook 12's checks run ranks, several launches an answer: their answers are judged in
#: tests/test_exercise_hints_nb12.py, a module of its own, so that pytest-xdist can run them on
#: another worker than the rest (each module stays on one worker)
ON_A_WORKER_OF_THEIR_OWN = "12"
HERE = [ex for ex in ALL if ex.notebook != ON_A_WORKER_OF_THEIR_OWN]


def answer_of(key: str, source: str):
    """What an answer cell's source defines as the answer of exercise ``key``."""
    return answer_defined(find(key), source)


def returns_none(*args, **kwargs):  # the probe of _hints: a function that returns None
    return None


@functools.cache
def judged_together(key: str) -> dict:
    """The verdicts of the listed wrong answers of ``key`` (by source) and of ``returns_none`` (under
    None), judged together: its check runs a plan on ranks (one launch per world size, one answer
    after another, each as it would be judged alone; make stress judges each alone too)."""
    sources = [src for src, _ in find(key).wrong]
    return dict(zip([*sources, None], verdicts(key, [*map(functools.partial(answer_of, key), sources),
                                                      returns_none]), strict=True))


@functools.cache
def judged(key: str, source: str):
    """The check's verdict on one answer source, judged once per test process: the two tests below
    read the same listed wrong answers (in one module, so pytest-xdist keeps them on one worker)."""
    if judged_by_plan(key) and any(source == src for src, _ in find(key).wrong):
        return judged_together(key)[source]
    return run_source(key, source)


# ---------------------------------------------------------------------------------------- numbers

_GROUPED = r"\d{1,3}(?:[,\u202f\u2009 ]\d{3})+(?:\.\d+)?"
_PLAIN = r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+"
_NUMBER = re.compile(rf"(?<![\w.])(?:{_GROUPED}|{_PLAIN})(?![\w])")
_FRACTION = re.compile(r"(?<![\w.])(\d+)\s*/\s*(\d+)(?![\w.])")
_PERCENT = re.compile(rf"(?<![\w.])({_PLAIN})\s*%")


def _numbers(text: str) -> list[float]:
    return [float(re.sub(r"[,\u202f\u2009 ]", "", m.group())) for m in _NUMBER.finditer(text)]


def _same(a: float, b: float) -> bool:
    if float(a).is_integer() and float(b).is_integer():
        return a == b
    return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-9)


def _flat(value) -> list | None:
    """The numbers of a predicted value, in order (None: not a number or a sequence of numbers)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, (list, tuple)):
        parts = [_flat(v) for v in value]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]
    return None


def _gives_value(value, hint: str, others: tuple = ()) -> str | None:
    """How ``hint`` states ``value``, or None. A word answer counts only when the hint names none
    of the ``others`` (a hint that lists the choices gives none away)."""
    text = repr(value)
    if re.search(rf"(?<![\w.]){re.escape(text)}(?![\w.])", hint):
        return f"it writes {text}"
    if isinstance(value, (list, tuple)) and len(value) > 1:
        inner = text[1:-1].rstrip(",")
        if re.search(rf"(?<![\w.]){re.escape(inner)}(?![\w.])", hint):
            return f"it writes {inner}"
    def says(word: str) -> bool:
        return bool(re.search(rf"\b{re.escape(word.strip())}\b", hint, re.IGNORECASE))

    if isinstance(value, str) and says(value) and not any(says(o) for o in others if isinstance(o, str)):
        return f"it says {value!r}"
    numbers = _flat(value)
    if not numbers:
        return None
    found = _numbers(hint)
    if len(numbers) == 1:
        found += [int(a) / int(b) for a, b in _FRACTION.findall(hint) if int(b)]
        found += [float(p) / 100 for p in _PERCENT.findall(hint)]
        return next((f"it states {x:g}" for x in found if _same(x, numbers[0])), None)
    for i in range(len(found) - len(numbers) + 1):
        if all(_same(a, b) for a, b in zip(found[i:i + len(numbers)], numbers, strict=True)):
            return f"it lists {numbers}"
    return None


# --------------------------------------------------------------------------------------- formulas

_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<name>[^\W\d]\w*)|(?P<op>\*\*|[-+*/×÷^])|"
                    r"(?P<open>\()|(?P<close>\))|(?P<other>\S))")


def _expressions(text: str) -> list[str]:
    """The arithmetic in ``text``, each expression as a skeleton: names become V, numbers stay,
    × and 'x' between numbers become *, implicit products are written out (2Ψ -> 2*V)."""
    tokens = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        value = m.group(kind)
        spaced = m.group().startswith((" ", "\t", "\n"))
        tokens.append((kind, value, spaced))
    out, current, prev = [], [], None
    ops = 0

    def flush():
        nonlocal current, ops
        while current and current[-1] in "+-*/^(":
            current.pop()
        if current:
            out.append(("".join(current), ops))
        current, ops = [], 0

    for i, (kind, value, spaced) in enumerate(tokens):
        if kind == "name" and value == "x" and prev in ("num", "close") and \
                i + 1 < len(tokens) and tokens[i + 1][0] in ("num", "open"):
            kind, value = "op", "*"
        if kind == "op":
            value = {"×": "*", "÷": "/", "**": "^"}.get(value, value)
            if prev in ("num", "name", "close"):
                current.append(value)
                ops += 1
                prev = "op"
            else:
                flush()
                prev = None
            continue
        if kind in ("num", "name", "open"):
            symbol = "V" if kind == "name" else ("(" if kind == "open" else value.rstrip("0").rstrip(".")
                                                   if "." in value else value)
            if prev in ("num", "close") and not spaced and kind != "num":
                current.append("*")  # 2Ψ, (2 + 12)Ψ
                ops += 1
            elif prev == "name" and kind == "open" and not spaced:
                pass  # a call: ceil(
            elif prev in ("num", "name", "close"):
                flush()
            current.append(symbol)
            prev = kind
            continue
        if kind == "close" and prev in ("num", "name", "close") and current.count("(") > current.count(")"):
            current.append(")")
            prev = "close"
            continue
        flush()
        prev = None
    flush()
    return [(e, n) for e, n in out if n >= 1]


def _formulas(text: str) -> set[str]:
    """The expressions of ``text`` substantial enough to be a formula: two numbers and an
    operator, or one number and two operators."""
    return {e for e, ops in _expressions(text)
            if ops >= 1 and (len(re.findall(r"\d+(?:\.\d+)?", e)) >= 2 or (ops >= 2 and re.search(r"\d", e)))}


def _code_and_comments(src: str) -> tuple[list[str], list[str]]:
    code, comments = [], []
    for line in src.splitlines():
        stripped = line.strip()
        if stripped.startswith(("#", '"""', "'''")):
            comments.append(stripped.lstrip("#\"' "))
            continue
        part, _, comment = line.partition("  #")
        code.append(part.strip())
        if comment:
            comments.append(comment.strip())
    return [c for c in code if c], comments


def _giveaways(ex) -> tuple[set[str], list[str]]:
    """The formulas (skeletons) and code (whitespace removed) a hint must not contain."""
    code, comments = _code_and_comments(ex.solution)
    formulas = set().union(*[_formulas(c) for c in comments]) if comments else set()
    snippets = []
    if ex.kind == "predict":
        tree = ast.parse(ex.solution)
        value = tree.body[-1].value
        try:
            ast.literal_eval(value)
        except ValueError:
            formulas |= _formulas(ast.get_source_segment(ex.solution, value))
        return formulas, snippets
    starter_code = {re.sub(r"\s+", "", c) for c in _code_and_comments(ex.starter)[0]}
    for line in code:
        squeezed = re.sub(r"\s+", "", line)
        if squeezed in starter_code or line.startswith(("def ", "import ", "from ")):
            continue
        line = line.removeprefix("return ")
        squeezed = re.sub(r"\s+", "", line)
        formulas |= _formulas(line)
        if len(squeezed) >= 12:
            snippets.append(squeezed)
        snippets += [re.sub(r"\s+", "", k) for k in re.findall(r"\b\w+\s*=\s*[\w.]+", line)
                     if re.sub(r"\s+", "", k) not in "".join(starter_code)]
    return formulas, snippets


def _leak(ex, value, hint: str) -> str | None:
    formulas, snippets = _giveaways(ex)
    if value is not None:
        others = tuple(_value(ex, src) for src, _ in ex.wrong)
        found = _gives_value(value, hint, others)
        if found:
            return found
    for expression, ops in _expressions(hint):
        if any(f in expression for f in formulas):
            return f"it writes the formula {expression}"
        if ops >= 2 and re.search(r"\d", expression) and any(expression in f for f in formulas):
            return f"it writes part of the formula: {expression}"
    squeezed = re.sub(r"\s+", "", hint)
    return next((f"it writes the code {s}" for s in snippets if s in squeezed), None)


# ------------------------------------------------------------------------------------------ hints

def _probes(value) -> list:
    """Wrong predictions near ``value``."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, (int, float)):
        whole = isinstance(value, int)
        out = [value + 1, value - 1, value * 2, value * 4, 0, -1, value * 1024]
        out += [value // 2, value // 4, value // 1024] if whole else [value / 2, value / 4, value / 1024]
        return [v for v in out if v != value]
    if isinstance(value, str):
        return ["", "no idea"]
    if isinstance(value, (list, tuple)):
        kind = type(value)
        out = [kind(reversed(value)), kind(value[:-1]), kind([*value, value[-1]])]
        for i, item in enumerate(value):
            out += [kind([*value[:i], p, *value[i + 1:]]) for p in _probes(item)]
        return [v for v in out if v != value]
    return []


def _hints(ex) -> list[tuple[str, str]]:
    """(answer, hint) for the listed wrong answers, the starter and the probes."""
    found = [(src, judged(ex.key, src).hint) for src, _ in ex.wrong]
    found.append(("the starter", run_source(ex.key, ex.starter).hint))
    if ex.kind == "predict":
        for probe in _probes(_value(ex)):
            result = verdict(ex, probe)
            if not result.right:
                found.append((repr(probe), result.hint))
    else:
        result = judged_together(ex.key)[None] if judged_by_plan(ex.key) else verdict(ex, returns_none)
        found.append(("a function that returns None", result.hint))
    return found


def _value(ex, source: str | None = None):
    namespace: dict = {}
    exec(ex.context + "\n" + (ex.solution if source is None else source), namespace)
    return namespace[ex.answer]


def every_listed_wrong_answer_gets_its_hint(ex):
    for source, fragment in ex.wrong:
        result = judged(ex.key, source)
        assert result.status == "not yet", (source, str(result))
        assert fragment in result.hint, (source, str(result))


def no_hint_gives_the_answer_away(ex):
    value = _value(ex) if ex.kind == "predict" else None
    leaks = [f"{answer!r} -> {hint!r}: {why}" for answer, hint in _hints(ex)
             if (why := _leak(ex, value, hint))]
    assert not leaks, "\n".join(leaks)


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("ex", HERE, ids=[ex.key for ex in HERE])
def test_every_listed_wrong_answer_gets_its_hint(ex):
    every_listed_wrong_answer_gets_its_hint(ex)


@pytest.mark.parametrize("ex", HERE, ids=[ex.key for ex in HERE])
def test_no_hint_gives_the_answer_away(ex):
    no_hint_gives_the_answer_away(ex)


# ------------------------------------------------------------------------- the detectors, checked

def test_the_detectors_find_values_and_formulas():
    assert _gives_value(24576, "each rank sends 24,576 bytes")
    assert _gives_value(24576, "each rank sends 24 576 bytes")
    assert _gives_value(0.75, "three quarters, 3/4 of it")
    assert _gives_value(0.75, "75% of DDP's")
    assert _gives_value([4, 4, 4, 1], "the chunks are 4, 4, 4, 1")
    assert _gives_value((True, True), "answer True, True")
    assert _gives_value("shrink", "it will Shrink")
    assert not _gives_value("shrink", 'answer "grow" or "shrink"', others=("grow",))
    assert not _gives_value([4, 4, 4, 1], "pieces of 4 rows; the last is smaller")
    assert not _gives_value(6, "there are 8 devices and 18 rows")
    assert "2*V+(2+12)*V/V" in _formulas('"zero2": 2 * parameters + (2 + 12) * parameters / gpus,')
    assert [e for e, _ in _expressions("each rank holds 2Ψ + (2 + 12)Ψ/N")] == ["2*V+(2+12)*V/V"]
    assert [e for e, _ in _expressions("pieces of ceil(18 / 8) = 3 rows")] == ["V(18/8)"]
    assert [e for e, _ in _expressions("2 x 3 steps x 4096 / 4 bytes")] == ["2*3", "4096/4"]
    assert _formulas("the outputs, their gradient: 3 * 476.9") == {"3*476.9"}
    assert not _formulas("one chunk of size / N bytes per step")


def test_the_hints_issue_27_found_would_fail():
    assert _leak(find("11.3"), None, "so each rank holds 4Ψ + (4 + 8)Ψ/N")
    assert _leak(find("02.3"), 6, "each piece has ceil(18 / 8) rows; count how many pieces it takes")
    assert _leak(find("05.3"), None, "call sampler.set_epoch(epoch) before you read")
    assert _leak(find("03.1"), None, "pass dim=1")
    assert not _leak(find("02.3"), 6, "work out the size of the pieces torch.chunk cuts from 18 rows")
