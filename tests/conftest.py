"""Shared test configuration.

Do not set MPLBACKEND here: the notebooks' kernels inherit this process's environment, and a
non-interactive backend would stop their plots from being displayed (and compared).
Unit tests that plot select the Agg backend themselves.
"""

import contextlib
import gc
import json
import os
import signal
import time

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


def pytest_configure(config):
    """One fork server for the whole session, which imports pytest (and psutil) up front, too.

    The session's first process (xdist's controller, or the only one) starts it and names it in
    COURSE_FORKSERVER (course_utils/launcher/shared_server.py): the workers and the notebooks'
    kernels inherit the name and fork their ranks from it, instead of starting a server each (about
    3 CPU-s apiece, some fourteen times in `make test`). A rank whose function a test module defines
    imports that module, and so pytest: about 75 ms of CPU in each of some 200 ranks, or once here.
    """
    from course_utils.launcher import forkserver, shared_server

    forkserver.PRELOAD.extend(name for name in ("pytest", "psutil") if name not in forkserver.PRELOAD)
    if not hasattr(config, "workerinput") and _forks_here() and shared_server.publish(forkserver.PRELOAD):
        config.stash[_PUBLISHED] = json.loads(os.environ[shared_server.VARIABLE])["pid"]
    if os.environ.get(shared_server.VARIABLE) and not forkserver.fresh_starts():
        _fork_kernels()
    if config.pluginmanager.hasplugin("nbval"):  # as tests/early_plugin.py, which a bare pytest lacks
        from early_plugin import kernels_over_socket_files  # tests/ is on sys.path, as for every test module

        kernels_over_socket_files()


def _fork_kernels():
    """The notebooks' kernels (nbval's, and those of tests that run a notebook) fork from the
    session's fork server, which has imported torch and the course's modules: each fresh kernel
    imported them itself, about 3 CPU-s (course_utils/launcher/kernel.py). Not under fresh starts
    (COURSE_START=subprocess): make stress validates every notebook in fresh kernels."""
    from jupyter_client.provisioning import local_provisioner

    from course_utils.launcher import kernel

    start = local_provisioner.launch_kernel
    if getattr(start, "forks_kernels", False):
        return

    def launch_kernel(cmd, **kwargs):
        return start(kernel.command(cmd), **kwargs)

    launch_kernel.forks_kernels = True
    local_provisioner.launch_kernel = launch_kernel


#: the pid of the fork server that this process started and named for the session
_PUBLISHED = pytest.StashKey[int]()


def ranks_left_on(server_pid: int, timeout: float) -> list[psutil.Process]:
    """The children of ``server_pid`` still running after ``timeout`` seconds (zombies left out).

    A fork server's children are the ranks it forked, whoever asked for them: a worker's test, a
    notebook's kernel or a pytest a test started; and the notebooks' kernels (_fork_kernels).
    nothing_left_behind sees only what the worker's own launches start; this sees them all, once the
    session is over.
    """
    try:
        children = psutil.Process(server_pid).children()
    except psutil.NoSuchProcess:
        return []
    running = []
    for p in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE:
                running.append(p)
    return psutil.wait_procs(running, timeout=timeout)[1]


