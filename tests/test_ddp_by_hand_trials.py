"""DDP by hand against torch's DDP where a nearly-right wrapper parts from it (notebook 06):
gradients that arrive in a rank-dependent order, layers registered in another order than forward
uses them, a tied and a frozen weight, accumulation with no_sync, two backward passes without it,
and a parameter left out of the loss. On 2 ranks the results are equal bit for bit (dividing by 2
is exact, so dividing before or after the sum gives the same floats); on 3, up to rounding."""

import pytest
import torch

from course_utils.compat import queue_backward_callback
from course_utils.ddp.by_hand import DDPByHand
from course_utils.ddp.by_hand_arming import ARMING_CASES, arming_rank
from course_utils.ddp.by_hand_trials import TRIALS, trial_model, trial_rank
from course_utils.distributed import launch

CAPS = (None, 0.0005)  # a bucket per parameter; a few buckets
CASES = {2: [(m, t, c) for m in ("routed", "out_of_order", "lesson") for t in TRIALS for c in CAPS
             if not (m == "lesson" and t == "unused")],
         3: [("routed", t, c) for t in ("steps", "no_sync") for c in CAPS]}


def _every_case(rank, world_size):
    return {case: trial_rank(rank, world_size, *case) for case in CASES[world_size]}


@pytest.fixture(scope="module")
def trials():
    """world size -> case -> one result per rank (one launch per world size)."""
    found = {}
    for world_size in CASES:
        per_rank = launch(_every_case, world_size, echo=False, backend="gloo", timeout_s=240)
        found[world_size] = {case: [ranks[case] for ranks in per_rank] for case in per_rank[0]}
    return found


def test_by_hand_trains_as_torch_ddp_in_every_trial(trials):
    for world_size, results in trials.items():
        _equal_to_ddp(world_size, results)


def _equal_to_ddp(world_size, results):
    for (model, trial, cap), ranks in results.items():
        if trial == "unused":
            continue
        by_hand, ddp = ranks[0]["by_hand"], ranks[0]["torch_ddp"]
        assert by_hand["error"] is None and ddp["error"] is None, (model, trial, cap)
        for name, value in by_hand["params"].items():
            if world_size == 2:
                assert torch.equal(value, ddp["params"][name]), (model, trial, cap, name)
            else:
                torch.testing.assert_close(value, ddp["params"][name])
        for other in ranks[1:]:  # every rank holds the same model, bit for bit
            assert all(torch.equal(other["by_hand"]["params"][k], v) for k, v in by_hand["params"].items())


def test_every_rank_issues_the_buckets_in_the_same_order_whatever_order_its_gradients_arrive_in(trials):
    for results in trials.values():
        for (model, trial, cap), ranks in results.items():
            if model == "routed" and trial != "unused":
                issued = [r["issued"] for r in ranks]
                assert issued[0] and all(i == issued[0] for i in issued), (trial, cap, issued)


def test_the_buckets_are_rebuilt_in_the_order_the_gradients_arrived_as_ddp_rebuilds_them(trials):
    results = trials[2]
    for trial in ("steps", "no_sync", "two_backward"):
        by_hand = results["out_of_order", trial, 0.0005][0]
        assert by_hand["by_hand"]["buckets"] == by_hand["torch_ddp"]["buckets"] == [[1, 0, 3, 2], [5, 4]]
        per_parameter = results["out_of_order", trial, None][0]
        flat = [i for bucket in per_parameter["by_hand"]["buckets"] for i in bucket]
        assert [flat] == per_parameter["torch_ddp"]["buckets"]  # DDP's cap holds them in one bucket


def test_a_parameter_left_out_is_an_error_in_both_ddp_at_the_next_forward(trials):
    unused = {case: ranks for case, ranks in trials[2].items() if case[1] == "unused"}
    assert len(unused) == 4
    for ranks in unused.values():
        for r in ranks:
            assert "did not get each of its gradients exactly once" in r["by_hand"]["error"]
            assert "Expected to have finished reduction in the prior iteration" in r["torch_ddp"]["error"]


