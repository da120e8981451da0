"""The rank processes of ``launch``: their results, their output, stopping them, their stacks.

Shared by the launcher (``course_utils.distributed``), the rank side (``course_utils.launcher.rank``,
which writes a :class:`RankResult`) and the torchrun wrappers (``kill_tree``). Every wait here
has a named limit.
"""

from __future__ import annotations

import linecache
import os
import pickle
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RankHandle", "RankResult", "format_stack", "kill_tree", "signal_session", "stacks_of", "stop"]

#: c10d log lines start like "[W1122 14:02:53.123456789 ProcessGroupGloo.cpp:...]": they carry
#: timestamps and PIDs, so successful runs leave them out of the echoed output.
C10D_LOG_PREFIXES = ("[W", "[I", "[E")
#: how long stopped ranks get to exit after SIGTERM before SIGKILL
STOP_GRACE_S = 3.0
#: how long to wait for a process to be reaped after SIGKILL
REAP_S = 5.0
#: how long stuck ranks get to write their stacks after SIGUSR1
STACKS_WAIT_S = 2.0
#: how often stacks_of looks for the stacks it asked for
STACKS_POLL_S = 0.05


@dataclass(frozen=True)
class RankResult:
    """What a rank reports: its return value, or the exception it raised (``ok`` False)."""

    ok: bool
    finished_at: float
    value: Any = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""


@dataclass
class RankHandle:
    """One running rank as the launcher sees it: its process, its log and result files."""

    rank: int
    process: Any  # a subprocess.Popen, or a forkserver.Forked
    log: Path
    result: Path

    @property
    def stack(self) -> Path:
        """Where the rank's faulthandler writes its Python stack when it gets SIGUSR1."""
        return self.log.with_suffix(".stack")

    def output(self, *, keep_logs: bool = False) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        lines = text.splitlines()
        if keep_logs:
            return lines
        return [line for line in lines if not line.startswith(C10D_LOG_PREFIXES)]

    def read_result(self) -> RankResult | None:
        try:
            with open(self.result, "rb") as f:
                return pickle.load(f)  # the rank wrote it with cloudpickle, which pickle reads
        except FileNotFoundError:
            return None


def stop(ranks: list[RankHandle], grace_s: float = STOP_GRACE_S) -> None:
    """Terminate every rank's whole process session, then kill what is left."""
    alive = [r for r in ranks if r.process.poll() is None]
    for r in alive:
        signal_session(r.process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in alive:
        try:
            r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for r in ranks:
        # SIGKILL the session even if the leader exited: a grandchild (a DataLoader worker, say)
        # may still hold it.
        signal_session(r.process, signal.SIGKILL)
        try:
            r.process.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
            pass


def kill_tree(process: Any) -> None:
    """SIGKILL ``process``'s session and every descendant, even those in sessions of their own.

    torchrun starts each worker in a new session, so killing the agent's session alone would
    leave its workers running (and holding the output pipe open). The session is stopped first
    (SIGSTOP, where there is one): an agent that started a worker after the descendants were
    listed left that worker running (seen once, a timeout during start-up on a busy machine).
    """
    import psutil  # here, not at the top: a rank imports this module for RankResult

    if hasattr(signal, "SIGSTOP"):
        signal_session(process, signal.SIGSTOP)  # its processes start nothing more; SIGKILL ends them
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    for child in descendants:
        try:
            if os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, signal.SIGKILL)
            else:
                child.kill()
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    signal_session(process, signal.SIGKILL)


def signal_session(process: Any, sig: int) -> None:
    """Send ``sig`` to the process session that ``process`` leads (or to it alone, if it has none yet)."""
    try:
        if hasattr(os, "killpg"):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                # a forked rank that has not yet made its own session: signal the process alone
                if process.poll() is None:
                    os.kill(process.pid, sig)
        elif process.poll() is None:  # pragma: no cover - Windows
            process.kill()
    except (ProcessLookupError, PermissionError):
        pass


def stacks_of(stuck: list[RankHandle], wait_s: float = STACKS_WAIT_S) -> dict[int, list[str]]:
    """Ask each stuck rank for its Python stack (SIGUSR1: faulthandler writes it), briefly."""
    if not hasattr(signal, "SIGUSR1"):  # pragma: no cover - Windows
        return {}
    asked = []
    for r in stuck:
        if r.process.poll() is None:
            try:
                os.kill(r.process.pid, signal.SIGUSR1)
                asked.append(r)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + wait_s
    sizes: dict[int, int] = {}
    while asked and time.monotonic() < deadline:
        time.sleep(STACKS_POLL_S)
        now = {r.rank: r.stack.stat().st_size if r.stack.exists() else 0 for r in asked}
        # every dump written, none still growing, and each down to the launcher's frames (where the
        # main thread's part ends), so that a rank descheduled halfway through is waited for
        if all(now.values()) and now == sizes and all(_reaches_the_launcher(r) for r in asked):
            break
        sizes = now
    found = {}
    for r in asked:
        try:
            found[r.rank] = format_stack(r.stack.read_text(errors="replace"))
        except FileNotFoundError:
            pass
    return found


def _reaches_the_launcher(r: RankHandle) -> bool:
    """Whether the rank's dump is whole: it reached the launcher's frame, or it cannot get longer
    (faulthandler cut a deep stack short with "  ...", or the rank has exited)."""
    try:
        lines = r.stack.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return False
    return (r.process.poll() is not None or "  ..." in lines
            or any((m := _FRAME.match(line)) and _is_the_launcher(m.group(1)) for line in lines))


_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')
#: the launcher's rank code: a rank's outermost frames (every dump of its main thread ends there)
_RANK_FILE = os.path.normcase(os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py"))


def _is_the_launcher(path: str) -> bool:
    return os.path.normcase(os.path.abspath(path)) == _RANK_FILE


def format_stack(dump: str) -> list[str]:
    """A faulthandler dump as traceback lines: most recent call last, with the source lines,
    without the launcher's own frames (``rank.run`` and what calls it)."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in dump.splitlines():
        if line.startswith(("Current thread", "Thread", "Stack")):
            threads.append([])
        elif threads and (match := _FRAME.match(line)):
            threads[-1].append((match.group(1), int(match.group(2)), match.group(3)))
    lines = []
    for frames in threads:  # each thread's frames: most recent call first
        own = [i for i, (path, _, _) in enumerate(frames) if _is_the_launcher(path)]
        # fn's frames and what they call; or, when fn has returned, where the launcher's rank
        # code waits (tearing down the group, say)
        mine = (frames[:own[0]] or frames[own[0]:own[0] + 1]) if own else frames
        if not mine:
            continue
        if not own:
            lines.append("  (another thread)")
        for path, number, name in reversed(mine):
            lines.append(f'  File "{path}", line {number}, in {name}')
            source = linecache.getline(path, number).strip()
            if source:
                lines.append(f"    {source}")
    return lines
