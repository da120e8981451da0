"""Run a training script under torchrun from a notebook, on one node or as several (notebook 09).

``torchrun(module, N, *args)`` runs ``python -m torch.distributed.run --nproc-per-node=N -m module``
(torchrun itself, without relying on the ``torchrun`` script being on the kernel's PATH) and
returns what its workers printed, apart from the agent's logs. ``torchrun_nodes`` starts several
agents on this machine that meet through c10d rendezvous, as nodes would. ``init_from_torchrun``
is what a worker calls to join its group safely across restarts.

torchrun's workers are always fresh interpreters (``python -m module``), on every system, so the
fork server and ``COURSE_START`` play no part here. On Windows, whose torch builds lack libuv, the
agent runs through ``compat.run_torchrun_without_libuv`` (torchrun has no option for its
rendezvous stores), with ``USE_LIBUV=0`` for every other store, and ``init_from_torchrun`` asks
for a store without libuv (``compat.tcp_store_options``).
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from .._checks import check_positive_int, check_seconds
from ..compat import tcp_store_options
from ..devices import emulated_node_env, init_kwargs, local_rank
from ..distributed import LaunchTimeout, free_port
from ..launcher.processes import kill_tree

__all__ = ["TorchrunResult", "init_from_torchrun", "is_log_line", "torchrun", "torchrun_nodes"]


def init_from_torchrun(backend: str, timeout_s: float = 300.0) -> None:
    """``init_process_group`` for a worker that torchrun started, safe across restarts.

    By default torchrun's agent hosts a TCPStore and hands its address to the workers
    (``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``). That store outlives
    a restart, and so do the keys the dead attempt's ranks wrote into it: a restarted rank can
    read a dead rank's address and wait for it forever. Prefixing the store with the attempt
    number (``TORCHELASTIC_RESTART_COUNT``) gives every attempt clean keys, which is right on one
    node. With several nodes it is not: each agent counts its own restarts, and an agent that
    restarts because a peer node did does not count it, so the prefixes can differ. For those
    jobs set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun (``torchrun_nodes`` and
    ``cluster.slurm_script`` do): then rank 0 hosts a fresh store every attempt, and it is used
    without a prefix. Outside torchrun this is plain ``env://``.
    """
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout_s = check_seconds("timeout_s", timeout_s)
    bind = init_kwargs(backend, local_rank())  # NCCL: this process's GPU, before any CUDA work
    # region: restarts
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, init_method="env://", **bind)
        return
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as missing:
        raise RuntimeError(f"torchrun's environment lacks {missing}") from None
    timeout = datetime.timedelta(seconds=timeout_s)
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not hosted_by_agent,
                          timeout=timeout, **tcp_store_options())  # Windows: use_libuv=False
    if hosted_by_agent:  # a store that outlives restarts: clean keys for every attempt
        store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **bind)
    # endregion



@dataclass
class TorchrunResult:
    """What a torchrun agent left: its exit code, its workers' printed lines, and its logs.

    ``lines`` holds what the workers printed; ``log_lines`` holds the agent's and c10d's log
    records (timestamps, PIDs), the ``[rankN]:`` tracebacks torchrun relays from failed
    workers, and the C++ runtime's "terminate called ..." from workers stopped mid-collective.
    ``restarts`` counts the agent's "will restart worker group" decisions.
    """

    command: list[str]
    returncode: int
    lines: list[str]
    log_lines: list[str]

    @property
    def restarts(self) -> int:
        return sum("will restart worker group" in line for line in self.log_lines)

    def agent_events(self) -> list[str]:
        """The agent's decisions, without timestamps, PIDs or paths (needs ``LOGLEVEL=INFO``).

        Each rendezvous's ``restart_count``, every restart decision and the final outcome:
        enough to follow a restart, and the same on every run.
        """
        events = []
        for line in self.log_lines:
            message = line.split("] ", 1)[1].strip() if _AGENT_LOG.match(line) else ""
            if not message.startswith(_AGENT_EVENTS):
                continue
            events.append(re.sub(r"\. Waiting \d+ seconds.*$", ".", message))
        return events


_AGENT_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ \S+\] ")
# Only decisions that do not depend on timing: which rank the agent reports as the first failure
# depends on how fast the survivors notice, so "failed (exitcode ...)" is left to log_lines.
_AGENT_EVENTS = ("[default] Worker group FAILED", "restart_count=",
                 "[default] worker group successfully finished")
# Log records, tracebacks torchrun relays from failed workers, and what the C++ runtime prints
# when a process it is tearing down still has a live thread (a surviving rank that the agent
# stops after another rank died prints it in some runs and not others).
_LOG_LINE = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d|^\[rank\d+\]:|^\[[IWE]\d"
                       r"|^terminate called (without an active exception|after throwing)")
# The lines that follow a log record when it carries a C++ exception: its backtrace (a warning of
# the store client when the rendezvous store closes first, under load, in some runs and not others).
_BACKTRACE = re.compile(r"^Exception raised from |^frame #\d+: |^<omitting python frames>$|^$")


def _split_logs(lines: list[str]) -> tuple[list[str], list[str]]:
    """(a worker's prints, the log records with the backtrace lines that follow one)."""
    prints, logs, in_log = [], [], False
    for line in lines:
        in_log = bool(_LOG_LINE.match(line)) or (in_log and bool(_BACKTRACE.match(line)))
        (logs if in_log else prints).append(line)
    return prints, logs


def is_log_line(line: str) -> bool:
    """Whether a line of a torchrun job's output is a log record rather than a worker's print."""
    if not isinstance(line, str):
        raise TypeError(f"line must be a str, got {type(line).__name__}")
    return bool(_LOG_LINE.match(line))


def _torchrun_command(module: str, nproc_per_node: int, script_args: tuple,
                      launcher_args: tuple[str, ...]) -> list[str]:
    if not isinstance(module, str) or not module:
        raise TypeError(f"module must be a module name such as 'course_utils.ddp.train', got {module!r}")
    nproc_per_node = check_positive_int("nproc_per_node", nproc_per_node)
    return [*_agent(), *launcher_args, f"--nproc-per-node={nproc_per_node}", "-m", module,
            *map(str, script_args)]


#: torchrun on Windows: the agent with rendezvous stores that leave out libuv, which torch's
#: Windows builds lack (elsewhere ``-m torch.distributed.run``, as the ``torchrun`` script runs)
WINDOWS_AGENT = "from course_utils.compat import run_torchrun_without_libuv; run_torchrun_without_libuv()"


def _agent() -> list[str]:
    if sys.platform == "win32":
        return [sys.executable, "-c", WINDOWS_AGENT]
    return [sys.executable, "-m", "torch.distributed.run"]


def _agent_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if sys.platform == "win32":
        env.setdefault("USE_LIBUV", "0")  # the stores torch makes from this variable: no libuv
    return env


def _start(command: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=_agent_env(extra_env), start_new_session=True,
                            text=True)


def _finish(processes: list[subprocess.Popen], commands: list[list[str]],
            timeout_s: float) -> list[TorchrunResult]:
    deadline = time.monotonic() + timeout_s
    outputs = []
    try:
        for process in processes:
            try:
                out, _ = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in processes:
                    kill_tree(p)
                try:
                    tail = process.communicate(timeout=10)[0].splitlines()[-20:]
                except subprocess.TimeoutExpired:  # pragma: no cover - something still holds the pipe
                    tail = ["(no output: the pipe is still held open)"]
                raise LaunchTimeout(f"torchrun did not finish within {timeout_s:g} s and was "
                                    "killed.\n" + "\n".join(tail)) from None
            outputs.append(out)
    finally:
        for p in processes:
            kill_tree(p)  # any worker an agent left behind
    results = []
    for command, process, out in zip(commands, processes, outputs, strict=True):
        prints, logs = _split_logs(out.splitlines())
        results.append(TorchrunResult(command, process.returncode, prints, logs))
    return results


def _check_launcher(launcher_args: Any, env: Any) -> None:
    if isinstance(launcher_args, str) or not all(isinstance(a, str) for a in launcher_args):
        raise TypeError(f"launcher_args must be a tuple of strings, got {launcher_args!r}")
    if env is not None and not (isinstance(env, dict)
                                and all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in env.items())):
        raise TypeError(f"env must be a dict of strings to strings, got {env!r}")


