"""DDP by hand (notebook 06) equals torch's DDP and one process, on 2 and 3 gloo ranks: after
backward, one all-reduce per parameter from hooks, and buckets (one per parameter, one for all, a
few); ranks seeded differently, a tied weight, a frozen parameter. The all-reduces are counted from
the process group's Flight Recorder (what ran, whoever called it), and the order of events from
each rank's timeline. Every rank function runs in one launch per world size."""

import functools

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from course_utils.ddp.by_hand import DDPByHand, Event, Timeline, assign_buckets
from course_utils.ddp.by_hand_runs import lesson_model, train_one_process, train_rank, train_versions
from course_utils.ddp.by_hand_timing import (
    comm_heavy_model,
    draw_timelines,
    overlap_counts,
    timeline_intervals,
    timelines_rank,
)
from course_utils.distributed import launch

#: bucket caps (MiB) on lesson_model (3024 bytes of parameters, the largest 1024): below the
#: smallest parameter (16 bytes), so one bucket each; above the whole model; and 1048 bytes
CAPS = {"one per parameter": 1e-6, "one for all": 1.0, "a few": 0.001}
#: the parameters in each bucket of "a few" on the plain lesson model: 16 + 256 + 64 + 1024 bytes
#: reach the cap, then 64 + 1024, then the first layer's 64 + 512
A_FEW = [4, 2, 2]
#: (version, cap) pairs, the reference last
RUNS = [("after_backward", None), ("per_parameter", None),
        *(("bucketed", cap) for cap in CAPS.values()), ("torch_ddp", None)]
#: the models: ranks seeded differently, a tied weight, a frozen weight
MODELS = {"seeded differently": {"seeded_differently": True}, "tied": {"tied": True},
          "frozen": {"frozen": True}}
STEPS = 3


def _every_run(rank, world_size):
    """Every (model, version, cap) in turn, in this one group."""
    import torch.distributed as dist

    results = {}
    for model, options in MODELS.items():
        for version, cap in RUNS:
            results[model, version, cap] = train_rank(rank, world_size, version, cap, steps=STEPS,
                                                      count=True, record=True, **options)
            dist.barrier()
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def runs(request):
    per_rank = launch(_every_run, request.param, echo=False, backend="gloo", timeout_s=240)
    return {key: [ranks[key] for ranks in per_rank] for key in per_rank[0]}


def _trainable_numels(options):
    model = lesson_model(options.get("tied", False), options.get("frozen", False))
    return [p.numel() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("version", "cap"), RUNS[:-1], ids=["after backward", "per parameter",
                                                             *(f"buckets, {c}" for c in CAPS)])
