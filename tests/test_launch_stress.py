"""Launches in a row, in one process (`make stress`): 50 of a 2-rank DDP training, then 20 of a
function sent by value and 20 of the DDP tutorial's demo_basic making its own group on a fixed
port (init="none").

Kept out of `make test` (about 25 s + 30 s on 2 cores, ranks forked from the fork server) and run
by CI after it. Every launch must succeed, give both ranks identical parameters, and leave no
process behind.
"""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import rank_processes, recording_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils.ddp.train import TrainConfig, train_ddp
from course_utils.distributed import free_port, launch

pytestmark = pytest.mark.stress


@pytest.fixture
def left_behind():
    """What the launches so far left running: this process's children, and the ranks (forked ones
    descend from the session's fork server, not from here) with what they started."""
    with recording_ranks() as ranks:
        yield lambda: rank_processes() + ranks.alive()


def test_fifty_ddp_launches_in_a_row(left_behind):
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
        alive = left_behind()
        assert alive == [], (attempt, alive)


def test_twenty_launches_of_a_function_sent_by_value(left_behind):
    config = TrainConfig(data_size=48, global_batch_size=16, epochs=1)

    def closure(rank, world_size):  # a local function: sent by value, config with it
        return train_ddp(rank, world_size, config)["params"]

    first = None
    for attempt in range(20):
        params = launch(closure, 2, echo=False, timeout_s=60)
        for name in params[0]:
            assert torch.equal(params[0][name], params[1][name]), (attempt, name)
        first = first or params[0]
        assert all(torch.equal(first[n], params[0][n]) for n in first), attempt
        assert left_behind() == [], attempt


def test_twenty_launches_of_the_tutorials_demo_basic_on_a_fixed_port(left_behind):
    port = free_port()

    def demo_basic(rank, world_size):  # the PyTorch DDP tutorial's, setup and cleanup inlined
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
        ddp_model = DDP(model)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
        nn.MSELoss()(ddp_model(torch.randn(20, 10)), torch.randn(20, 5)).backward()
        optimizer.step()
        dist.destroy_process_group()
        return model[0].weight.detach().clone()

    for attempt in range(20):
        weights = launch(demo_basic, 2, init="none", echo=False, timeout_s=60)
        assert torch.equal(weights[0], weights[1]), attempt
        assert left_behind() == [], attempt
