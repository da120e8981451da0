import pytest
import torch
from torch import nn

from course_utils.dataparallel.parallel_criterion import DataParallelCriterion, DataParallelModel
from course_utils.dataparallel.simulated import sim_devices


def run_both(make_model, x, t, criterion, n, reduction=None):
    torch.manual_seed(0)
    model = make_model()
    reference = criterion(model(x), t)
    reference.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    outputs = DataParallelModel(model, sim_devices(n))(x)
    loss = DataParallelCriterion(criterion, sim_devices(n), reduction=reduction)(outputs, t)
    loss.backward()
    return reference, loss, expected, [p.grad for p in model.parameters()], outputs


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [10, 30, 9])
def test_equals_the_plain_criterion(n, reduction, batch):
    x, t = torch.randn(batch, 5), torch.randint(0, 3, (batch,))
    ref, loss, g_ref, g, outputs = run_both(lambda: nn.Linear(5, 3), x, t,
                                            nn.CrossEntropyLoss(reduction=reduction), n)
    assert len(outputs) == min(n, len(torch.arange(batch).chunk(n)))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_mse_and_sequence_outputs(n):
    x, t = torch.randn(10, 5), torch.randn(10, 2)
    ref, loss, g_ref, g, _ = run_both(lambda: nn.Linear(5, 2), x, t, nn.MSELoss(), n)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, g_ref)

    def token_loss(logits, targets):  # (batch, seq, vocab) logits, (batch, seq) targets
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    ids = torch.randn(11, 4, 6)
    targets = torch.randint(0, 7, (11, 4))
    ref, loss, g_ref, g, _ = run_both(lambda: nn.Linear(6, 7), ids, targets, token_loss, n,
                                      reduction="mean")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, g_ref)


def test_naive_average_of_means_would_be_wrong():
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    x, t = torch.randn(10, 5) * 3, torch.randn(10, 1)
    outputs = DataParallelModel(model, sim_devices(3))(x)
    per_device = [nn.functional.mse_loss(o, c) for o, c in zip(outputs, t.split([4, 4, 2]), strict=True)]
    naive = torch.stack(per_device).mean()
    right = DataParallelCriterion(nn.MSELoss(), sim_devices(3))(outputs, t)
    torch.testing.assert_close(right, nn.functional.mse_loss(model(x), t))
    assert not torch.allclose(naive, right)


def test_bad_arguments():
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        DataParallelCriterion(nn.MSELoss(reduction="none"), sim_devices(2))
    with pytest.raises(ValueError, match="reduction must be"):
        DataParallelCriterion(lambda o, t: (o - t).sum(), sim_devices(2))
    with pytest.raises(ValueError, match="class-weighted mean"):
        DataParallelCriterion(nn.CrossEntropyLoss(weight=torch.ones(3)), sim_devices(2))
    with pytest.raises(TypeError, match="criterion must be callable"):
        DataParallelCriterion("mse", sim_devices(2))
    crit = DataParallelCriterion(nn.CrossEntropyLoss(ignore_index=0), sim_devices(2))
    outputs = DataParallelModel(nn.Linear(5, 3), sim_devices(2))(torch.randn(4, 5))
    with pytest.raises(ValueError, match="ignore_index=0"):
        crit(outputs, torch.tensor([0, 1, 2, 1]))
    with pytest.raises(ValueError, match="hold 4 rows along dim=0 but the targets hold 5"):
        crit(outputs, torch.ones(5, dtype=torch.long))
    with pytest.raises(TypeError, match="outputs must be the non-empty list"):
        crit(torch.randn(4, 3), torch.ones(4, dtype=torch.long))


@pytest.mark.parametrize("output_device", [None, "sim:2"])
def test_parallel_criterion_with_dim_1_and_an_output_device_equals_one_device(output_device):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inputs, targets = torch.randn(6, 5, 4), torch.randn(6, 5, 2)  # (time, batch, features)
    reference = nn.functional.mse_loss(model(inputs), targets)
    reference.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    devices = sim_devices(3)  # a batch of 5 on 3 devices: chunks of 2, 2 and 1
    outputs = DataParallelModel(model, devices, dim=1)(inputs)
    assert [o.shape[1] for o in outputs] == [2, 2, 1]
    loss = DataParallelCriterion(nn.MSELoss(), devices, dim=1, output_device=output_device)(outputs, targets)
    loss.backward()
    torch.testing.assert_close(loss, reference)  # the uneven chunks' means, weighted by size
    torch.testing.assert_close([p.grad for p in model.parameters()], expected)
