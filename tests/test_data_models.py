import importlib

import pytest
import torch

from course_utils.data import RandomDataset, make_loader, regression_dataset
from course_utils.models import Model


def test_random_dataset_is_seeded():
    a, b, c = RandomDataset(5, 100), RandomDataset(5, 100), RandomDataset(5, 100, seed=1)
    assert len(a) == 100 and a[0].shape == (5,)
    assert torch.equal(a.data, b.data)
    assert not torch.equal(a.data, c.data)
    assert repr(a) == "RandomDataset(size=5, length=100)"


@pytest.mark.parametrize("args, error", [((0, 10), ValueError), ((5, -1), ValueError),
                                         ((5.0, 10), TypeError), ((5, "10"), TypeError)])
def test_random_dataset_rejects_bad_sizes(args, error):
    with pytest.raises(error):
        RandomDataset(*args)


def test_make_loader_shuffles_the_same_way_every_time():
    ds = RandomDataset(5, 100)
    first = [batch.clone() for batch in make_loader(ds, 30, seed=0)]
    again = [batch.clone() for batch in make_loader(ds, 30, seed=0)]
    other = [batch.clone() for batch in make_loader(ds, 30, seed=1)]
    assert [len(b) for b in first] == [30, 30, 30, 10]
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(ds, 0)


def test_regression_dataset_knows_its_truth():
    ds, w, b = regression_dataset(64, 5, 2, noise=0.0, seed=3)
    x, y = ds.tensors
    assert x.shape == (64, 5) and y.shape == (64, 2) and w.shape == (2, 5) and b.shape == (2,)
    torch.testing.assert_close(y, x @ w.T + b)
    with pytest.raises(ValueError, match="noise"):
        regression_dataset(64, 5, 2, noise=-1)


def test_model_reports_sizes_like_the_tutorial():
    lines = []
    model = Model(5, 2, report=lines.append)
    out = model(torch.randn(7, 5))
    assert out.shape == (7, 2)
    assert lines == ["\tIn Model: input size torch.Size([7, 5]) output size torch.Size([7, 2])"]


def test_model_prints_by_default_and_can_be_quiet(capsys):
    Model(5, 2)(torch.randn(3, 5))
    assert capsys.readouterr().out == (
        "\tIn Model: input size torch.Size([3, 5]) output size torch.Size([3, 2])\n")
    Model(5, 2, report=None)(torch.randn(3, 5))
    assert capsys.readouterr().out == ""


def test_model_rejects_bad_arguments():
    with pytest.raises(ValueError):
        Model(0, 2)
    with pytest.raises(TypeError, match="report must be callable"):
        Model(5, 2, report="print")


def test_slow_dataset():
    import time

    from course_utils.data import SlowDataset

    ds = SlowDataset(4, 0.01, work="cpu", size=3)
    start = time.process_time()
    item = ds[2]
    assert time.process_time() - start >= 0.01
    assert item.tolist() == [2.0, 2.0, 2.0] and len(ds) == 4
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(ValueError, match="work"):
        SlowDataset(4, 0.01, work="gpu")
    with pytest.raises(ValueError, match="seconds"):
        SlowDataset(4, -1)


# The course's seeded model factories: each builds under models.seeded, so each gives the same weights
# every time and leaves the caller's random numbers as they were (four of them used to reseed them).
FACTORIES = {
    "ddp.train.make_model": lambda m: m.make_model(m.TrainConfig()),
    "faults.crashes.demo_model": lambda m: m.demo_model(),
    "sharding.strategies.mlp": lambda m: m.mlp(16),
    "debugging.training_bugs.small_model": lambda m: m.small_model(),
    "sharding.runs.toy_model": lambda m: m.toy_model(),
    "debugging.failure_zoo._classifier": lambda m: m._classifier(),
}


def _build(name):
    return FACTORIES[name](importlib.import_module(f"course_utils.{name.rsplit('.', 1)[0]}"))


@pytest.mark.parametrize("name", FACTORIES)
def test_seeded_factories_repeat_their_weights_and_leave_the_global_generator_alone(name):
    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    first = _build(name).state_dict()
    assert torch.equal(torch.rand(3), expected_next), f"{name} drew from or reseeded the global generator"
    second = _build(name).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_seeded_builds_under_its_seed_only():
    from torch import nn

    from course_utils.models import seeded

    torch.manual_seed(0)
    reference = nn.Linear(3, 2)
    torch.manual_seed(99)
    state = torch.random.get_rng_state()
    built = seeded(0, lambda: nn.Linear(3, 2))
    assert torch.equal(built.weight, reference.weight) and torch.equal(built.bias, reference.bias)
    assert torch.equal(torch.random.get_rng_state(), state)
