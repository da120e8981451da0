"""Every check comes back, with a hint, within its exercise's time limit, whatever the answer does:
an answer that loops forever (a function whose body is `while True: pass`, or a predicted value
whose comparisons loop) is stopped; a right answer is not; the time spent on ranks, which have the
launch timeout, and the course's own reference computations do not count."""

import dataclasses
import signal
import threading
import time

import pytest

import course_utils.distributed
from course_utils.exercises import answer_cells, bank, core, find, run_source, time_limit, untimed, verdict

ALL = bank("all")
#: seconds a check may take beyond its limit (the stop lands between two instructions)
MARGIN_S = 1.0
#: the tests run every looping answer with this limit: the mechanism is the same for any limit
SHORT_S = 0.2
#: a check stopped at its limit comes back within this, its untimed work included (the course's
#: reference computations, imports): a bound for a hang, not a speed (speed is make bench's). The
#: limit itself is checked on the check's timed seconds (``time_limit._LAST.used``): on a busy
#: machine the untimed part alone took over a second (1.3 s for 02.2 in a kernel, 2026-11-28)
COMES_BACK_S = 30.0
#: the limit of the test that runs a looping answer to each exercise: every check reaches the answer
#: within 6 ms of its start (measured; 01.3's own untimed work aside), and each second of the limit
#: is a second of a core spent looping, for the 37 checks that run in this process
LOOP_S = 0.05
#: the limit of a second try, where a busy machine kept the judge from reaching the answer in LOOP_S
BUSY_S = 2.0


def _looping_function(ex) -> str:
    """An answer that records that it ran (``_entered``), then loops without end."""
    return (f"_entered = []\ndef {ex.answer}(*args, **kwargs):\n    _entered.append(1)\n"
            "    while True:\n        pass\n")


def _loop(*args):
    while True:
        pass


_DUNDERS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__len__", "__iter__",
            "__getitem__", "__contains__", "__bool__", "__int__", "__float__", "__index__", "__abs__",
            "__neg__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
            "__rtruediv__", "__floordiv__", "__mod__", "__round__", "__repr__", "__str__", "__format__",
            "strip", "lower")


def _looping_value(solution_value):
    """A value of the solution's type whose every comparison, conversion and method loops: what a
    prediction computed by a function that never returns hands the check."""
    base = type(solution_value)
    if base is bool:
        base = int
    loops = {name: _loop for name in _DUNDERS if hasattr(base, name)}
    loops["__hash__"] = base.__hash__
    return type(f"Looping{base.__name__.title()}", (base,), loops)(base())


def _solution_value(ex):
    namespace: dict = {}
    exec(ex.context + "\n" + ex.solution, namespace)
    return namespace[ex.answer]


class _RanksNotWanted(Exception):
    """Raised instead of launching ranks: a check that runs ranks has the launch timeout."""


def _timed_verdict(ex, answer, monkeypatch):
    def no_ranks(*args, **kwargs):
        raise _RanksNotWanted

    monkeypatch.setattr(course_utils.distributed, "launch", no_ranks)
    start = time.monotonic()
    result = verdict(ex, answer)
    return result, time.monotonic() - start


def _namespace(ex, src):
    return answer_cells._execute(ex, src, "answer")[ex.answer]


@pytest.mark.parametrize("ex", ALL, ids=[ex.key for ex in ALL])
def test_a_check_stops_an_answer_that_loops_forever(ex, monkeypatch):
    short = dataclasses.replace(ex, time_limit=LOOP_S)
    # a prediction is a value, or a function of the exercise's quantities (10.4: bytes of N and G)
    a_function = ex.kind != "predict" or callable(_solution_value(ex))
    if a_function:
        answer = _namespace(ex, _looping_function(ex))
    else:
        answer = _looping_value(_solution_value(ex))
    result, seconds = _timed_verdict(short, answer, monkeypatch)
    if "_RanksNotWanted" in result.hint:
        pytest.skip("the answer runs on ranks, stopped by the launch timeout (make stress proves it)")
    assert result.status == "not yet", str(result)
    assert time_limit._LAST.used < LOOP_S + MARGIN_S, (time_limit._LAST.used, str(result))
    assert seconds < 20, "imports and the course's own reference computations (untimed) took this long"
    if a_function:  # a value's judge may refuse it before touching what loops
        if not answer.__globals__["_entered"]:
            # LOOP_S is a wall clock: on a busy machine the process may wait that long for a core
            # before the judge reaches the answer. Whether the judge calls the answer at all is what
            # is checked, so a second try gets a limit no wait comes near (speed is make bench's).
            answer = _namespace(ex, _looping_function(ex))
            result, _ = _timed_verdict(dataclasses.replace(ex, time_limit=BUSY_S), answer, monkeypatch)
            if "_RanksNotWanted" in result.hint:  # the first try was stopped before it reached them
                pytest.skip("the answer runs on ranks, stopped by the launch timeout (make stress proves it)")
            assert time_limit._LAST.used < BUSY_S + MARGIN_S, (time_limit._LAST.used, str(result))
        assert answer.__globals__["_entered"], "the check stopped before it called the answer"
        assert "stopped" in result.hint and "loop" in result.hint, result.hint


