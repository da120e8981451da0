import threading
from collections import namedtuple

import pytest
import torch
from torch import nn

from course_utils.dataparallel.by_hand import (
    DataParallelByHand,
    data_parallel,
    gather,
    parallel_apply,
    replicate,
    scatter,
    scatter_kwargs,
)
from course_utils.dataparallel.evidence import compare_training, time_steps
from course_utils.dataparallel.simulated import SimDevice, course_devices, parse_devices, sim_devices
from course_utils.dataparallel.splits import split_sizes
from course_utils.models import SequenceGRU, SmallCNN

Pair = namedtuple("Pair", "a b")


# ----------------------------------------------------------------------------- devices


def test_device_parsing():
    assert parse_devices(["sim:0", SimDevice(2)]) == [SimDevice(0), SimDevice(2)]
    assert str(SimDevice(3)) == "sim:3"
    assert course_devices(3) == sim_devices(3) or torch.cuda.device_count() >= 3


@pytest.mark.parametrize("bad, error, message", [
    ([], ValueError, "device_ids is empty"),
    (["gpu:0"], ValueError, "unknown device 'gpu:0'"),
    (["cpu"], ValueError, "expected a CUDA or simulated device"),
    ([torch.device("cpu")], ValueError, "expected a CUDA or simulated device"),
    (["sim:0", "sim:0"], ValueError, "repeats a device"),
    ("sim:0", TypeError, "must be a list"),
    ([1.5], TypeError, "a device must be"),
    ([True], TypeError, "a device must be"),
])
def test_bad_device_lists(bad, error, message):
    with pytest.raises(error, match=message):
        parse_devices(bad)


@pytest.mark.skipif(torch.cuda.device_count() > 8, reason="needs fewer than 9 GPUs")
def test_missing_cuda_device_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cuda:8 is not available .* use simulated devices"):
        parse_devices([8])
    with pytest.raises(ValueError, match="cuda:8 is not available"):
        parse_devices(["cuda:8"])


# ----------------------------------------------------------------------------- scatter


@pytest.mark.parametrize("batch, n", [(30, 2), (30, 3), (30, 4), (30, 8), (10, 8), (9, 4)])
def test_scatter_follows_the_split_rule(batch, n):
    x = torch.arange(batch * 2.0).view(batch, 2)
    chunks = scatter(x, sim_devices(n))
    assert [len(c) for c in chunks] == split_sizes(batch, n)
    torch.testing.assert_close(torch.cat(chunks), x)


def test_scatter_first_chunk_is_a_view_the_others_copies():
    x = torch.randn(12, 3)
    chunks = scatter(x, sim_devices(3))
    assert chunks[0].data_ptr() == x.data_ptr()
    assert all(c.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for c in chunks[1:])


def test_scatter_along_dim_1():
    x = torch.randn(5, 9, 2)
    chunks = scatter(x, sim_devices(3), dim=1)
    assert [c.shape for c in chunks] == [torch.Size([5, 3, 2])] * 3


def test_scatter_walks_nested_containers_and_copies_non_tensors():
    x, y = torch.randn(6, 2), torch.randn(6)
    inputs = (x, [y, "label"], {"mask": x > 0, "scale": 2.0}, Pair(x, 7))
    out = scatter(inputs, sim_devices(3))
    assert len(out) == 3
    for i, part in enumerate(out):
        px, (py, label), d, pair = part
        torch.testing.assert_close(px, x[2 * i: 2 * i + 2])
        torch.testing.assert_close(py, y[2 * i: 2 * i + 2])
        assert label == "label" and d["scale"] == 2.0
        torch.testing.assert_close(d["mask"], (x > 0)[2 * i: 2 * i + 2])
        assert isinstance(pair, Pair) and pair.b == 7
        torch.testing.assert_close(pair.a, px)


def test_scatter_kwargs_pads_and_splits():
    x = torch.randn(4, 2)
    inputs, kwargs = scatter_kwargs((x,), {"weight": torch.ones(4), "flag": True}, sim_devices(2))
    assert len(inputs) == len(kwargs) == 2
    assert kwargs[1]["flag"] is True and kwargs[1]["weight"].shape == (2,)
    inputs, kwargs = scatter_kwargs((), {"x": x}, sim_devices(2))
    assert inputs == ((), ())