def torchrun(module: str, nproc_per_node: int, *script_args: str, timeout_s: float = 180.0,
             launcher_args: tuple[str, ...] = ("--standalone",),
             env: dict[str, str] | None = None) -> TorchrunResult:
    """Run ``python -m torch.distributed.run LAUNCHER_ARGS --nproc-per-node=N -m MODULE ARGS``.

    ``sys.executable -m torch.distributed.run`` is torchrun itself, without relying on the
    ``torchrun`` script being on the kernel's PATH (on Windows, the same agent through
    ``compat.run_torchrun_without_libuv``: Windows' torch builds lack libuv). ``env`` adds
    environment variables (for example ``LOGLEVEL=INFO``, which makes the agent log its restart
    decisions). The job runs in its own process session; if it outlives ``timeout_s`` the whole
    session is killed and :class:`LaunchTimeout` is raised.
    """
    timeout_s = check_seconds("timeout_s", timeout_s)
    _check_launcher(launcher_args, env)
    command = _torchrun_command(module, nproc_per_node, script_args, launcher_args)
    return _finish([_start(command, env)], [command], timeout_s)[0]


def torchrun_nodes(module: str, nnodes: int, nproc_per_node: int, *script_args: str,
                   timeout_s: float = 180.0, job_id: str = "course",
                   launcher_args: tuple[str, ...] = (),
                   env: dict[str, str] | None = None) -> list[TorchrunResult]:
    """Start ``nnodes`` torchrun agents on this machine, as if each were a separate node.

    They meet through c10d rendezvous at ``127.0.0.1:PORT`` (a free port), exactly as agents on
    different machines would meet at the first node's address, with ``--nnodes=N``.
    ``launcher_args`` are added to each agent's (``--max-restarts=1``, say), and ``env`` to its
    environment. Every agent runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, so that a
    restart meets in a fresh store (see ``init_from_torchrun``). The agents share this machine's
    GPUs: each node gets a slice of its own when there is a GPU for every rank, else all use gloo
    (``devices.emulated_node_env``). Returns one result per agent.
    """
    nnodes = check_positive_int("nnodes", nnodes)
    timeout_s = check_seconds("timeout_s", timeout_s)
    _check_launcher(launcher_args, env)
    if not isinstance(job_id, str) or not re.fullmatch(r"[\w.-]+", job_id):
        raise ValueError(f"job_id must be a non-empty name of letters, digits, '_', '.' or '-', "
                         f"got {job_id!r}")
    endpoint = f"127.0.0.1:{free_port()}"
    launcher = (f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={job_id}", *launcher_args)
    commands = [_torchrun_command(module, nproc_per_node, script_args, launcher)
                for _ in range(nnodes)]
    agent_envs = [{**emulated_node_env(node, nnodes, nproc_per_node), **(env or {}),
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} for node in range(nnodes)]
    return _finish([_start(c, e) for c, e in zip(commands, agent_envs, strict=True)], commands,
                   timeout_s)