def test_the_stop_comes_at_the_exercise_own_limit():
    ex = find("02.2")
    # a loop that sleeps: the limit is wall time, and the 5 s need not hold a core
    looping = f"import time\ndef {ex.answer}(*args, **kwargs):\n    while True:\n        time.sleep(0.01)\n"
    start = time.monotonic()
    result = verdict(ex, _namespace(ex, looping))
    seconds = time.monotonic() - start
    assert ex.time_limit - 0.05 <= seconds < COMES_BACK_S
    assert ex.time_limit - 0.05 <= time_limit._LAST.used < ex.time_limit + MARGIN_S
    assert f"after {ex.time_limit:g} s" in result.hint


def test_an_answer_that_catches_exceptions_is_stopped_all_the_same():
    ex = dataclasses.replace(find("02.2"), time_limit=SHORT_S)
    src = ("def chunk_sizes(batch, devices):\n    while True:\n        try:\n            time.sleep(1)\n"
           "        except Exception:\n            pass\n")
    start = time.monotonic()
    result = verdict(ex, _namespace(ex, "import time\n" + src))
    assert time.monotonic() - start < COMES_BACK_S
    assert time_limit._LAST.used < SHORT_S + MARGIN_S
    assert "stopped" in result.hint


def test_outside_the_main_thread_the_check_stops_the_answer_too():
    """Where signals cannot be used (Windows; a check run outside the main thread), a watchdog
    raises the stop in the thread that runs the answer."""
    ex = dataclasses.replace(find("02.2"), time_limit=SHORT_S)
    answer = _namespace(ex, _looping_function(ex))
    found = []
    worker = threading.Thread(target=lambda: found.append((verdict(ex, answer), time_limit._LAST.alarm)))
    start = time.monotonic()
    worker.start()
    worker.join(COMES_BACK_S)
    assert time.monotonic() - start < COMES_BACK_S
    assert time_limit._LAST.used < SHORT_S + MARGIN_S
    result, used_alarm = found[0]
    assert not used_alarm and "stopped" in result.hint
    solution = _namespace(ex, ex.solution)
    worker = threading.Thread(target=lambda: found.append(verdict(ex, solution)))
    worker.start()
    worker.join(COMES_BACK_S)
    assert found[-1].right


#: in-process checks of every kind, quick ones (the timer is the same for every check; the slower
#: judges' right and wrong answers are run by tests/test_exercises.py and test_exercise_hints.py)
QUICK = ("00.1", "01.1", "01.2", "01.3", "02.1", "02.2", "02.3", "04.2")


def test_a_check_leaves_no_alarm_and_no_handler_behind():
    before = signal.getsignal(signal.SIGALRM)
    for ex in map(find, QUICK):
        run_source(ex.key, ex.solution)
        run_source(ex.key, ex.wrong[0][0])
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert time_limit._LIMIT is None


