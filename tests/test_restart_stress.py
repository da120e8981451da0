"""Ten torchrun restarts in a row (`make stress`): the restart path must not be flaky.

A restarted attempt once hung in gloo's connectFullMesh when it read a dead attempt's keys from
torchrun's store (fixed by ``init_from_torchrun``). A failure that shows up one run in twenty needs
many runs to be seen; test_restarts kills at five steps, this kills at ten more, alternating ranks.
"""

import pytest
import torch
from test_restarts import JOB, RESTARTS, processes_mentioning

from course_utils.faults.torchrun import torchrun

pytestmark = pytest.mark.stress


def test_ten_restarts_in_a_row(tmp_path):
    reference = torchrun("course_utils.ddp.train", 2, "--out", tmp_path / "reference.pt", *JOB)
    assert reference.returncode == 0, reference.lines + reference.log_lines
    expected = torch.load(tmp_path / "reference.pt")
    for run in range(10):
        kill_rank, kill_at_step = run % 2, [1, 2, 4, 5, 8, 9, 10, 3, 6, 11][run]
        folder = tmp_path / f"run{run}"
        folder.mkdir()
        job = torchrun("course_utils.ddp.train", 2, "--out", folder / "p.pt",
                       "--snapshot", folder / "s.pt", "--snapshot-every", "2",
                       "--kill-rank", kill_rank, "--kill-at-step", kill_at_step, *JOB,
                       launcher_args=RESTARTS, env={"LOGLEVEL": "INFO"}, timeout_s=120)
        assert job.returncode == 0 and job.restarts == 1, (run, job.lines, job.log_lines[-30:])
        params = torch.load(folder / "p.pt")
        assert all(torch.equal(params[k], v) for k, v in expected.items()), run
        assert processes_mentioning(str(folder)) == [], run
