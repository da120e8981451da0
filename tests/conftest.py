"""Shared test configuration.

Do not set MPLBACKEND here: the notebooks' kernels inherit this process's environment, and a
non-interactive backend would stop their plots from being displayed (and compared).
Unit tests that plot select the Agg backend themselves.
"""

import psutil
import pytest

#: multiprocessing's helper processes, which live as long as the process that started them: the
#: fork server that `launch` forks ranks from, and its resource tracker.
_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def is_multiprocessing_helper(process: psutil.Process) -> bool:
    try:
        return any(helper in part for part in process.cmdline() for helper in _HELPERS)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def rank_processes() -> list[psutil.Process]:
    """This process's live descendants, leaving out multiprocessing's long-lived helpers."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not is_multiprocessing_helper(p):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture
def nothing_left_behind():
    """Fails the test if it leaves a rank process (or any other child) running."""
    before = {p.pid for p in rank_processes()}
    yield
    leftover = [p for p in rank_processes() if p.pid not in before]
    assert leftover == [], f"processes left behind: {leftover}"