def test_someone_else_s_alarm_is_left_alone():
    """With another handler in place the check uses the watchdog instead, and the handler stays."""
    ex = dataclasses.replace(find("02.2"), time_limit=SHORT_S)
    seen = []
    previous = signal.signal(signal.SIGALRM, lambda *args: seen.append("theirs"))
    try:
        result = verdict(ex, _namespace(ex, _looping_function(ex)))
        assert "stopped" in result.hint and not time_limit._LAST.alarm
        assert signal.getsignal(signal.SIGALRM) is not time_limit._on_alarm
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_time_on_ranks_and_in_untimed_blocks_does_not_count():
    def judge(answer):
        with untimed():
            time.sleep(3 * SHORT_S)  # the course's own work, or ranks
        return answer()

    ex = core.Exercise(key="99.7", kind="implement", title="t", answer="f",
                       starter="def f():\n    raise NotImplementedError\n",
                       solution="def f():\n    return None\n", judge=judge, time_limit=SHORT_S,
                       wrong=(("def f():\n    return 1\n", "x"), ("def f():\n    return 2\n", "y")))
    assert verdict(ex, lambda: None).right
    assert time_limit._LAST.used < SHORT_S
    assert "stopped" in verdict(ex, _loop).hint


def test_in_a_jupyter_kernel_the_alarm_stops_the_answer(tmp_path):
    """A notebook's cells run in the kernel's main thread, where SIGALRM can stop the answer; the
    kernel stays usable after the check."""
    import nbformat

    from course_utils.tools.nbtools import run_in_memory

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in (
        "import dataclasses, time\nfrom course_utils.exercises import find, time_limit, verdict",
        "def chunk_sizes(batch, devices):\n    while True:\n        pass",
        f"start = time.monotonic()\n"
        f"result = verdict(dataclasses.replace(find('02.2'), time_limit={SHORT_S}), chunk_sizes)\n"
        "print(round(time.monotonic() - start, 1), round(time_limit._LAST.used, 1), time_limit._LAST.alarm,"
        " result.hint[:30])",
        "print(verdict('02.2', lambda b, d: [min(-(-b // d), b - s) for s in range(0, b, -(-b // d))]))",
    )])
    error, _ = run_in_memory(nb, tmp_path, timeout_s=120)
    assert error == "", error
    seconds, used, used_alarm, hint = nb.cells[2].outputs[0]["text"].split(" ", 3)
    assert float(seconds) < COMES_BACK_S and float(used) < SHORT_S + MARGIN_S, nb.cells[2].outputs
    assert used_alarm == "True", nb.cells[2].outputs
    assert hint.startswith("the check stopped")
    assert "(implement): right" in nb.cells[3].outputs[0]["text"]


#: the launch limit the stress test below gives the ranks (the judges' own are 15-60 s): each of the
#: eleven looping answers spins on every rank until then (1.5 s: 33 CPU-s in all; forked ranks reach
#: the answer within a few tenths of a second, on a busy machine too)
RANK_LIMIT_S = 1.5


@pytest.mark.stress
def test_a_check_on_ranks_comes_back_when_the_answer_loops_forever(monkeypatch):
    """The checks the test above skips run the answer on ranks, where the launch's timeout stops
    it. Each runs here for real, the launch's limit cut to RANK_LIMIT_S (the mechanism is the same
    for any limit): it must come back "not yet", with a hint, soon after that limit."""
    real_launch = course_utils.distributed.launch
    on_ranks, slow, wrong = [], [], []
    for ex in ALL:
        if ex.kind == "predict":
            continue
        answer = _namespace(ex, _looping_function(ex))
        result, _ = _timed_verdict(dataclasses.replace(ex, time_limit=SHORT_S), answer, monkeypatch)
        if "_RanksNotWanted" not in result.hint:
            continue  # a local check: the test above proves it
        on_ranks.append(ex.key)

        def short_launch(*args, **kwargs):
            kwargs["timeout_s"] = min(kwargs.get("timeout_s") or RANK_LIMIT_S, RANK_LIMIT_S)
            return real_launch(*args, **kwargs)

        monkeypatch.setattr(course_utils.distributed, "launch", short_launch)
        start = time.monotonic()
        result = verdict(ex, answer)
        seconds = time.monotonic() - start
        if result.status != "not yet" or not result.hint:
            wrong.append(f"{ex.key}: {result}")
        if seconds > RANK_LIMIT_S + 20:  # + starting the ranks on a busy machine, and the hint
            slow.append(f"{ex.key}: {seconds:.0f} s")
    assert on_ranks, "no check runs on ranks: the test above skips none, so this one proves nothing"
    assert not wrong and not slow, (wrong, slow)
