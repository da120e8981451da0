"""The fork server never asks CUDA anything, so its forked ranks may use a GPU (notebooks 05 to 12).

A process that forks after CUDA (even the driver alone, which ``torch.cuda.is_available()`` or
``device_count()`` can start) hands its children a CUDA they cannot use. ``launch`` forks ranks
from its fork server on GPU machines too, so the server must not touch CUDA: it imports
``forkserver.PRELOAD`` and nothing more. This test imports that list in a fresh interpreter, in
the server's order, with a profiler watching every call after ``import torch`` (which every
process makes, a fresh interpreter's ranks too, and which leaves CUDA alone by torch's design):
any function of ``torch/cuda/`` (wherever it was imported from, under any name) and any of torch's
C functions named ``_cuda...`` fails it. The one allowed is ``torch.cuda._is_compiled``, which asks
whether this build has CUDA, not the driver. It runs on any machine, GPU or not: what it checks is
what the imports call, not what a GPU would answer. (On 2026-11-27 an H100 ran every notebook and
the gpu tests with forked ranks, NCCL's too: all passed.)
"""

import json
import subprocess
import sys

from course_utils.launcher import forkserver

#: functions of torch/cuda/ the server may call: whether the build has CUDA (no driver call)
ALLOWED = ("_is_compiled",)

_PROBE = """
import importlib, json, os, sys
import torch

preload, allowed = json.loads(sys.argv[1]), json.loads(sys.argv[2])
cuda_dir = os.path.dirname(torch.cuda.__file__) + os.sep
reached = []

def watch(frame, event, arg):
    code = frame.f_code
    if event == "c_call" and getattr(arg, "__name__", "").startswith("_cuda"):
        reached.append("torch._C." + arg.__name__)
    elif (event == "call" and code.co_filename.startswith(cuda_dir) and code.co_flags & 1
          and code.co_name not in allowed):  # 1: CO_OPTIMIZED, a function (not a module or class body)
        reached.append(code.co_filename[len(cuda_dir):] + ":" + code.co_name)

sys.setprofile(watch)
torch.cuda.is_available()
sys.setprofile(None)
armed = reached == ["__init__.py:is_available"]
reached.clear()
already = sorted(m for m in preload if m in sys.modules)
sys.setprofile(watch)
for module in preload:
    importlib.import_module(module)
sys.setprofile(None)
print(json.dumps({"armed": armed, "reached": reached, "already": already,
                  "imported": [m for m in preload if m in sys.modules]}))
"""


def test_the_fork_servers_imports_never_reach_cuda():
    preload = list(forkserver.PRELOAD)
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(preload), json.dumps(ALLOWED)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["armed"], "the profiler did not see torch.cuda.is_available(): the probe proves nothing"
    assert seen["imported"] == preload  # every module the server imports, imported here
    assert seen["reached"] == [], f"the fork server's imports reached CUDA through {seen['reached']}"
    # every course module, at least, was first imported under the profiler
    assert not [m for m in seen["already"] if m.startswith("course_utils")], seen["already"]