def pytest_collection_finish(session):
    """What this process imported and collected lives until the session ends: out of the collector's
    way (gc.freeze), so that each full collection during the tests looks only at what they made.
    Unfrozen, a full collection in a worker (torch, nbval and 2,000 collected tests: some 400,000
    objects) cost about 0.1 CPU-s, several times a worker (measured). Tests that prove an object
    is freed make that object after this point, and so still see it go."""
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """Fails the session if the fork server it named still has a rank (or a kernel) running at the end."""
    server = session.config.stash.get(_PUBLISHED, None)
    if server is None:
        return
    left = ranks_left_on(server, LEFTOVER_EXIT_S)
    if not left:
        return
    described = []
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            session_id = os.getsid(p.pid)
            described.append(f"pid {p.pid}, session {session_id}")
            if session_id == p.pid:  # a rank (or a kernel) leads its own session: all of it goes
                os.killpg(session_id, signal.SIGKILL)
            else:  # forked, but not yet a rank: its session is still this one
                p.kill()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = (f"ranks or kernels left running on the session's fork server at the end (killed now): "
               f"{'; '.join(described)}")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(message, red=True)
    else:
        print(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _forks_here() -> bool:
    """Whether launches here fork ranks (what forkserver.use_forkserver decides for a kernel or a
    pytest worker, GPU or not; the controller does not import torch for it)."""
    import multiprocessing
    import os
    import sys

    from course_utils.launcher import forkserver

    return (sys.platform == "linux" and "forkserver" in multiprocessing.get_all_start_methods()
            and os.environ.get(forkserver.START_VARIABLE, "") != "subprocess"
            and not forkserver.internals_missing())


class StartedRanks:
    """Every rank that ``launch`` started while it was recorded.

    A scan of this process's descendants misses forked ranks: their parent is the fork server,
    which the session's first process started (tests/conftest.py's pytest_configure), and their
    command line is the server's. Each rank leads a process session of its own (``os.setsid``), so
    what it started stays in that session, whoever reaps it (unless it made a session of its own:
    launch's own stop() does not reach that either).
    """

    def __init__(self) -> None:
        self.ranks: list[psutil.Process] = []  # psutil tells a reused pid from the rank itself
        self.sessions: set[int] = set()

    def record(self, pid: int) -> None:
        self.sessions.add(pid)
        with contextlib.suppress(psutil.NoSuchProcess):  # gone already; its session is still checked
            self.ranks.append(psutil.Process(pid))

    def alive(self) -> list[psutil.Process]:
        """The recorded ranks still running, and every process left in one of their sessions."""
        found = []
        for p in self.ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                if (p.pid not in self.sessions and os.getsid(p.pid) in self.sessions
                        and p.status() != psutil.STATUS_ZOMBIE):
                    found.append(p)
        return found


@contextlib.contextmanager
def recording_ranks():
    """Record the rank of every ``launch`` made inside the block (a :class:`StartedRanks`)."""
    from course_utils import distributed

    ranks = StartedRanks()

    class Recorded(distributed.RankHandle):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            ranks.record(self.process.pid)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distributed, "RankHandle", Recorded)
        yield ranks


def stopped_once_hung(launch_with_timeout, first_timeout_s: float, hung_in: dict[int, str],
                      tries: int = 3):
    """The LaunchTimeout of the first try that stopped the ranks where they hang.

    ``launch_with_timeout(timeout_s)`` must raise LaunchTimeout; ``hung_in`` maps each rank that
    the program leaves stuck to a function its stack must then be in (the ranks left out must have
    finished). Slow is not stuck: on a busy machine a rank can still be importing torch, making its
    group or computing when the timeout comes, and its stack then shows that instead of the hang.
    Such a try says nothing about how a hang is stopped, so it is made again with twice the time;
    after ``tries`` tries the test fails. Returns ``(error, timeout_s, wall_s)`` of the try that
    counted.
    """
    from course_utils.distributed import LaunchTimeout

    timeout_s, seen = first_timeout_s, []
    for _ in range(tries):
        began = time.monotonic()
        with pytest.raises(LaunchTimeout) as info:
            launch_with_timeout(timeout_s)
        wall_s = time.monotonic() - began
        stacks = info.value.stacks
        if set(stacks) == set(hung_in) and all(
                any(line.endswith(f" in {name}") for line in stacks[rank]) for rank, name in hung_in.items()):
            return info.value, timeout_s, wall_s
        seen.append(f"{timeout_s} s: " + " | ".join(f"rank {r}: {stack[-1].strip() if stack else ''}"
                                                  for r, stack in sorted(stacks.items())))
        timeout_s *= 2
    pytest.fail(f"no try stopped the ranks in {hung_in} (innermost lines: {seen})")