class _FillOrder(DDPByHand):
    """The hazard the wrapper avoids: start each bucket as soon as it is full."""

    def _gradient_ready(self, param):
        self._copy_into_bucket(param)
        b = self.place[param][0]
        if self.arrived[b] == len(self.buckets[b]):
            self._start_all_reduce(b)
            self.next_bucket += 1  # here: how many have started
        if self.next_bucket == len(self.buckets):
            queue_backward_callback(self._backward_ended)


def _fill_order_rank(rank, world_size):
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_utils.ddp.timeline import Timeline

    model = trial_model("routed", rank)
    wrapped = _FillOrder(model, None, Timeline(), rebuild_buckets=False)
    F.mse_loss(wrapped(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
    issued = [e.index for e in wrapped.timeline.events if e.what == "all_reduce_start"]
    dist.barrier()
    return issued, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_launching_in_fill_order_pairs_different_gradients_across_ranks():
    """Without the next-bucket rule, the ranks issue their all-reduces in different orders and sum
    each other's wrong tensors with no error (the layers have the same shape): what the trials
    above would catch."""
    (order0, grads0), (order1, grads1) = launch(_fill_order_rank, 2, echo=False, backend="gloo", timeout_s=60)
    assert order0 != order1
    assert not torch.equal(grads0["a.weight"], grads1["a.weight"])  # the ranks now disagree


def _no_sync_placements(rank, world_size):
    """For each placement of no_sync (around the forward only, around the backward only), whether
    the backward pass synchronised the gradients, by hand and in torch's DDP."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_utils.devices import wrap_ddp

    found = {}
    for name in ("by hand", "torch DDP"):
        for placement in ("forward inside", "backward inside"):
            model = trial_model("lesson", 0)
            wrapped = DDPByHand(model, 0.0005) if name == "by hand" else wrap_ddp(model, torch.device("cpu"))
            x, y = torch.randn(4, 8) + rank, torch.randn(4, 4)
            if placement == "forward inside":
                with wrapped.no_sync():
                    loss = F.mse_loss(wrapped(x), y)
                loss.backward()
            else:
                loss = F.mse_loss(wrapped(x), y)
                with wrapped.no_sync():
                    loss.backward()
            getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
            grad = model[6].weight.grad.clone()
            every = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(every, grad)
            found[name, placement] = all(torch.equal(g, every[0]) for g in every)
            wrapped = model = None
    return found


def test_no_sync_is_decided_at_the_forward_as_in_torch_ddp():
    for found in launch(_no_sync_placements, 2, echo=False, backend="gloo", timeout_s=60):
        assert found["torch DDP", "forward inside"] is False and found["torch DDP", "backward inside"] is True
        assert found["by hand", "forward inside"] is False and found["by hand", "backward inside"] is True


NO_GRAD_CASES = ("no_sync forward, no_grad forward, backward",
                 "forward, no_grad forward in no_sync, backward")


def _buffers_and_no_grad_forwards(rank, world_size):
    """What the wrapper and torch's DDP do with BatchNorm's buffers under no_sync accumulation, and
    with a forward under no_grad between a forward and its backward."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from course_utils.devices import wrap_ddp

    found = {}
    for name in ("by hand", "torch DDP"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4))
        wrapped = DDPByHand(model, 0.0005) if name == "by hand" else wrap_ddp(model, torch.device("cpu"),
                                                                              bucket_cap_mb=0.0005)
        finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
        for micro in range(3):  # the first two under no_sync, each rank its own rows
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * micro + rank)) * (rank + 1)
            with wrapped.no_sync() if micro < 2 else _nothing():
                F.mse_loss(wrapped(x), torch.zeros(4, 4)).backward()
        finish()
        found[name, "running mean"] = model[1].running_mean.clone()
        for case in NO_GRAD_CASES:
            model = trial_model("lesson", 0)
            wrapped = DDPByHand(model) if name == "by hand" else wrap_ddp(model, torch.device("cpu"))
            x = torch.randn(4, 8) + rank
            if case.startswith("no_sync"):
                with wrapped.no_sync():
                    loss = F.mse_loss(wrapped(x), torch.zeros(4, 4))
                with torch.no_grad():
                    wrapped(x)
            else:
                loss = F.mse_loss(wrapped(x), torch.zeros(4, 4))
                with wrapped.no_sync(), torch.no_grad():
                    wrapped(x)
            loss.backward()
            getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
            every = [torch.empty(4) for _ in range(world_size)]
            dist.all_gather(every, model[6].bias.grad)
            found[name, case] = all(torch.equal(g, every[0]) for g in every)
        wrapped = model = None
    return found


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_buffers_and_no_grad_forwards_follow_torch_ddps_rules():
    for found in launch(_buffers_and_no_grad_forwards, 2, echo=False, backend="gloo", timeout_s=60):
        assert torch.equal(found["by hand", "running mean"], found["torch DDP", "running mean"])
        for case in NO_GRAD_CASES:
            assert found["by hand", case] == found["torch DDP", case], case
        assert found["torch DDP", "no_sync forward, no_grad forward, backward"] is False
        assert found["torch DDP", "forward, no_grad forward in no_sync, backward"] is True



