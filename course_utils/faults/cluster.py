"""What changes on a real cluster (notebook 09): a Slurm batch script for a torchrun job.

``slurm_script`` writes the script that starts one torchrun agent per node with ``srun``. The
agents meet through c10d rendezvous at the first node of the allocation; ``--rdzv-id`` is the
Slurm job id, so two jobs never join each other's rendezvous. The notebook prints the script; it
does not submit it.

Three details that bite on a real cluster, each handled in the script:

- ``srun`` is given ``--cpus-per-task`` itself: from Slurm 22.05 to 23.02 a job step did not take
  it from ``sbatch`` (23.11 reads ``SLURM_CPUS_PER_TASK`` again), and torchrun, its workers and
  their loader workers would share one core. Passed explicitly, it holds on every version.
- ``--output`` names a file in the submission folder, which exists; Slurm does not create
  folders, and ``logs/%x-%j.out`` fails before the job starts unless ``logs/`` exists.
- Preemption and time limits. A preempted job's tasks get SIGTERM at once and are killed when the
  partition's or QOS's ``GraceTime`` has passed (0 s by default: SIGTERM again, then SIGKILL
  ``KillWait`` seconds later, 30 s by default); ``--requeue`` puts the job back in the queue. For
  the time limit, ``--signal=B:USR1@S`` wakes this script S seconds early. Its trap does not
  requeue at once, which would kill the ranks before they save: it sends SIGTERM to the job's
  tasks (``scancel --signal=TERM``: the torchrun agents and their workers, not this script;
  torchrun passes it on and gives its workers ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds), waits
  for ``srun`` to end, then requeues. What the ranks do with SIGTERM is the training script's
  part: agree on a step (an all-reduce of a stop flag), save a snapshot, exit. Without that, they
  die at once and the next run resumes from the last periodic snapshot.
"""

from __future__ import annotations

import re
import shlex

from .._checks import check_int, check_positive_int

__all__ = ["slurm_script"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_MODULE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d\d:\d\d$")


def slurm_script(
    *,
    job_name: str,
    nodes: int,
    gpus_per_node: int,
    module: str,
    args: tuple[str, ...] = (),
    port: int = 29500,
    max_restarts: int = 3,
    time_limit: str = "01:00:00",
    cpus_per_gpu: int = 8,
    network_interface: str | None = None,
    warn_seconds: int = 300,
) -> str:
    """A Slurm batch script that runs ``python -m module args`` on ``nodes`` x ``gpus_per_node``.

    ``network_interface`` (for example ``"ib0"`` or ``"eth0"``) sets ``NCCL_SOCKET_IFNAME`` and
    ``GLOO_SOCKET_IFNAME``: the interface the nodes reach each other on. Without it, NCCL and
    gloo pick one themselves, which on machines with several interfaces (docker0, a management
    network) can be the wrong one and shows up as a hang at the first collective. It chooses NCCL's
    socket and bootstrap interface; which InfiniBand adapters carry the data is ``NCCL_IB_HCA``'s
    choice. ``warn_seconds``: how long before the time limit the script asks the ranks to save
    and then requeues the job; torchrun gives them three quarters of it before SIGKILL.
    """
    if not isinstance(job_name, str) or not _NAME.match(job_name):
        raise ValueError(f"job_name must be letters, digits, '_', '.' or '-', got {job_name!r}")
    nodes = check_positive_int("nodes", nodes)
    gpus_per_node = check_positive_int("gpus_per_node", gpus_per_node)
    cpus_per_gpu = check_positive_int("cpus_per_gpu", cpus_per_gpu)
    if not isinstance(module, str) or not _MODULE.match(module):
        raise ValueError(f"module must be a dotted module name such as 'course_utils.ddp.train', "
                         f"got {module!r}")
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be a tuple of strings, got {args!r}")
    port = check_int("port", port)
    if not 1024 <= port <= 65535:
        raise ValueError(f"port must be in [1024, 65535], got {port}")
    max_restarts = check_int("max_restarts", max_restarts)
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if not isinstance(time_limit, str) or not _TIME.match(time_limit):
        raise ValueError(f"time_limit must look like 'HH:MM:SS' or 'D-HH:MM:SS', got {time_limit!r}")
    warn_seconds = check_positive_int("warn_seconds", warn_seconds)
    if network_interface is not None and (not isinstance(network_interface, str)
                                          or not _NAME.match(network_interface)):
        raise ValueError(f"network_interface must be an interface name such as 'ib0', "
                         f"got {network_interface!r}")

    interface = (
        f"export NCCL_SOCKET_IFNAME={network_interface}  # NCCL's sockets and bootstrap, not its IB path\n"
        f"export GLOO_SOCKET_IFNAME={network_interface}\n"
        if network_interface else
        "# export NCCL_SOCKET_IFNAME=ib0  # set it when the nodes have several interfaces\n"
    )
    cpus = cpus_per_gpu * gpus_per_node
    signal_line = f"#SBATCH --signal=B:USR1@{warn_seconds}"
    grace = max(1, warn_seconds * 3 // 4)  # the rest: for srun to end and for the requeue
    script_args = " ".join(shlex.quote(a) for a in args)
    return f"""#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1            # one torchrun agent per node; it starts the workers
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --cpus-per-task={cpus}
#SBATCH --time={time_limit}
#SBATCH --output=%x-%j.out             # job name and id, in the submission folder (which exists)
#SBATCH --requeue                      # preempted: back in the queue, and resumed from the snapshot
{signal_line:<39}# USR1 to this script {warn_seconds} s before the time limit

set -euo pipefail
# The first node of the allocation hosts the rendezvous; every agent is told its address.
# (sed reads the whole list: `head -n 1` could end scontrol with SIGPIPE, fatal under pipefail)
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
{interface}export NCCL_DEBUG=WARN                 # INFO while bringing a cluster up
# A restart meets in a fresh store: the agents' restart counts can differ between nodes.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# How long torchrun lets its workers finish after passing them SIGTERM, before SIGKILL (torch
# releases with torchrun --shutdown-timeout read it; older ones wait 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace}
export OMP_NUM_THREADS={cpus_per_gpu}
mkdir -p logs

# Near the time limit: ask the ranks to save, wait until they have stopped, then requeue (the next
# run resumes from the snapshot). `scancel --signal` reaches every task of the job's steps (the
# torchrun agents and their workers) but not this script; torchrun passes SIGTERM on to its
# workers. Not `kill` srun: srun answers SIGTERM by killing its tasks.
stopping=0
ask_ranks_to_save() {{
    stopping=1
    echo "time limit near: asking the ranks to save"
    scancel --signal=TERM "$SLURM_JOB_ID" || true
}}
trap ask_ranks_to_save USR1

# srun gets the CPUs itself: Slurm 22.05 to 23.02 did not pass sbatch's --cpus-per-task on to a
# job step (23.11 does again); given here, it holds on every version.
srun --cpus-per-task={cpus} torchrun \\
    --nnodes={nodes} \\
    --nproc-per-node={gpus_per_node} \\
    --rdzv-backend=c10d \\
    --rdzv-endpoint="$head_node:{port}" \\
    --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts={max_restarts} \\
    --log-dir="logs/$SLURM_JOB_ID" --redirects=3 \\
    -m {module}{' ' + script_args if script_args else ''} &
agents=$!
status=0
wait "$agents" || status=$?
if [ "$stopping" = 1 ]; then  # the trap ended that wait, not srun: wait for the ranks to stop
    status=0
    wait "$agents" || status=$?
    echo "the ranks have stopped: requeueing"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""
