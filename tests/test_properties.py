"""Property-based tests (hypothesis): the split rule, scatter and gather, the ledger, snapshots.

Each property is checked on many generated cases instead of a few chosen ones. The profile is
derandomized, so `make test` checks the same cases on every run and a failure reproduces.
"""

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from course_utils.dataparallel.by_hand import gather, scatter
from course_utils.dataparallel.memory import CATEGORIES, STRATEGIES, ModelSpec, ledger
from course_utils.dataparallel.simulated import sim_devices
from course_utils.dataparallel.splits import epoch_splits, split_sizes
from course_utils.faults.snapshots import load_snapshot, save_snapshot

settings.register_profile("course", derandomize=True, database=None, max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("course")

device_counts = st.integers(min_value=1, max_value=16)


@given(st.integers(1, 200), st.integers(1, 64), device_counts, st.booleans())
def test_epoch_splits_cover_the_data_once(data_size, batch_size, num_devices, drop_last):
    if drop_last and data_size < batch_size:  # no batch at all: refused, with a clear message
        with pytest.raises(ValueError, match="leaves no batch"):
            epoch_splits(data_size, batch_size, num_devices, drop_last=True)
        return
    batches = epoch_splits(data_size, batch_size, num_devices, drop_last=drop_last)
    expected = data_size // batch_size * batch_size if drop_last else data_size
    assert sum(map(sum, batches)) == expected
    assert all(split == split_sizes(sum(split), num_devices) for split in batches)


shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3)


@given(shapes, st.integers(1, 6), st.data())
def test_scatter_then_gather_is_the_identity(shape, n, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    devices = sim_devices(n)
    parts = scatter(x, devices, dim)
    assert [p.shape[dim] for p in parts] == split_sizes(shape[dim], n)
    assert torch.equal(gather(parts, devices[0], dim), x)


@given(st.integers(2, 12), st.integers(1, 4), st.integers(1, 5))
def test_scatter_walks_nested_inputs_and_keeps_the_rest(rows, n, width):
    n = min(n, rows)
    x, y = torch.randn(rows, width), torch.randn(rows)
    parts = scatter(({"x": x, "flag": "keep"}, [y, 3]), sim_devices(n))
    assert len(parts) == len(split_sizes(rows, n))
    assert torch.equal(torch.cat([p[0]["x"] for p in parts]), x)
    assert torch.equal(torch.cat([p[1][0] for p in parts]), y)
    assert all(p[0]["flag"] == "keep" and p[1][1] == 3 for p in parts)


specs = st.builds(
    ModelSpec, name=st.just("generated"), parameters=st.integers(1, 10**8),
    activation_floats=st.floats(0, 1e6), activation_other_bytes=st.floats(0, 1e6),
    inputs=st.integers(1, 10**5), input_itemsize=st.sampled_from([1, 2, 4, 8]),
    outputs=st.integers(1, 10**5), targets=st.integers(1, 10**5),
    target_itemsize=st.sampled_from([1, 2, 4, 8]), loss_saved_floats=st.integers(0, 10**4),
)


@given(specs, st.sampled_from(STRATEGIES), st.integers(1, 512), st.integers(2, 8), st.data())
def test_ledger_invariants(spec, strategy, batch_size, num_devices, data):
    output_device = data.draw(st.integers(0, num_devices - 1)) if strategy == "dp" else 0
    if strategy == "ddp":
        batch_size = max(1, batch_size // num_devices) * num_devices  # DDP needs equal shards
    book = ledger(spec, strategy, batch_size=batch_size, num_devices=num_devices,
                  output_device=output_device)
    assert len(book.rows) == num_devices
    assert sum(book.rows_per_device) == batch_size
    for row in book.rows:
        assert set(row) == set(CATEGORIES) and all(v >= 0 for v in row.values())
    # every device that computes holds a full copy of the parameters and their gradients
    working = [row for row, r in zip(book.rows, book.rows_per_device, strict=True) if r]
    assert len({(row["parameters"], row["gradients"]) for row in working}) == 1
    # the optimizer's state lives on device 0 only, unless every rank has its own (DDP)
    holders = [d for d, row in enumerate(book.rows) if row["optimizer state"]]
    assert holders == (list(range(num_devices)) if strategy == "ddp" else [0])
    if strategy == "ddp":
        # balanced: two devices with the same number of rows hold the same bytes
        for a in range(num_devices):
            for b in range(num_devices):
                if book.rows_per_device[a] == book.rows_per_device[b]:
                    assert book.total(a) == book.total(b)
    if strategy == "dp":
        base = ledger(spec, "dp", batch_size=batch_size, num_devices=num_devices)
        # with the default output_device=0, device 0 holds the most
        assert all(base.total(0) >= base.total(d) for d in range(num_devices))
        # output_device=k moves exactly the gathered outputs, their gradient, the targets and
        # the loss from device 0 to device k; nothing else changes
        moved = ("outputs", "output gradient", "targets", "loss")
        for d in range(num_devices):
            for c in CATEGORIES:
                if c not in moved:
                    assert book.rows[d][c] == base.rows[d][c]
        for c in moved:
            assert book.rows[output_device][c] == base.rows[0][c]
            assert sum(r[c] for r in book.rows) == sum(r[c] for r in base.rows)


def assert_same_state(a, b, where="state"):
    """Equal structure, equal plain values, and tensors equal bit for bit (printing rounds)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 1000), st.integers(0, 50),
       st.dictionaries(st.text("abcdef", min_size=1, max_size=4), st.integers() | st.text(max_size=5),
                       max_size=3),
       st.booleans())
def test_snapshot_round_trip(inputs, outputs, global_step, step_in_epoch, extra, momentum):
    model = nn.Linear(inputs, outputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if momentum else 0.0)
    model(torch.randn(3, inputs)).sum().backward()
    optimizer.step()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "s.pt"
        save_snapshot(path, model, optimizer, epoch=global_step // 7, step_in_epoch=step_in_epoch,
                      global_step=global_step, extra=extra)
        after_save = torch.rand(4)
        copy = nn.Linear(inputs, outputs)
        copy_optimizer = torch.optim.SGD(copy.parameters(), lr=0.1, momentum=0.9 if momentum else 0.0)
        info = load_snapshot(path, copy, copy_optimizer)
        assert [p.name for p in Path(folder).iterdir()] == ["s.pt"]  # no temporary file left
    assert (info.epoch, info.step_in_epoch, info.global_step) == (
        global_step // 7, step_in_epoch, global_step)
    assert info.extra == extra
    for key, value in model.state_dict().items():
        assert torch.equal(copy.state_dict()[key], value)
    assert_same_state(copy_optimizer.state_dict(), optimizer.state_dict())
    assert torch.equal(torch.rand(4), after_save)  # the generator is back where it was saved
