"""Stopping ranks: kill_tree (torchrun's timeout) ends every descendant, even one started while it
runs; stacks_of reads a stuck rank's whole stack, even one written in two parts."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from course_utils.launcher.processes import kill_tree

# An agent that starts a worker in a session of its own every few milliseconds, as torchrun's
# agent does (each worker in a new session), and never stops
SPAWNER = """
import subprocess, sys, time
while True:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sys.argv[1]],
                     start_new_session=True)
    time.sleep(0.002)
"""


def _marked(mark):
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if mark in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_kill_tree_leaves_no_worker_even_one_started_while_it_runs():
    for attempt in range(5):
        mark = f"kill-tree-test-{time.time_ns()}-{attempt}"
        agent = subprocess.Popen([sys.executable, "-c", SPAWNER, mark], start_new_session=True)
        deadline = time.monotonic() + 60
        while len(_marked(mark)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # workers are starting
        kill_tree(agent)
        agent.wait(timeout=30)
        # a process SIGKILLed a moment ago may not have died yet: one that escaped sleeps on
        left = psutil.wait_procs(_marked(mark), timeout=10)[1]
        for p in left:
            p.kill()
        assert left == [], f"attempt {attempt}: {len(left)} worker(s) left running"


def test_a_stack_written_in_two_parts_is_read_whole(tmp_path):
    """A rank descheduled halfway through its faulthandler dump leaves a file that stops growing for
    a while: stacks_of waits until the dump reaches the launcher's frames, where the main thread's
    part ends (here 0.5 s after the first part; without the wait it read the first part alone). A
    file whose name only ends like the launcher's (torch's _lowrank.py) does not count."""
    from course_utils.launcher import processes
    from course_utils.launcher.processes import RankHandle, stacks_of

    launcher = Path(processes.__file__).with_name("rank.py")  # the frame format_stack cuts at

    rank = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                             "signal.signal(signal.SIGUSR1, signal.SIG_IGN); print('ready', flush=True); "
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "ready\n"  # SIGUSR1 would end it before this
        handle = RankHandle(rank=0, process=rank, log=tmp_path / "rank0.log", result=tmp_path / "r")
        handle.stack.write_text('Current thread 0x1 (most recent call first):\n'
                                '  File "/x/torch/distributed/c10d.py", line 3 in all_reduce\n'
                                '  File "/x/torch/_lowrank.py", line 5 in svd_lowrank\n')

        def rest():
            time.sleep(0.5)
            with handle.stack.open("a") as f:
                f.write('  File "/x/user.py", line 7 in train\n'
                        f'  File "{launcher}", line 9 in run\n')

        threading.Thread(target=rest, daemon=True).start()
        stack = stacks_of([handle], wait_s=60)[0]  # a busy machine may delay the second part
    finally:
        rank.kill()
        rank.wait()
    functions = [line.split(", in ")[-1] for line in stack if ", in " in line]
    assert functions == ["train", "svd_lowrank", "all_reduce"]