def test_every_version_equals_torch_ddp_and_one_process(runs, model, version, cap):
    ddp = runs[model, "torch_ddp", None][0]["params"]
    options = {k: v for k, v in MODELS[model].items() if k != "seeded_differently"}
    one_process = train_one_process(STEPS, **options)
    for result in runs[model, version, cap]:
        assert result["params"].keys() == ddp.keys()
        for name, value in result["params"].items():
            torch.testing.assert_close(value, ddp[name], msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(value, one_process[name], msg=lambda m, n=name: f"{n}: {m}")
    # every rank holds the same model: the same all-reduced gradients, bit for bit
    first = runs[model, version, cap][0]["params"]
    assert all(torch.equal(r["params"][k], first[k]) for r in runs[model, version, cap] for k in first)


def test_seeded_differently_really_starts_different():
    assert not torch.equal(lesson_model(seed=0)[0].weight, lesson_model(seed=1)[0].weight)


@pytest.mark.parametrize("model", list(MODELS))
def test_after_backward_sends_one_all_reduce_per_parameter_after_the_backward_pass(runs, model):
    numels = _trainable_numels(MODELS[model])
    for result in runs[model, "after_backward", None]:
        assert result["counts"] == [{"during": [], "after": numels}] * STEPS


@pytest.mark.parametrize("model", list(MODELS))
def test_per_parameter_sends_one_all_reduce_per_parameter_during_the_backward_pass(runs, model):
    """A tied weight is one parameter (reduced once); a frozen one is never sent. The gradients
    arrive last layer first."""
    numels = _trainable_numels(MODELS[model])
    for result in runs[model, "per_parameter", None]:
        assert len(result["buckets"]) == len(numels)
        for step in result["counts"]:
            assert step["after"] == [] and sorted(step["during"]) == sorted(numels)
            assert step["during"][0] == numels[-1]  # the last layer's bias comes first


def test_a_few_buckets_on_the_lesson_model():
    assert [len(b) for b in assign_buckets(lesson_model().parameters(), CAPS["a few"])] == A_FEW


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("cap", list(CAPS))
def test_bucketed_sends_one_all_reduce_per_bucket_during_the_backward_pass(runs, model, cap):
    options = MODELS[model]
    local = lesson_model(options.get("tied", False), options.get("frozen", False))
    params = dict(local.named_parameters())
    names = {p: n for n, p in params.items()}
    expected = [[names[p] for p in bucket] for bucket in
                assign_buckets([p for p in local.parameters() if p.requires_grad], CAPS[cap])]
    # the tied weight counts once (two buckets of "a few" remain), the frozen one not at all
    count = {"one per parameter": len(_trainable_numels(options)), "one for all": 1,
             "a few": 2 if model == "tied" else 3}[cap]
    for result in runs[model, "bucketed", CAPS[cap]]:
        assert result["buckets"] == expected and len(expected) == count
        bucket_numels = [sum(params[name].numel() for name in bucket) for bucket in result["buckets"]]
        assert result["counts"] == [{"during": bucket_numels, "after": []}] * STEPS


def _steps(events):
    """The timeline cut into steps, each a list of (what, index)."""
    steps = []
    for e in events:
        if e.what == "backward_start":
            steps.append([])
        steps[-1].append((e.what, e.index))
    return steps


@pytest.mark.parametrize("model", list(MODELS))
def test_per_parameter_starts_all_reduces_before_the_backward_pass_ends(runs, model):
    """From the recorded events: with hooks, the all-reduces start inside backward; after backward,
    none does. The times agree with the order."""
    for result in runs[model, "per_parameter", None]:
        assert len(_steps(result["events"])) == STEPS
        for step in _steps(result["events"]):
            first_start = step.index(("all_reduce_start", 0))
            assert first_start < step.index(("backward_end", None))
            assert sum(what == "all_reduce_start" for what, _ in step) == len(result["buckets"])
        # the events of the training thread (all but the backend's "done") in the order of their times
        times = [e.t for e in result["events"] if e.what != "all_reduce_done"]
        assert times == sorted(times)
    for result in runs[model, "after_backward", None]:
        for step in _steps(result["events"]):
            assert step[1] == ("backward_end", None) and step[2] == ("all_reduce_start", 0)


@pytest.mark.parametrize("model", list(MODELS))
def test_every_all_reduce_is_waited_for_once_and_done_before_its_wait_ends(runs, model):
    for result in runs[model, "bucketed", CAPS["a few"]]:
        for step in _steps(result["events"]):
            buckets = range(len(result["buckets"]))
            assert [i for what, i in step if what == "wait_end"] == list(buckets)
            for b in buckets:
                assert step.index(("all_reduce_done", b)) < step.index(("wait_end", b))
                assert step.index(("backward_end", None)) < step.index(("wait_start", b))


def _wrapper_basics(rank, world_size):
    model = lesson_model(seed=rank)
    ddp_model = DDPByHand(model, bucket_cap_mb=1)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    same_forward = torch.equal(ddp_model(x), model(x))
    keys = list(ddp_model.state_dict())
    ddp_model = None
    return {"module": keys, "forward": same_forward, "weight": model[0].weight.detach().clone()}


def test_the_wrapper_keeps_the_module_and_its_forward_and_broadcasts_rank_0():
    ranks = launch(_wrapper_basics, 2, echo=False, backend="gloo")
    expected = ["module." + k for k in lesson_model().state_dict()]
    for r in ranks:
        assert r["module"] == expected and r["forward"]
        assert torch.equal(r["weight"], lesson_model(seed=0)[0].weight.detach())


def test_assign_buckets_closes_each_bucket_once_it_reaches_the_cap_in_reverse_order():
    params = [nn.Parameter(torch.zeros(n)) for n in (256, 1, 255, 100, 300)]  # 4 bytes each
    sizes = lambda buckets: [[p.numel() for p in b] for b in buckets]  # noqa: E731
    # 1200 bytes reach 1024: closed; 400 + 1020 pass it: closed; 4 + 1024 pass it: closed
    assert sizes(assign_buckets(params, 1024 / 2**20)) == [[300], [100, 255], [1, 256]]
    assert sizes(assign_buckets(params, 1600 / 2**20)) == [[300, 100], [255, 1, 256]]  # exactly 1600
    assert sizes(assign_buckets(params, 1)) == [[300, 100, 255, 1, 256]]
    assert sizes(assign_buckets(params, None)) == [[300], [100], [255], [1], [256]]
    # every parameter but the 4-byte one passes 100 bytes alone; that one waits for the next
    assert sizes(assign_buckets(params, 100 / 2**20)) == [[300], [100], [255], [1, 256]]


def _ddp_bucket_count(rank, world_size, width, caps):
    """How many buckets torch's DDP reduces per step, once it has rebuilt them, for each cap."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_utils.ddp.by_hand_timing import comm_heavy_model
    from course_utils.devices import wrap_ddp

    counts = []
    for cap in caps:
        ddp_model = wrap_ddp(comm_heavy_model(width), torch.device("cpu"), bucket_cap_mb=cap)
        for _ in range(3):  # the first step sends one bucket; the buckets are rebuilt after it
            F.cross_entropy(ddp_model(torch.randn(4, width)), torch.zeros(4, dtype=torch.long)).backward()
        counts.append(ddp_model._get_ddp_logging_data().get("num_buckets_reduced"))
        ddp_model = None
    dist.barrier()
    return counts


def test_assign_buckets_makes_as_many_buckets_as_torch_ddp():
    """The rule the notebook teaches and exercise 06.3 asks is DDP's own: the same bucket count as
    torch's DDP (after its first step) for caps that split the model in several ways."""
    width = 128  # four layers of 64 KiB, biases of 512 bytes, a head of 10 classes
    caps = [0.03, 0.0625, 0.07, 0.1, 0.13, 0.2, 1.0]
    ddp = launch(_ddp_bucket_count, 2, width, caps, echo=False, backend="gloo", timeout_s=120)[0]
    mine = [len(assign_buckets(list(comm_heavy_model(width).parameters()), cap)) for cap in caps]
    assert mine == ddp and len(set(mine)) >= 3, (mine, ddp)


class _HalfUsed(nn.Module):
    """Two layers, of which forward uses one."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.used(x)


def _unused_parameter_rank(rank, world_size):
    import torch.distributed as dist

    ddp_model = DDPByHand(_HalfUsed(), bucket_cap_mb=1)
    ddp_model(torch.randn(2, 3)).sum().backward()
    try:
        ddp_model.finish_gradient_synchronization()
    except RuntimeError as err:
        message = str(err)
    else:
        message = None
    dist.barrier()
    return message


def test_a_parameter_without_a_gradient_is_an_error_not_a_silent_drift():
    messages = launch(_unused_parameter_rank, 2, echo=False, backend="gloo", timeout_s=120)
    assert all(m is not None and "exactly once" in m and "drift apart" in m for m in messages), messages


def test_a_timeline_that_does_not_record_keeps_nothing():
    silent, kept = Timeline(record=False), Timeline()
    for timeline in (silent, kept):
        timeline.mark("backward_start")
    assert silent.events == [] and [e.what for e in kept.events] == ["backward_start"]


def test_timeline_intervals_pairs_each_start_with_its_end():
    events = [Event(*e) for e in [
        ("backward_start", None, 10.0), ("all_reduce_start", 0, 10.5), ("all_reduce_start", 1, 10.6),
        ("all_reduce_done", 0, 10.7), ("backward_end", None, 11.0), ("wait_start", 0, 11.1),
        ("wait_end", 0, 11.1), ("wait_start", 1, 11.2), ("all_reduce_done", 1, 11.5),
        ("wait_end", 1, 11.5), ("backward_start", None, 12.0), ("all_reduce_start", 0, 12.5)]]
    bars = timeline_intervals(events, t0=10.0)
    rounded = {kind: [tuple(None if x is None else round(x, 6) for x in bar) for bar in kind_bars]
               for kind, kind_bars in bars.items()}
    assert rounded == {"backward": [(0.0, 1.0)],  # the second pass has not ended
                       "all_reduce": [(0, 0.5, 0.7), (1, 0.6, 1.5), (0, 2.5, None)],  # the last not done
                       "wait": [(0, 1.1, 1.1), (1, 1.2, 1.5)]}
    assert timeline_intervals(events)["backward"] == bars["backward"]  # t0: the first event


class NoSync(nn.Module):
    """A wrapper that synchronises nothing (a learner's empty answer)."""

    def __init__(self, module, bucket_cap_mb=None):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        pass


def test_train_rank_trains_the_wrapper_it_is_given():
    """What a judge needs: train_rank builds the learner's class; one that never synchronises
    leaves every rank with a model of its own."""
    ranks = launch(functools.partial(train_rank, wrapper=NoSync), 2, "per_parameter", echo=False,
                   backend="gloo")
    assert not torch.equal(ranks[0]["params"]["6.bias"], ranks[1]["params"]["6.bias"])


@pytest.mark.parametrize("version, cap", [("per_parameter", None), ("bucketed", CAPS["a few"]),
                                          ("after_backward", None)])
def test_every_recorded_all_reduce_becomes_a_bar_that_ends_after_it_starts(runs, version, cap):
    for result in runs["tied", version, cap]:
        bars = timeline_intervals(result["events"])
        assert len(bars["backward"]) == STEPS
        per_step = len(result["buckets"]) or len(_trainable_numels({"tied": True}))  # after backward
        assert len(bars["all_reduce"]) == STEPS * per_step
        assert all(done is not None and done >= start for _, start, done in bars["all_reduce"])
        assert len(bars["wait"]) == (0 if version == "after_backward" else len(bars["all_reduce"]))


def test_train_versions_runs_each_version_in_one_group_with_the_options_given():
    runs = [("after_backward", None), ("bucketed", CAPS["a few"])]
    ranks = launch(train_versions, 2, runs, {"steps": 1, "tied": True, "count": True}, echo=False,
                   backend="gloo")
    for rank in ranks:
        assert list(rank) == runs
        assert len(rank["after_backward", None]["counts"]) == 1  # steps=1 reached train_rank
        assert rank["after_backward", None]["counts"][0]["after"] == _trainable_numels({"tied": True})
    assert torch.equal(ranks[0]["bucketed", CAPS["a few"]]["params"]["6.bias"],
                       ranks[1]["bucketed", CAPS["a few"]]["params"]["6.bias"])


def test_timelines_rank_records_the_last_steps_of_each_version_and_draws_one():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = launch(timelines_rank, 2, 32, 4, 0.004, 3, 2, echo=False, backend="gloo")
    params = list(comm_heavy_model(32).parameters())
    for rank in ranks:
        assert list(rank) == ["after_backward", "per_parameter", "bucketed"]
        for version, steps in rank.items():
            assert len(steps) == 2  # the last two of three steps
            for events in steps:
                whats = [e.what for e in events]
                assert whats.count("backward_start") == 1
                expected = len(assign_buckets(params, 0.004)) if version == "bucketed" else len(params)
                assert whats.count("all_reduce_start") == expected, version
                assert whats.count("wait_end") == (0 if version == "after_backward" else expected)
                counts = overlap_counts(events)
                assert counts["total"] == expected and 0 <= counts["done"] <= counts["issued"] <= expected
                # after backward issues nothing before backward ends; the hooks issue every one
                assert counts["issued"] == (0 if version == "after_backward" else expected), version
    fig = draw_timelines({v: [r[v][-1] for r in ranks] for v in ranks[0]}, "title")
    assert len(fig.axes) == 3 and fig.axes[0].get_title(loc="left") == "after backward"
    plt.close(fig)


def _watched(rank, world_size):
    import torch.distributed as dist

    from course_utils.exercises.all_reduces import all_reduces_watched

    first = dist.all_reduce(torch.ones(1), async_op=True)
    first.wait()
    held = [(cls, name, cls.__dict__.get(name)) for cls, name in
            ((dist.ProcessGroup, "allreduce"), (type(first), "wait"))]
    with all_reduces_watched() as reduced:
        dist.all_reduce(torch.ones(3))  # blocking: waited inside the call
        handle = dist.all_reduce(torch.ones(5), async_op=True)
        dist.broadcast(torch.ones(2), src=0)  # not an all-reduce
        waited_before = reduced[1]["waited"]
        handle.wait()
    restored = all(cls.__dict__.get(name) is value for cls, name, value in held)
    return [(r["numel"], r["waited"]) for r in reduced], waited_before, restored


def test_the_exercise_watcher_counts_all_reduces_and_their_waits_and_puts_the_classes_back():
    for reduced, waited_before, restored in launch(_watched, 2, echo=False, backend="gloo"):
        assert reduced == [(3, 1), (5, 1)] and waited_before == 0 and restored


def _contract_rank(rank, world_size):
    """What the wrapper does where its contract is at stake: after a backward pass that left a
    parameter without gradient, a step, wrapping again and finish are refused (for a bucket per
    parameter and for buckets); a model wrapped again after a step (the old wrapper's hooks are
    gone, its forward raises), and broadcast_buffers=False (buffers left as each rank has them, as DDP
    leaves them)."""
    import torch.distributed as dist

    from course_utils.devices import wrap_ddp

    found = {}
    for cap in (None, 1.0):
        model = _HalfUsed()  # its unused layer trains: the backward pass leaves buckets unstarted
        wrapped = DDPByHand(model, bucket_cap_mb=cap)
        optimizer = torch.optim.SGD(model.used.parameters(), lr=0.1)
        wrapped(torch.randn(2, 3) + rank).sum().backward()
        for what, act in (("step", optimizer.step), ("wrapped again", lambda m=model, c=cap: DDPByHand(m, c)),
                          ("finish", wrapped.finish_gradient_synchronization)):
            try:
                act()
                found[what, cap] = None
            except RuntimeError as err:
                found[what, cap] = str(err)
        wrapped = None
        dist.barrier()
    grads = {}
    for name in ("by hand", "torch DDP"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        with torch.no_grad():
            model[1].running_mean.fill_(float(rank))
        if name == "by hand":
            first = DDPByHand(model, broadcast_buffers=False)
            model.eval()  # BatchNorm's buffers stay as they are
            first(torch.randn(4, 3)).sum().backward()  # a whole step of the first wrapper
            model.zero_grad()
            model.train()
            wrapped = DDPByHand(model, broadcast_buffers=False)  # takes the parameters' hooks
            try:
                first(torch.randn(4, 3))
                found["the replaced wrapper"] = None
            except RuntimeError as err:
                found["the replaced wrapper"] = str(err)
            first = None
        else:
            wrapped = wrap_ddp(model, torch.device("cpu"), broadcast_buffers=False)
        for step in range(2):
            model.zero_grad()
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + rank))
            wrapped(x).square().sum().backward()
            getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
        grads[name] = ([p.grad.clone() for p in model.parameters()], model[1].running_mean.clone())
        wrapped = model = None
    found["grads"] = grads
    dist.barrier()
    return found


def test_after_an_incomplete_backward_a_step_is_refused_and_a_second_wrapper_replaces_the_first():
    for found in launch(_contract_rank, 2, echo=False, backend="gloo", timeout_s=120):
        for cap in (None, 1.0):
            assert "optimizer.step() after a synchronised backward pass that did not" in found["step", cap]
            assert "is inside a step" in found["wrapped again", cap]
            assert "did not get each of its gradients exactly once" in found["finish", cap]
        (mine, my_mean), (theirs, their_mean) = found["grads"]["by hand"], found["grads"]["torch DDP"]
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        assert torch.equal(my_mean, their_mean)  # each rank's own buffers, as DDP leaves them
        assert "a newer DDPByHand wraps these parameters" in found["the replaced wrapper"]


def _sparse_rank(rank, world_size):
    try:
        DDPByHand(nn.Embedding(4, 2, sparse=True))
    except ValueError as err:
        return str(err)
    return None


def test_sparse_gradients_are_refused_with_a_reason():
    for message in launch(_sparse_rank, 2, echo=False, backend="gloo", timeout_s=60):
        assert "sparse gradients" in message


class _Concatenated(nn.Module):
    """Two parameters used as one (torch.cat): autograd hands their gradients as slices of one
    tensor, which share a version counter."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(2, 3))

    def forward(self, x):
        return nn.functional.linear(x, torch.cat([self.q, self.k]))


def _clamp(param):
    param.grad.clamp_(-0.01, 0.01)


def _gradient_writes_rank(rank, world_size):
    """Accumulation over parameters whose gradients share a storage, by hand and under DDP."""
    from course_utils.devices import wrap_ddp

    found = {}
    for name in ("by hand", "torch DDP"):
        torch.manual_seed(0)
        model = _Concatenated()
        wrapped = DDPByHand(model, 1.0) if name == "by hand" else wrap_ddp(model, torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            optimizer.zero_grad(set_to_none=False)
            for micro in range(2):  # synchronised each micro-batch: the gradients add up in place
                x = torch.randn(3, 3, generator=torch.Generator().manual_seed(10 * step + micro + rank))
                wrapped(x).square().mean().backward()
                getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
            optimizer.step()
        found[name] = [p.detach().clone() for p in model.parameters()]
        wrapped = None
    return found


def test_gradients_that_share_a_storage_add_up_as_under_torch_ddp():
    for found in launch(_gradient_writes_rank, 2, echo=False, backend="gloo", timeout_s=120):
        assert all(torch.equal(a, b) for a, b in zip(found["by hand"], found["torch DDP"], strict=True))


def _by_hand_and_ddp(make):
    """For a bucket per parameter and one bucket for all, by hand and under torch's DDP: ``(cap,
    name, model, wrapped)``, each model made by ``make()`` from one seed."""
    from course_utils.devices import wrap_ddp

    for cap in (None, 1.0):
        for name in ("by hand", "torch DDP"):
            torch.manual_seed(0)
            model = make()
            yield cap, name, model, DDPByHand(model, cap) if name == "by hand" else \
                wrap_ddp(model, torch.device("cpu"))


def _writes_after_backward_rank(rank, world_size):
    """What a training loop may do to .grad once backward() has returned (zero it in place, clip it
    through .data, write it through NumPy, clip its norm), by hand and under torch's DDP, on a
    model whose two parameters' gradients are slices of one tensor and on one whose gradients are
    views of a flat buffer of the loop's own: the parameters after two steps, the buffer."""

    writes = {
        "zero_grad(set_to_none=False)": lambda m: m.zero_grad(set_to_none=False),
        ".data.clamp_": lambda m: [p.grad.data.clamp_(-0.01, 0.01) for p in m.parameters()],
        "numpy": lambda m: [p.grad.numpy().__setitem__(0, 0.0) for p in m.parameters()],
        "clip_grad_norm_": lambda m: nn.utils.clip_grad_norm_(m.parameters(), 1e-2),
    }
    found = {}
    for model_name in ("concatenated", "flat buffer"):
        for write_name, write in writes.items():
            for cap, name, model, wrapped in _by_hand_and_ddp(_Concatenated):
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                flat = torch.zeros(12)
                for step in range(2):
                    if model_name == "flat buffer":  # .grad: views of the loop's own buffer
                        flat.zero_()
                        model.q.grad, model.k.grad = flat[:6].view(2, 3), flat[6:].view(2, 3)
                    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(10 * step + rank))
                    wrapped(x).square().mean().backward()
                    if model_name == "flat buffer":
                        kept = model.q.grad.data_ptr() == flat.data_ptr()
                        found[model_name, "view kept", name, cap] = kept
                        found[model_name, "buffer", write_name, name, cap] = flat.clone()
                    write(model)
                    optimizer.step()
                found[model_name, write_name, name, cap] = \
                    [p.detach().clone() for p in model.parameters()]
                wrapped = None
    return found


