"""The Slurm script of notebook 08: what it must contain, and that bash can parse it."""

import shutil
import subprocess

import pytest

from course_utils.faults.cluster import slurm_script


def script(**kwargs):
    return slurm_script(**{"job_name": "ddp", "nodes": 2, "gpus_per_node": 4,
                           "module": "course_utils.ddp.train", **kwargs})


def test_one_agent_per_node_meeting_at_the_first_node():
    text = script(args=("--epochs", "3"), port=29501, max_restarts=2)
    assert text.startswith("#!/bin/bash\n")  # sbatch needs the interpreter line
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=32", "--nnodes=2", "--nproc-per-node=4",
                 "--rdzv-backend=c10d", '--rdzv-endpoint="$head_node:29501"',
                 '--rdzv-id="$SLURM_JOB_ID"', "--max-restarts=2",
                 "-m course_utils.ddp.train --epochs 3"):
        assert line in text, line


def test_restarts_meet_in_a_fresh_store():
    assert "\nexport TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in script()


def test_the_network_interface_is_set_only_when_given():
    exports = [line for line in script().splitlines() if line.startswith("export ")]
    assert not any("SOCKET_IFNAME" in line for line in exports)  # only a commented-out hint
    given = script(network_interface="ib0").splitlines()
    assert "export GLOO_SOCKET_IFNAME=ib0" in given
    assert any(line.startswith("export NCCL_SOCKET_IFNAME=ib0") for line in given)


def test_arguments_are_quoted_for_the_shell():
    assert "-m course_utils.ddp.train --out 'my run.pt'" in script(args=("--out", "my run.pt"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_bash_can_parse_it():
    done = subprocess.run(["bash", "-n"], input=script(args=("--out", "a b")), text=True,
                          capture_output=True)
    assert done.returncode == 0, done.stderr


def test_srun_gets_the_cpus_and_the_output_folder_exists():
    text = script(cpus_per_gpu=6)
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.startswith("srun --cpus-per-task=24 torchrun")  # not inherited from sbatch
    output = next(line for line in text.splitlines() if line.startswith("#SBATCH --output="))
    path = output.split("=", 1)[1].split()[0]
    assert "/" not in path  # the submission folder: Slurm creates no folder for it
    assert "\nmkdir -p logs\n" in text  # torchrun's --log-dir under logs/


def test_preemption_and_time_limit_requeue():
    text = script(warn_seconds=120)
    assert "#SBATCH --requeue " in text
    assert "#SBATCH --signal=B:USR1@120 " in text
    assert "trap '" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_the_script_requeues_on_usr1_and_waits_for_srun(tmp_path):
    """Run it with a fake srun and scontrol: USR1 (the time-limit warning) makes the script call
    ``scontrol requeue``, and the script still waits for srun and returns its status."""
    import os
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/bash\necho "$@" > srun_args\ntouch started\n'
        'for i in $(seq 600); do [ -e requeued ] && exit 0; sleep 0.05; done\nexit 1\n')
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1" = show ]; then echo node-a; echo node-b; exit 0; fi\n'
        'echo "$@" > requeued\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "job.sh").write_text(script())
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node-[a-b]"}
    job = subprocess.Popen(["bash", "job.sh"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):  # until srun runs (a wait, not a timed assertion)
            if (tmp_path / "started").exists() or job.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "started").exists(), job.communicate(timeout=10)[0]
        job.send_signal(signal.SIGUSR1)
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "42"]
    assert "time limit near: requeueing" in out
    assert (tmp_path / "logs").is_dir()
    args = (tmp_path / "srun_args").read_text().split()
    assert args[:2] == ["--cpus-per-task=32", "torchrun"]
    assert '--rdzv-endpoint=node-a:29500' in args


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_the_script_returns_sruns_status(tmp_path):
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\nexit 3\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node-a\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node-a"}
    done = subprocess.run(["bash", "-c", script()], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3, done.stderr