def test_small_batch_leaves_devices_idle_and_data_parallel_refuses_it_unless_not_strict():
    x = torch.randn(2, 3)
    assert len(scatter(x, sim_devices(3))) == 2  # what nn.DataParallel silently does
    with pytest.raises(ValueError, match="fewer than the 3 devices: nn.DataParallel would silently"):
        data_parallel(nn.Linear(3, 1), x, sim_devices(3))
    assert data_parallel(nn.Linear(3, 1), x, sim_devices(3), strict=False).shape == (2, 1)


def test_data_parallel_refuses_dims_it_cannot_scatter():
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        data_parallel(nn.Linear(2, 1), torch.randn(4, 2), sim_devices(2), dim=2)
    with pytest.raises(ValueError, match="0-dim"):
        data_parallel(nn.Linear(2, 1), torch.tensor(1.0), sim_devices(2))
    with pytest.raises(TypeError, match="dim must be an int"):
        data_parallel(nn.Linear(2, 1), torch.randn(4, 2), sim_devices(2), dim=0.5)


# ----------------------------------------------------------------------------- replicate


def test_replicas_share_storage_on_device_0_only_and_are_not_leaves():
    model = nn.Linear(3, 2)
    replicas = replicate(model, sim_devices(3))
    assert len(replicas) == 3
    assert replicas[0].weight.data_ptr() == model.weight.data_ptr()
    assert all(r.weight.data_ptr() != model.weight.data_ptr() for r in replicas[1:])
    assert all(not r.weight.is_leaf and r.weight.requires_grad for r in replicas)
    assert list(dict(replicas[1].named_parameters())) == []  # plain tensors, as in PyTorch
    detached = replicate(model, sim_devices(2), detach=True)
    assert not detached[1].weight.requires_grad


def test_gradients_of_every_replica_reach_the_original():
    model = nn.Linear(3, 1, bias=False)
    replicas = replicate(model, sim_devices(3))
    for r in replicas:
        r(torch.ones(1, 3)).sum().backward()
    torch.testing.assert_close(model.weight.grad, torch.full((1, 3), 3.0))


def test_shared_submodules_stay_shared_in_a_replica():
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    replica = replicate(model, sim_devices(2))[1]
    assert replica[0] is replica[2]


def test_batchnorm_running_mean_comes_from_the_first_chunk_only():
    torch.manual_seed(0)
    x = torch.randn(12, 4) * 3 + 1
    bn = nn.BatchNorm1d(4)
    reference = nn.BatchNorm1d(4)
    data_parallel(bn, x, sim_devices(3))
    reference(x[:4])  # the first device's chunk
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)
    assert bn.num_batches_tracked.item() == 1
    whole = nn.BatchNorm1d(4)
    whole(x)
    assert not torch.allclose(bn.running_mean, whole.running_mean)


# ----------------------------------------------------------------------------- parallel_apply


def test_parallel_apply_uses_one_thread_per_replica_and_keeps_grad_mode():
    seen = []
    all_three_running = threading.Barrier(3, timeout=10)  # breaks unless 3 threads run at once

    class Probe(nn.Module):
        def forward(self, x, *, add=0):
            all_three_running.wait()
            seen.append((threading.current_thread().name, torch.is_grad_enabled()))
            return x + add

    replicas = [Probe() for _ in range(3)]
    with torch.no_grad():
        out = parallel_apply(replicas, [torch.zeros(1)] * 3, [{"add": i} for i in range(3)],
                             sim_devices(3))
    assert [o.item() for o in out] == [0.0, 1.0, 2.0]
    assert len({t for t, _ in seen}) == 3
    assert threading.current_thread().name not in {t for t, _ in seen}
    assert all(g is False for _, g in seen)