def test_a_forward_arms_the_hooks_and_the_backward_that_completes_them_disarms_as_in_torch_ddp():
    """DDP's reducer acts on a backward pass after a forward run with gradients outside no_sync
    (whatever forwards follow it) and stops when that backward has started every bucket: a second
    backward of the same graph is not synchronised. The wrapper's grads equal DDP's bit for bit,
    and it raises where DDP raises."""
    for found in launch(arming_rank, 2, echo=False, backend="gloo", timeout_s=120):
        outcome = {}
        for case in ARMING_CASES:
            mine, theirs = found[case, "by hand"], found[case, "torch DDP"]
            if "left out, then a forward" in case:  # both refuse the forward after an incomplete sync
                assert "Expected to have finished reduction in the prior" in theirs["error"], theirs["error"]
                assert "did not get each of its gradients" in mine["error"], mine["error"]
                continue
            if "left out" in case:  # both refuse: the same parameter reached twice in one sync
                assert "mark a variable ready only once" in theirs["error"], theirs["error"]
                assert "marked ready twice" in mine["error"], mine["error"]
                continue
            assert mine["error"] is None and theirs["error"] is None, case
            assert mine["grads"].keys() == theirs["grads"].keys()
            assert all(torch.equal(g, theirs["grads"][n]) for n, g in mine["grads"].items()), case
            outcome[case] = mine["ranks equal"]
            assert mine["ranks equal"] == theirs["ranks equal"], case
        assert outcome == {"a forward, then one in no_sync, one backward of the second": True,
                           "a forward in no_sync, then one outside, one backward of the first": True,
                           "one forward, two backward passes of its graph": False}


class _Mixed(torch.nn.Module):
    """A float32 layer, a float64 one, a float32 head: one cap would hold them all."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).double()
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)).double())).float())


def _mixed_rank(rank, world_size):
    import torch.nn.functional as F

    from course_utils.devices import wrap_ddp

    found = {}
    for name in ("by hand", "torch DDP"):
        torch.manual_seed(0)
        model = _Mixed()
        wrapped = DDPByHand(model, 1.0) if name == "by hand" else wrap_ddp(model, torch.device("cpu"),
                                                                           bucket_cap_mb=1.0)
        g = torch.Generator().manual_seed(rank)
        F.mse_loss(wrapped(torch.randn(4, 8, generator=g)), torch.randn(4, 2, generator=g)).backward()
        getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
        found[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
        if name == "by hand":
            found["buckets"] = [[p.dtype for p in bucket] for bucket in wrapped.buckets]
        wrapped = model = None
    return found


def test_gradients_of_two_dtypes_travel_in_buckets_of_their_own_as_in_ddp():
    """One flat tensor per bucket: a float64 gradient in a float32 bucket would be rounded."""
    for found in launch(_mixed_rank, 2, echo=False, backend="gloo", timeout_s=60):
        assert found["buckets"] == [[torch.float32, torch.float32, torch.float32, torch.float32],
                                    [torch.float64, torch.float64]]
        for name, grad in found["by hand"].items():
            theirs = found["torch DDP"][name]
            assert grad.dtype == theirs.dtype and torch.equal(grad, theirs)
