"""kill_tree (torchrun's timeout): every descendant ends, even one started while it runs."""

import subprocess
import sys
import time

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