def test_parallel_apply_reraises_naming_the_device():
    class Fails(nn.Module):
        def forward(self, x):
            if x.sum() > 100:
                raise ValueError("this chunk is too big")
            return x

    inputs = [torch.zeros(2), torch.full((2,), 100.0), torch.zeros(2)]
    with pytest.raises(ValueError, match=r"Caught ValueError in replica 1 on device sim:1") as info:
        parallel_apply([Fails()] * 3, inputs, None, sim_devices(3))
    assert "this chunk is too big" in str(info.value)
    assert "Original traceback" in str(info.value)


# ----------------------------------------------------------------------------- gather


def test_gather_concatenates_nested_outputs():
    outs = [(torch.ones(2, 3), {"h": torch.zeros(1, 2)}, None) for _ in range(3)]
    a, d, none = gather(outs, "sim:0")
    assert a.shape == (6, 3) and d["h"].shape == (3, 2) and none is None
    assert gather([torch.ones(2, 2), torch.ones(2, 3)], "sim:0", dim=1).shape == (2, 5)


def test_gather_of_scalars_warns_and_returns_a_vector():
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        out = gather([torch.tensor(1.0), torch.tensor(3.0)], "sim:0")
    assert out.tolist() == [1.0, 3.0]


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("n", [2, 3, 8])
def test_linear_equivalence(n):
    batches = [(torch.randn(30, 5), torch.randn(30, 2)) for _ in range(3)]
    result = compare_training(nn.Linear(5, 2), batches, nn.functional.mse_loss, sim_devices(n))
    assert result.steps == 3 and result.devices == n
    assert max(result.max_output_diff, result.max_grad_diff, result.max_param_diff) < 1e-5


@pytest.mark.parametrize("n", [2, 3, 8])
def test_cnn_equivalence(n):
    batches = [(torch.randn(16, 1, 16, 16), torch.randint(0, 4, (16,))) for _ in range(2)]
    compare_training(SmallCNN(), batches, nn.functional.cross_entropy, sim_devices(n))


@pytest.mark.parametrize("n", [2, 3, 8])
def test_gru_equivalence_with_dim_1(n):
    batches = [(torch.randn(7, 16, 6), None) for _ in range(2)]  # (time, batch, features)
    compare_training(SequenceGRU(), batches, lambda out, _: out[0].square().mean(),
                     sim_devices(n), dim=1)


def test_compare_training_catches_batchnorm_and_leaves_the_model_alone():
    model = SmallCNN(batch_norm=True)
    before = [p.clone() for p in model.parameters()]
    batches = [(torch.randn(12, 1, 16, 16), torch.randint(0, 4, (12,)))]
    with pytest.raises(AssertionError, match="step 0 outputs"):
        compare_training(model, batches, nn.functional.cross_entropy, sim_devices(3))
    result = compare_training(model, batches, nn.functional.cross_entropy, sim_devices(3),
                              check=False)
    assert result.max_output_diff > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="batches is empty"):
        compare_training(model, [], nn.functional.cross_entropy, sim_devices(2))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        compare_training("model", batches, nn.functional.cross_entropy, sim_devices(2))


def test_time_steps_reports_every_step():
    t = time_steps(nn.Linear(8, 8), torch.randn(16, 8), sim_devices(2), repeats=2)
    assert set(t) == {"scatter", "replicate", "parallel_apply", "gather", "single"}
    assert all(v > 0 for v in t.values())
    with pytest.raises(ValueError, match="repeats"):
        time_steps(nn.Linear(8, 8), torch.randn(16, 8), sim_devices(2), repeats=0)


def test_gru_with_dim_0_is_wrong():
    torch.manual_seed(0)
    model = SequenceGRU()
    x = torch.randn(8, 4, 6)
    out, h = model(x)
    out0, h0 = data_parallel(model, x, sim_devices(2), dim=0)
    assert h0.shape == (2, 4, 8) and h.shape == (1, 4, 8)
    assert not torch.allclose(out0, out)


def test_device_subset_and_output_device():
    model = nn.Linear(3, 2)
    x = torch.randn(10, 3)
    out = data_parallel(model, x, ["sim:0", "sim:2"], output_device="sim:1")
    torch.testing.assert_close(out, model(x))
    with pytest.raises(ValueError, match="cuda:0"):  # not a simulated device (nor, here, a GPU)
        data_parallel(model, x, sim_devices(2), output_device=torch.device("cuda", 0))