def test_writes_to_the_gradients_after_backward_are_as_under_torch_ddp():
    """DDPByHand has finished when backward() returns, as DDP has: whatever the loop then does to
    .grad, even past autograd's version counter (.data, NumPy), it does to the mean, as under DDP;
    and a gradient that was a view of the loop's buffer is that view again, holding the mean."""
    for found in launch(_writes_after_backward_rank, 2, echo=False, backend="gloo", timeout_s=120):
        checked = 0
        for key, value in found.items():
            if isinstance(value, list) and key[2] == "by hand":
                theirs = found[key[0], key[1], "torch DDP", key[3]]
                assert all(torch.equal(a, b) for a, b in zip(value, theirs, strict=True)), key
                checked += 1
            elif key[1] == "buffer" and key[3] == "by hand":
                assert torch.equal(value, found[key[0], key[1], key[2], "torch DDP", key[4]]), key
            elif key[1] == "view kept":
                assert value, key
        assert checked == 2 * 4 * 2


def _late_hooks_rank(rank, world_size):
    """Hooks registered on parameters after wrapping that write the gradient (in place, through
    .data, through NumPy; and one on the gradient's accumulator, which runs after the wrapper's and
    whose write is not sent), on a plain layer and on two parameters whose gradients are slices of
    one tensor, by hand and under torch's DDP: the gradients after one backward pass."""

    def through_data(param):
        param.grad.data.mul_(0.5)

    def through_numpy(param):
        param.grad.numpy().__imul__(0.5)

    def on_the_accumulator(param):  # a hook on the AccumulateGrad node, after the wrapper's
        def double(grad_inputs, grad_outputs):
            param.grad.mul_(2.0)
        get_gradient_edge(param).node.register_hook(double)

    writes = {"clamp_": _clamp, ".data": through_data, "numpy": through_numpy, "accumulator": None}
    found = {}
    for model_name, make in (("linear", lambda: nn.Linear(3, 3)), ("concatenated", _Concatenated)):
        for write_name, write in writes.items():
            for cap, name, model, wrapped in _by_hand_and_ddp(make):
                for param in model.parameters():  # after wrapping
                    if write is None:
                        on_the_accumulator(param)
                    else:
                        param.register_post_accumulate_grad_hook(write)
                x = torch.randn(3, 3, generator=torch.Generator().manual_seed(rank))
                wrapped(x).square().mean().backward()
                found[model_name, write_name, cap, name] = [p.grad.clone() for p in model.parameters()]
                wrapped = None
    return found


