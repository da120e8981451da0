"""Every English notebook as on another machine (``make stress``): the start that macOS and Windows
learners get, and another CPU's kernels.

Off Linux, ``launch`` starts each rank as a fresh interpreter instead of forking it from the fork
server. ``COURSE_START=subprocess`` gives every launch that start here; this test runs nbval over
``notebooks/`` with it set, in a pytest of its own (the kernels inherit the variable), and checks
that every notebook was collected, every cell passed, and that ranks really were fresh interpreters
(``python -m course_utils.launcher.rank`` processes, seen while the notebooks ran). The kernels are
fresh interpreters too, as a learner's are (``make test`` forks its kernels from its fork server:
``course_utils/launcher/kernel.py``), reached through socket files (``tests/early_plugin.py``: over
TCP, a kernel here once died before its first reply, as a port taken from it makes one). It runs on
every core, as ``make nbval`` does. The same run uses PyTorch's portable CPU kernels
(``ATEN_CPU_CAPABILITY=default``): a stored output that only one CPU's kernels print (a rounding
residue) fails here, whichever CPU wrote it; this is CI's second nbval pass over the notebooks
(``make nbval-portable`` runs it alone, with the usual start).
"""

import json
import os
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

from course_utils.launcher.forkserver import START_VARIABLE

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
FRESH_RANK = "course_utils.launcher.rank"
#: a fresh kernel's module, and the stand-in of a kernel forked from make test's fork server
FRESH_KERNEL, FORKED_KERNEL = "ipykernel_launcher", "course_utils.launcher.kernel"
#: PyTorch's portable CPU kernels instead of the ones this processor would pick (AVX-512, AVX2)
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "default"}
#: the whole run's limit: the notebooks took about 8 minutes on 2 cores shared with other work
LIMIT_S = 1800


class RankWatcher(threading.Thread):
    """Collects the process ids of fresh-interpreter ranks among a process's descendants, and of
    its kernels: fresh ones (``ipykernel_launcher``), and the stand-ins of forked ones."""

    def __init__(self, root: psutil.Process) -> None:
        super().__init__(daemon=True)
        self.root, self.seen, self.done = root, set(), threading.Event()
        self.kernels: dict[str, set[int]] = {FRESH_KERNEL: set(), FORKED_KERNEL: set()}
        self.transports: dict[int, str] = {}  # a fresh kernel's, from its connection file

    def run(self) -> None:
        while not self.done.wait(0.3):
            try:
                children = self.root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in children:
                try:
                    command = p.cmdline()
                    if FRESH_RANK in command:
                        self.seen.add(p.pid)
                    for kind, pids in self.kernels.items():
                        if kind in command:
                            pids.add(p.pid)
                    if FRESH_KERNEL in command and p.pid not in self.transports and "-f" in command:
                        info = json.loads(Path(command[command.index("-f") + 1]).read_text())
                        self.transports[p.pid] = info["transport"]
                except (psutil.NoSuchProcess, psutil.AccessDenied, OSError, ValueError):  # ended meanwhile
                    pass


@pytest.mark.stress
def test_every_notebook_passes_nbval_with_fresh_interpreter_ranks(tmp_path):
    assert len(NOTEBOOKS) >= 11, NOTEBOOKS
    report = tmp_path / "nbval.xml"
    # tests/early_plugin.py, as make nbval loads it: the kernels get socket files, not TCP ports
    command = [sys.executable, "-m", "pytest", "-p", "tests.early_plugin", "-p", "no:cacheprovider", "-q",
               "-n", "auto", "--dist", "loadscope", "--no-loadscope-reorder", f"--junitxml={report}",
               "notebooks"]
    env = {**os.environ, START_VARIABLE: "subprocess", **PORTABLE_KERNELS}
    run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    watcher = RankWatcher(psutil.Process(run.pid))
    watcher.start()
    try:
        out, _ = run.communicate(timeout=LIMIT_S)
    finally:
        watcher.done.set()
        if run.poll() is None:
            run.kill()
            run.communicate()
    tail = "\n".join(out.splitlines()[-60:])
    assert report.exists(), tail
    per_notebook: dict[str, int] = {}
    failed = []
    for case in ET.parse(report).getroot().iter("testcase"):
        notebook = case.get("classname", "").removeprefix("notebooks.")
        per_notebook[notebook] = per_notebook.get(notebook, 0) + 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{notebook} {case.get('name')}")
    assert failed == [], f"{failed}\n{tail}"
    assert sorted(per_notebook) == NOTEBOOKS, f"collected: {per_notebook}\n{tail}"
    assert run.returncode == 0, tail
    # the launches of notebooks 05, 10 and 12 (and their checks) start fresh interpreters
    assert len(watcher.seen) >= 10, f"fresh-interpreter ranks seen: {len(watcher.seen)}\n{tail}"
    # and every notebook ran in a fresh kernel, as a learner's does (make test forks them)
    kernels = {kind: len(pids) for kind, pids in watcher.kernels.items()}
    assert kernels[FORKED_KERNEL] == 0 and kernels[FRESH_KERNEL] >= len(NOTEBOOKS), kernels
    # reached through socket files, which no rank's connection can take (tests/early_plugin.py)
    transports = sorted(watcher.transports.values())
    assert len(transports) >= len(NOTEBOOKS) and set(transports) == {"ipc"}, transports