def test_module_kwargs_are_scattered():
    class Scaled(nn.Module):
        def forward(self, x, scale):
            return x * scale

    x, scale = torch.randn(6, 2), torch.arange(6.0).unsqueeze(1)
    out = data_parallel(Scaled(), x, sim_devices(3), module_kwargs={"scale": scale})
    torch.testing.assert_close(out, x * scale)


def test_wrapper_state_dict_prefix_and_loading_both_ways():
    inner = nn.Linear(4, 2)
    wrapped = DataParallelByHand(inner, sim_devices(2))
    keys = list(wrapped.state_dict())
    assert keys == ["module.weight", "module.bias"]
    plain = nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match="Missing key"):
        plain.load_state_dict(wrapped.state_dict())
    plain.load_state_dict(wrapped.module.state_dict())
    torch.testing.assert_close(plain.weight, inner.weight)
    other = DataParallelByHand(nn.Linear(4, 2), sim_devices(3))
    other.module.load_state_dict(plain.state_dict())
    x = torch.randn(9, 4)
    torch.testing.assert_close(other(x), plain(x))
    assert "device_ids=['sim:0', 'sim:1', 'sim:2']" in repr(other)


def test_wrapper_tolerates_small_batches_like_nn_data_parallel():
    model = DataParallelByHand(nn.Linear(3, 1), sim_devices(4))
    assert model(torch.randn(2, 3)).shape == (2, 1)
    single = DataParallelByHand(nn.Linear(3, 1), sim_devices(1))
    assert single(torch.randn(2, 3)).shape == (2, 1)


def test_record_memory_counts_what_a_device_holds_alike_on_both_paths():
    """A real scatter leaves a view of the whole input on the source device: counting storages
    (as the real path does) gives what the simulated path records, the whole input."""
    from course_utils.dataparallel.simulated import note_memory, record_memory

    x = torch.randn(8, 4)
    chunks = x.chunk(2)
    with record_memory() as record:
        note_memory("cuda:0", "inputs", chunks[0], whole_storage=True)   # a view: the whole input
        note_memory("cuda:1", "inputs", chunks[1].clone(), whole_storage=True)
    with record_memory() as simulated:
        data_parallel(nn.Linear(4, 1), x, sim_devices(2))
    assert record.bytes("cuda:0", "inputs") == x.nbytes == simulated.bytes("sim:0", "inputs")
    assert record.bytes("cuda:1", "inputs") == x.nbytes // 2 == simulated.bytes("sim:1", "inputs")


# ----------------------------------------------------------------------------- imports


def _course_imports(module) -> set[str]:
    """The course_utils modules that ``module`` imports anywhere in its source, inside functions too."""
    import ast
    import inspect

    package = module.__name__.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package if not node.module else f"{package}.{node.module}"
            found |= {base} if node.module else {f"{package}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            found |= {node.module} if isinstance(node, ast.ImportFrom) else {a.name for a in node.names}
    return {name for name in found if name and name.startswith("course_utils")}


def test_the_imports_run_one_way_from_the_composition_to_the_primitives():
    """by_hand composes the primitives through dp_primitives, which dispatches to sim_primitives:
    the lesson's primitives import neither, and the dispatcher does not import the composition."""
    from course_utils.dataparallel import by_hand, sim_primitives
    from course_utils.dataparallel import primitives as dp_primitives

    wing = "course_utils.dataparallel."
    assert {wing + "primitives", wing + "sim_primitives"} <= _course_imports(by_hand)
    assert wing + "sim_primitives" in _course_imports(dp_primitives)
    assert wing + "by_hand" not in _course_imports(dp_primitives)
    assert _course_imports(sim_primitives) & {wing + "by_hand", wing + "primitives"} == set()
    # what notebook 03 shows as the four steps is the primitives' own code, not the dispatcher's
    assert [f.__module__ for f in (by_hand.scatter, by_hand.replicate, by_hand.parallel_apply,
                                   by_hand.gather)] == ["course_utils.dataparallel.sim_primitives"] * 4
