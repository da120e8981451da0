"""The Slurm script of notebook 07: what it must contain, and that bash can parse it."""

import shutil
import subprocess

import pytest

from course_utils.cluster import slurm_script


def script(**kwargs):
    return slurm_script(**{"job_name": "ddp", "nodes": 2, "gpus_per_node": 4,
                           "module": "course_utils.ddp_train", **kwargs})


def test_one_agent_per_node_meeting_at_the_first_node():
    text = script(args=("--epochs", "3"), port=29501, max_restarts=2)
    assert text.startswith("#!/bin/bash\n")  # sbatch needs the interpreter line
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=32", "--nnodes=2", "--nproc-per-node=4",
                 "--rdzv-backend=c10d", '--rdzv-endpoint="$head_node:29501"',
                 '--rdzv-id="$SLURM_JOB_ID"', "--max-restarts=2",
                 "-m course_utils.ddp_train --epochs 3"):
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
    assert "-m course_utils.ddp_train --out 'my run.pt'" in script(args=("--out", "my run.pt"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_bash_can_parse_it():
    done = subprocess.run(["bash", "-n"], input=script(args=("--out", "a b")), text=True,
                          capture_output=True)
    assert done.returncode == 0, done.stderr