def test_a_hook_registered_after_wrapping_writes_what_is_sent_as_under_torch_ddp():
    """The wrapper hooks each gradient's accumulator and copies the gradient into its bucket there,
    as DDP's reducer does: it runs after every hook on the parameter, whenever registered, so their
    writes are what is all-reduced, and before a later hook on the accumulator, whose write the
    mean then replaces."""
    for found in launch(_late_hooks_rank, 2, echo=False, backend="gloo", timeout_s=120):
        mine = {key[:3]: grads for key, grads in found.items() if key[3] == "by hand"}
        assert len(mine) == 2 * 4 * 2
        for key, grads in mine.items():
            theirs = found[(*key, "torch DDP")]
            assert all(torch.equal(a, b) for a, b in zip(grads, theirs, strict=True)), key


class _Interrupt(torch.autograd.Function):
    """Raises in backward, after the layers behind it have their gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise KeyboardInterrupt("stopped by hand")


def _interrupted_rank(rank, world_size):
    """A synchronised backward pass that raises once every bucket has started: the next forward
    with gradients raises, by hand as under DDP (where it would otherwise finish stale means)."""
    from course_utils.devices import wrap_ddp

    found = {}
    for cap in (None, 1.0):
        for name in ("by hand", "torch DDP"):
            torch.manual_seed(0)
            model = nn.Linear(3, 3)
            wrapped = DDPByHand(model, cap) if name == "by hand" else wrap_ddp(model, torch.device("cpu"))
            x = torch.randn(3, 3, requires_grad=True)
            try:  # the input's gradient comes last: every parameter's is ready by then
                wrapped(_Interrupt.apply(x)).square().sum().backward()
            except KeyboardInterrupt:
                pass
            model.zero_grad(set_to_none=False)
            try:
                wrapped(torch.randn(3, 3))
                found[name, cap] = None
            except RuntimeError as err:
                found[name, cap] = str(err)
            wrapped = None
    return found


def test_a_forward_after_an_interrupted_backward_raises_as_under_torch_ddp():
    for found in launch(_interrupted_rank, 2, echo=False, backend="gloo", timeout_s=120):
        for cap in (None, 1.0):
            assert found["torch DDP", cap] is not None, found
            mine = found["by hand", cap] or ""
            assert "raised (or was interrupted) after its all-reduces started" in mine, found


def _refused_uses_rank(rank, world_size):
    """backward(create_graph=True), and a model converted after wrapping: each raises, with why
    (torch's DDP raises on the first and stops synchronising on the second)."""
    found = {}
    for cap in (None, 1.0):
        model = nn.Linear(3, 3)
        wrapped = DDPByHand(model, cap)
        try:
            wrapped(torch.randn(2, 3)).square().sum().backward(create_graph=True)
            found["create_graph", cap] = None
        except RuntimeError as err:
            found["create_graph", cap] = str(err)
        model = nn.Linear(3, 3)
        wrapped = DDPByHand(model, cap)
        model.double()
        try:
            wrapped(torch.randn(2, 3, dtype=torch.float64))
            found["double", cap] = None
        except RuntimeError as err:
            found["double", cap] = str(err)
        wrapped = None
    return found


def test_a_graph_of_the_gradients_and_a_model_converted_after_wrapping_are_refused():
    for found in launch(_refused_uses_rank, 2, echo=False, backend="gloo", timeout_s=120):
        for cap in (None, 1.0):
            assert "create_graph=True" in (found["create_graph", cap] or ""), found
            assert "changed dtype or device after wrapping" in (found["double", cap] or ""), found


def _inference_mode_backward_rank(rank, world_size):
    """A forward outside, its backward inside torch.inference_mode(): the gradients, by hand and
    under torch's DDP."""
    from course_utils.devices import wrap_ddp

    found = {}
    for name in ("by hand", "torch DDP"):
        torch.manual_seed(0)
        model = nn.Linear(3, 3)
        wrapped = DDPByHand(model, 1.0) if name == "by hand" else wrap_ddp(model, torch.device("cpu"))
        loss = wrapped(torch.randn(3, 3, generator=torch.Generator().manual_seed(rank))).square().sum()
        with torch.inference_mode():
            loss.backward()
        found[name] = [p.grad.clone() for p in model.parameters()]
        wrapped = None
    return found


def test_a_backward_inside_inference_mode_is_synchronised_as_under_torch_ddp():
    for found in launch(_inference_mode_backward_rank, 2, echo=False, backend="gloo", timeout_s=60):
        assert all(torch.equal(a, b) for a, b in zip(found["by hand"], found["torch DDP"], strict=True))


def _saved_and_replaced_rank(rank, world_size):
    """torch.save of a wrapped model (the wrapper notes nothing on the parameters), and a parameter
    replaced after wrapping: a RuntimeError that names it as replaced (DDP raises too)."""
    import io

    model = nn.Linear(3, 3)
    wrapped = DDPByHand(model, 1.0)
    wrapped(torch.randn(2, 3)).sum().backward()
    torch.save(model, io.BytesIO())
    model.weight = nn.Parameter(torch.zeros(3, 3))
    wrapped(torch.randn(2, 3)).sum().backward()
    try:
        wrapped(torch.randn(2, 3))
        return None
    except RuntimeError as err:
        return str(err)


def test_a_wrapped_model_pickles_and_a_replaced_parameter_is_named_as_such():
    for found in launch(_saved_and_replaced_rank, 2, echo=False, backend="gloo", timeout_s=60):
        assert "a replaced parameter" in (found or ""), found


class _Scrubbed(nn.Module):
    """Two layers; a hook on the activation between them sets the second layer's .grad to None
    after that gradient was ready (backward reaches the activation after the second layer)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        h = self.first(x)
        if h.requires_grad:
            h.register_hook(self._scrub)
        return self.second(h)

    def _scrub(self, grad):
        self.second.weight.grad = None


def _mid_step_rank(rank, world_size):
    """Wrapping again between a forward and its backward (refused: the new wrapper is not armed,
    so nothing would be synchronised), and a .grad set to None after its hook (it ends with the
    mean, as under DDP): the error, and the gradients by hand and under DDP."""
    found = {}
    model = nn.Linear(3, 3)
    first = DDPByHand(model)
    loss = first(torch.randn(2, 3) + rank).sum()
    try:
        DDPByHand(model)
        found["wrapped mid-step"] = None
    except RuntimeError as err:
        found["wrapped mid-step"] = str(err)
    loss.backward()
    first = None
    for cap, name, model, wrapped in _by_hand_and_ddp(_Scrubbed):
        wrapped(torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
        found[name, cap] = [p.grad.clone() for p in model.parameters()]
        wrapped = None
    return found


def test_wrapping_inside_a_step_is_refused_and_a_gradient_set_to_none_gets_the_mean_as_under_ddp():
    for found in launch(_mid_step_rank, 2, echo=False, backend="gloo", timeout_s=60):
        assert "is inside a step" in (found["wrapped mid-step"] or ""), found
        for cap in (None, 1.0):
            mine, theirs = found["by hand", cap], found["torch DDP", cap]
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), cap
