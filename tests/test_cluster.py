"""The Slurm script of notebook 09: what it must contain, and that bash can parse it."""

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


def test_srun_gets_the_cpus_on_every_slurm_version_and_the_output_folder_exists():
    text = script(cpus_per_gpu=6)
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.startswith("srun --cpus-per-task=24 torchrun")  # not inherited from sbatch
    output = next(line for line in text.splitlines() if line.startswith("#SBATCH --output="))
    path = output.split("=", 1)[1].split()[0]
    assert "/" not in path  # the submission folder: Slurm creates no folder for it
    assert "\nmkdir -p logs\n" in text  # torchrun's --log-dir under logs/


def test_preemption_and_time_limit_requeue_after_the_ranks_save():
    text = script(warn_seconds=120)
    assert "#SBATCH --requeue " in text
    assert "#SBATCH --signal=B:USR1@120 " in text
    assert "\nexport TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90\n" in text  # three quarters of the warning
    trap = text[text.index("ask_ranks_to_save() {"):text.index("trap ask_ranks_to_save USR1")]
    # the trap asks the tasks (not this script, not srun) to stop; it requeues nothing itself
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in trap and "requeue" not in trap
    assert "kill" not in trap  # srun answers SIGTERM by killing its tasks
    tail = text[text.index("agents=$!"):]
    assert tail.index('wait "$agents"', tail.index('if [ "$stopping" = 1 ]')) \
        < tail.index('scontrol requeue "$SLURM_JOB_ID"')  # requeue once srun has ended


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_on_usr1_the_ranks_save_first_and_the_job_is_requeued_after(tmp_path):
    """Run it with a fake srun (two "ranks" that take a moment to save on SIGTERM), scancel (which
    signals the ranks, as slurmstepd signals a step's tasks) and scontrol: USR1 (the time-limit
    warning) makes the ranks save, and only once srun has ended does the script requeue the job."""
    import os
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A rank says it is ready once its trap is set: a SIGTERM that reached it before would kill it
    # unsaved (seen on a loaded machine), which is the test racing itself, not the script.
    rank = ('trap \'sleep 0.5; echo saved > saved.$1; exit 0\' TERM\n'
            'touch ready.$1\n'
            'while true; do sleep 0.05; done\n')
    (tmp_path / "rank.sh").write_text(rank)
    (bin_dir / "srun").write_text(
        '#!/bin/bash\necho "$@" > srun_args\n'
        'for r in 0 1; do bash rank.sh $r & echo $! >> ranks; done\n'
        'for _ in $(seq 600); do [ -e ready.0 ] && [ -e ready.1 ] && break; sleep 0.05; done\n'
        'touch started\nwait\nexit 0\n')
    (bin_dir / "scancel").write_text('#!/bin/bash\necho "$@" > scancel_args\nkill -TERM $(cat ranks)\n')
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1" = show ]; then echo node-a; echo node-b; exit 0; fi\n'
        'echo "$@ after $(ls saved.* 2>/dev/null | tr \'\\n\' \' \')" > requeued\n')
    for tool in ("srun", "scancel", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "job.sh").write_text(script())
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node-[a-b]"}
    job = subprocess.Popen(["bash", "job.sh"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for _ in range(600):  # until srun runs (a wait, not a timed assertion)
            if (tmp_path / "started").exists() or job.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "started").exists(), job.communicate(timeout=10)[0]
        job.send_signal(signal.SIGUSR1)
        out, _ = job.communicate(timeout=60)
    finally:  # a job still running: it, its fake srun and its ranks (which loop until signalled)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, out
    assert (tmp_path / "scancel_args").read_text().split() == ["--signal=TERM", "42"]
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "42", "after", "saved.0", "saved.1"]
    assert out.index("asking the ranks to save") < out.index("the ranks have stopped: requeueing")
    assert (tmp_path / "logs").is_dir()
    args = (tmp_path / "srun_args").read_text().split()
    assert args[:2] == ["--cpus-per-task=32", "torchrun"]
    assert '--rdzv-endpoint=node-a:29500' in args


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_without_the_warning_nothing_is_requeued(tmp_path):
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\nexit 0\n")
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1" = show ]; then echo node-a; exit 0; fi\ntouch requeued\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node-a"}
    done = subprocess.run(["bash", "-c", script()], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "requeued").exists()


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
