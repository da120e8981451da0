"""50 launches in a row of a 2-rank DDP training, in one process (`make stress`).

Kept out of `make test` (about 25 s on 2 cores, ranks forked from the fork server) and run by CI
after it. Every launch must succeed, give both ranks identical parameters, and leave no process
behind.
"""

import pytest
import torch
from conftest import rank_processes

from course_utils.ddp_train import TrainConfig, train_ddp
from course_utils.distributed import launch

pytestmark = pytest.mark.stress


def test_fifty_ddp_launches_in_a_row():
    config = TrainConfig(data_size=48, global_batch_size=16, epochs=1)
    first = None
    for attempt in range(50):
        results = launch(train_ddp, 2, config, echo=False, timeout_s=60)
        params = results[0]["params"]
        for name in params:
            assert torch.equal(params[name], results[1]["params"][name]), (attempt, name)
            if first is not None:
                assert torch.equal(params[name], first[name]), (attempt, name)
        first = first or params
        alive = rank_processes()
        assert alive == [], (attempt, alive)