@pytest.fixture
def nothing_left_behind():
    """Fails the test if it leaves a rank process (forked or not, and anything left in a rank's
    session) or any other child running."""
    before = {p.pid for p in rank_processes()}
    with recording_ranks() as ranks:
        yield
    leftover = [p for p in rank_processes() if p.pid not in before] + ranks.alive()
    # launch waits for each rank, not for what the rank started: a killed grandchild may still be
    # exiting (slow is not stuck)
    _, leftover = psutil.wait_procs(leftover, timeout=LEFTOVER_EXIT_S)
    assert leftover == [], f"processes left behind: {leftover}"


#: how long a process that a rank started gets to finish exiting after launch returned
LEFTOVER_EXIT_S = 5.0


#: The longest scopes of `make test` (each notebook, each test module: pytest-xdist's --dist loadscope
#: keeps one on one worker), longest first: every scope of 3.5 s or more in a make test on 2 cores
#: (2026-11-28, each test's wall time summed by scope). They are handed out first, so that no long
#: one starts last while the other workers idle: the run ends with short scopes, which fill in. (A
#: scope missing here runs among the short ones: test_shared_server's 11 s once ended a run alone.)
LONGEST_FIRST = ("tests/test_distributed.py", "tests/test_exercises.py",
                 "notebooks/09_fault_tolerance_and_multi_node.ipynb",
                 "tests/test_exercise_hints_nb12_hangs.py",
                 "notebooks/07_batch_size_and_learning_rate.ipynb", "tests/test_bench.py",
                 "notebooks/05_distributed_data_parallel.ipynb", "notebooks/11_choosing_a_strategy.ipynb",
                 "tests/test_exercise_hints_nb12_saving.py", "notebooks/12_debugging_distributed.ipynb",
                 "tests/test_debugging.py", "tests/test_gpu_check.py", "tests/test_exercise_hints_nb12.py",
                 "tests/test_launch_modes.py", "tests/test_exercise_hints.py",
                 "tests/test_forked_kernels.py", "tests/test_compat.py", "tests/test_noise_scale.py",
                 "tests/test_devices.py", "notebooks/10_sharded_data_parallel.ipynb",
                 "tests/test_exercise_limits.py", "tests/test_shared_server.py",
                 "notebooks/06_ddp_by_hand.ipynb", "tests/test_busy_judges.py",
                 "tests/test_ddp_by_hand.py", "tests/test_mesh.py", "tests/test_lab.py",
                 "notebooks/03_data_parallel_by_hand.ipynb", "tests/test_preload_cuda.py",
                 "notebooks/04_output_device_and_memory.ipynb", "tests/test_kernel_sockets.py",
                 "tests/test_batch_size.py", "tests/test_zero_by_hand_edges.py", "tests/test_env.py",
                 "notebooks/08_mixed_precision.ipynb", "tests/test_restarts.py", "tests/test_gloo_wire.py",
                 "notebooks/02_data_parallel.ipynb", "tests/test_sharding.py")


#: The scopes run last. make stress (one pytest: each test after the one before) runs every notebook
#: in a pytest of its own on every core (tests/test_fresh_starts.py); its other tests use about one
#: core and a half. CI runs make stress beside make compat-all and make book-check, which end first:
#: the notebooks' pass comes last, to keep both cores busy once make stress runs alone.
LAST = ("tests/test_fresh_starts.py",)


def pytest_collection_modifyitems(config, items):
    """Collected scopes in the order of LONGEST_FIRST, then the rest as collected, then LAST (make
    test runs with --no-loadscope-reorder, so xdist hands them out in this order)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    rank.update({path: len(LONGEST_FIRST) + 1 + i for i, path in enumerate(LAST)})
    # a stable sort: the cells of a notebook, and the tests of a module, stay in their order
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))
