"""The fork server never asks CUDA anything, so its forked ranks may use a GPU (notebooks 05 to 12).

A process that forks after CUDA (even the driver alone, which ``torch.cuda.is_available()`` or
``device_count()`` can start) hands its children a CUDA they cannot use. ``launch`` forks ranks
from its fork server on GPU machines too, so the server must not touch CUDA: it imports
``forkserver.PRELOAD`` and nothing more. This test imports that list in a fresh interpreter, in
the server's order, with every torch entry point that reaches the CUDA driver replaced by a
recorder, and asserts that none was called. It runs on any machine, GPU or not: what it checks is
what the imports call, not what a GPU would answer. (On 2026-11-27 an H100 ran every notebook and
the gpu tests with forked ranks, NCCL's too: all passed.)
"""

import json
import subprocess
import sys

from course_utils.launcher import forkserver

#: torch's ways into the CUDA driver: the Python functions, and the C++ ones they end in (replaced
#: only in a build that has them)
ENTRY_POINTS = ("torch.cuda.init", "torch.cuda._lazy_init", "torch.cuda.is_available",
                "torch.cuda.device_count", "torch.cuda.current_device", "torch.cuda.get_device_name",
                "torch.cuda.get_device_properties", "torch.cuda.get_device_capability",
                "torch.cuda.is_bf16_supported", "torch.cuda.mem_get_info", "torch.cuda.synchronize",
                "torch._C._cuda_init", "torch._C._cuda_getDeviceCount")

_PROBE = """
import importlib, json, sys
import torch

names, preload = json.loads(sys.argv[1]), json.loads(sys.argv[2])
called = []

def recorder(name):
    def record(*args, **kwargs):
        called.append(name)
        raise RuntimeError(name + " was called while the fork server's modules were imported")
    return record

for name in names:
    owner, attr = name.rsplit(".", 1)
    module = importlib.import_module(owner)
    if owner == "torch._C" and not hasattr(module, attr):
        continue  # a build without CUDA: adding it would make torch believe it has CUDA
    setattr(module, attr, recorder(name))
try:
    torch.cuda.is_available()
except RuntimeError:
    pass
armed = called == ["torch.cuda.is_available"]
called.clear()
already = sorted(m for m in preload if m in sys.modules)
for module in preload:
    importlib.import_module(module)
print(json.dumps({"armed": armed, "called": called, "imported": [m for m in preload if m in sys.modules],
                  "already": already}))
"""


def test_the_fork_servers_imports_never_reach_cuda():
    preload = list(forkserver.PRELOAD)
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(ENTRY_POINTS), json.dumps(preload)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["armed"], "the recorders were not in place: the probe proves nothing"
    assert seen["imported"] == preload  # every module the server imports, imported here
    assert seen["called"] == [], f"the fork server's imports reached CUDA through {seen['called']}"
    # every course module, at least, was first imported with the recorders in place
    assert not [m for m in seen["already"] if m.startswith("course_utils")], seen["already"]
