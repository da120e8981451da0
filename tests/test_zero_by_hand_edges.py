"""ZeRO by hand (notebook 10) against torch's DDP where a nearly-right version parts from it: ranks
that start from different seeds, BatchNorm's buffers, a frozen and a tied weight, two backward
passes before a step, and a parameter that gets no gradient."""

import dataclasses
import functools

import pytest
import torch
from torch import nn

from course_utils.distributed import launch
from course_utils.sharding.zero import STAGES, ZeroByHand

CASES = ("seeded differently, batchnorm, frozen", "tied", "two backward passes", "unused")


class _Net(nn.Module):
    def __init__(self, tied: bool, spare: bool):
        super().__init__()
        self.first, self.norm = nn.Linear(6, 8), nn.BatchNorm1d(8)
        self.middle, self.last, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.first.bias.requires_grad_(False)  # frozen
        if tied:
            self.last.weight = self.middle.weight
        self.spare = nn.Linear(8, 8) if spare else None  # never used in forward

    def forward(self, x):
        h = torch.tanh(self.middle(torch.tanh(self.norm(self.first(x)))))
        return self.head(torch.tanh(self.last(h)))


def _train(rank, case, stage):
    """Train under ZeRO ``stage`` (None: torch's DDP): the parameters and buffers, or the error."""
    import torch.distributed as dist

    from course_utils.devices import wrap_ddp

    torch.manual_seed(rank)  # every rank starts different: the wrapper must take rank 0's
    model = _Net(tied=case == "tied", spare=case == "unused")
    if stage is None:
        wrapped = wrap_ddp(model, torch.device("cpu"))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    else:
        try:
            zero = ZeroByHand(model, stage, lr=1e-2)
        except ValueError as err:
            return {"error": str(err)}
        wrapped, optimizer = model, zero
    micros = 2 if case == "two backward passes" else 1
    try:
        for step in range(3):
            optimizer.zero_grad()
            for micro in range(micros):
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                x, y = torch.randn(5, 6, generator=g) * (rank + 1), torch.randn(5, 3, generator=g)
                nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
    except RuntimeError as err:
        return {"error": str(err)}
    params = zero.full_parameters() if stage is not None else [p.detach().clone() for p in model.parameters()]
    out = {"error": None, "params": params, "buffers": [b.clone() for b in model.buffers()]}
    dist.barrier()
    return out


def _every_case(rank, world_size):
    return {(case, stage): _train(rank, case, stage) for case in CASES for stage in (None, *STAGES)
            if not (case == "unused" and stage is None)}  # DDP would raise at the next forward


@pytest.fixture(scope="module")
def runs():
    return {n: launch(_every_case, n, echo=False, backend="gloo", timeout_s=240) for n in (2, 3)}


def test_each_stage_trains_as_ddp_from_different_seeds_with_buffers_frozen_tied_and_accumulated(runs):
    for n, per_rank in runs.items():
        for case in CASES[:3]:
            ddp = per_rank[0][case, None]
            for stage in STAGES:
                mine = per_rank[0][case, stage]
                if case == "tied" and stage == 3:
                    assert "share one (a tied weight)" in mine["error"], mine["error"]
                    continue
                assert mine["error"] is None, (n, case, stage, mine["error"])
                assert len(mine["params"]) == len(ddp["params"])
                for a, b in zip(mine["params"], ddp["params"], strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{n} {case} {stage}")
                for ranks in per_rank:  # BatchNorm's buffers: rank 0's before each forward, then its own
                    for a, b in zip(ranks[case, stage]["buffers"], ranks[case, None]["buffers"], strict=True):
                        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{n} {case} {stage}")
                for other in per_rank[1:]:  # every rank holds the same parameters, bit for bit
                    theirs = other[case, stage]["params"]
                    assert all(torch.equal(a, b) for a, b in zip(theirs, mine["params"], strict=True))
                rank_1 = per_rank[1][case, None]["buffers"]  # each rank's own rows moved its buffers
                assert not all(torch.equal(a, b) for a, b in zip(rank_1, ddp["buffers"], strict=True))


def test_a_parameter_without_a_gradient_is_an_error_at_every_stage(runs):
    for per_rank in runs.values():
        for stage in STAGES:
            for ranks in per_rank:
                assert "['spare.weight', 'spare.bias'] got no gradient" in ranks["unused", stage]["error"]


class _Recurrent(nn.Module):
    """A GRU (a unit whose forward returns a tuple) and a head run under reentrant checkpointing
    (its gradients arrive inside a backward pass of its own)."""

    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(4, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.gru(x)
        return torch.utils.checkpoint.checkpoint(self.head, out[:, -1], use_reentrant=True)


class _PassThrough(nn.Module):
    """Units with awkward outputs at stage 3: one returns its input beside its result (that input's
    gradient reaches backward after the unit was reduced) in a dataclass holding a dict, and an
    LSTM returns nested tuples (only h_n is used)."""

    @dataclasses.dataclass
    class Pair:
        found: dict
        x: torch.Tensor

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return _PassThrough.Pair({"out": torch.tanh(self.lin(x))}, x)

    def __init__(self):
        super().__init__()
        self.first, self.both = nn.Linear(4, 4), self.Both()
        self.lstm, self.head = nn.LSTM(4, 4, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        pair = self.both(torch.tanh(self.first(x)))
        _, (h, _) = self.lstm(pair.found["out"].unsqueeze(1))
        return self.head(torch.cat([h[-1], pair.x], dim=1))


class _Routed(nn.Module):
    """Two layers of the same shape, run in an order that depends on the rank, then a head."""

    def __init__(self, swap: bool):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.swap = swap

    def forward(self, x):
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return self.head(torch.tanh(second(torch.tanh(first(x)))))


def _order_and_misuse(rank, world_size):
    """Stages 2-3 with a rank-dependent layer order (against DDP); a stage-3 parameter read between
    steps; a unit whose parameters are used by different micro-batches; stage 1 without zero_grad."""
    import torch.distributed as dist

    from course_utils.devices import wrap_ddp

    found = {}
    for stage in (None, 2, 3):
        torch.manual_seed(0)
        model = _Routed(swap=rank % 2 == 1)
        x, y = torch.randn(4, 6) + rank, torch.randn(4, 3)
        try:
            if stage is None:
                wrapped = wrap_ddp(model, torch.device("cpu"))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                nn.functional.mse_loss(wrapped(x), y).backward()
                optimizer.step()
                found["routed", stage] = [p.detach().clone() for p in model.parameters()]
                wrapped = None
            else:
                zero = ZeroByHand(model, stage, torch.optim.SGD, lr=0.1)
                nn.functional.mse_loss(model(x), y).backward()
                zero.step()
                found["routed", stage] = zero.full_parameters()
        except RuntimeError as err:
            found["routed", stage] = str(err)
        dist.barrier()
    for stage in (None, 2, 3):
        torch.manual_seed(0)
        model = _Recurrent()
        x, y = torch.randn(3, 5, 4) + rank, torch.randn(3, 3)
        wrapped = wrap_ddp(model, torch.device("cpu")) if stage is None else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if stage is None else \
            ZeroByHand(model, stage, torch.optim.SGD, lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
        found["recurrent", stage] = [p.detach().clone() for p in model.parameters()] if stage is None \
            else optimizer.full_parameters()
        wrapped = None
    for stage in (None, 3):
        torch.manual_seed(0)
        model = _PassThrough()
        wrapped = wrap_ddp(model, torch.device("cpu")) if stage is None else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if stage is None else \
            ZeroByHand(model, stage, torch.optim.SGD, lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            optimizer.zero_grad()
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
            nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
        found["pass-through", stage] = [p.detach().clone() for p in model.parameters()] if stage is None \
            else optimizer.full_parameters()
        if stage == 3:  # every unit freed after the step
            found["gathered after steps"] = [u.flat.untyped_storage().nbytes() for u in optimizer.units]
        wrapped = None
    model = _Net(tied=False, spare=False)
    zero = ZeroByHand(model, 3)
    nn.functional.mse_loss(model(torch.randn(5, 6)), torch.zeros(5, 3)).backward()
    zero.step()
    found["read between steps"] = model.head.weight.shape  # a stage-3 parameter, read: harmless
    try:
        model.state_dict()
    except RuntimeError as err:
        found["state_dict at stage 3"] = str(err)
    for stage in (2, 3):
        model = _Net(tied=False, spare=False)
        zero = ZeroByHand(model, stage)
        try:
            for micro in range(2):  # the first micro-batch leaves out `last`'s bias (stage 2) or all of
                h = torch.tanh(model.middle(torch.tanh(model.norm(model.first(torch.randn(5, 6))))))
                if micro == 1:  # `last` (stage 3 gathers a module's parameters for its own forward only)
                    h = model.last(h)
                elif stage == 2:
                    h = nn.functional.linear(h, model.last.weight)
                model.head(h).square().mean().backward()
            found["partial", stage] = None
        except RuntimeError as err:
            found["partial", stage] = str(err)
    model = _Net(tied=False, spare=False)
    zero = ZeroByHand(model, 1)
    try:
        for _ in range(2):  # no zero_grad between the steps
            model(torch.randn(5, 6)).square().mean().backward()
            zero.step()
        found["stage 1 without zero_grad"] = None
    except RuntimeError as err:
        found["stage 1 without zero_grad"] = str(err)
    return found


def test_stages_keep_one_order_refuse_what_they_cannot_follow_and_never_read_freed_memory():
    for found in launch(_order_and_misuse, 2, echo=False, backend="gloo", timeout_s=120):
        ddp = found["routed", None]
        assert all(torch.equal(a, b) for a, b in zip(found["routed", 2], ddp, strict=True))  # bitwise
        assert "their modules run in different orders" in found["routed", 3]
        for a, b in zip(found["pass-through", 3], found["pass-through", None], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert found["gathered after steps"] == [0, 0, 0, 0]
        for stage in (2, 3):  # a tuple from a unit's forward; gradients from a checkpoint's own backward
            for a, b in zip(found["recurrent", stage], found["recurrent", None], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert found["read between steps"] == (0,)  # an empty placeholder, not freed memory
        assert "take full_parameters()" in found["state_dict at stage 3"]
        before = "got no gradient in the backward pass before this one"
        assert f"['last.bias'] {before}" in found["partial", 2], found["partial", 2]
        assert f"['last.weight', 'last.bias'] {before}" in found["partial", 3], found["partial", 3]
        assert "call zero_grad() before each step" in found["stage 1 without zero_grad"]


def test_a_unit_of_two_dtypes_is_refused_with_a_reason():
    def build():
        model = nn.Linear(3, 3)
        model.bias = nn.Parameter(model.bias.detach().double())
        return model

    def rank_fn(rank, world_size):
        try:
            ZeroByHand(build(), 1)
        except ValueError as err:
            return str(err)
        return None

    for message in launch(rank_fn, 2, echo=False, backend="gloo", timeout_s=60):
        assert "differ in dtype or device" in message


def _clipped(rank, world_size):
    """Three steps clipped to a norm of 0.05 (below the gradients' norm: every step clips) under
    torch's DDP with nn.utils.clip_grad_norm_ and under each stage with its clip_grad_norm_: the
    parameters and the norms each returned; and which optimizers each stage refuses."""
    from course_utils.devices import wrap_ddp

    found = {}
    for stage in (None, *STAGES):
        torch.manual_seed(rank)
        model = _Net(tied=False, spare=False)
        if stage is None:
            wrapped = wrap_ddp(model, torch.device("cpu"))
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
            clip = functools.partial(nn.utils.clip_grad_norm_, list(model.parameters()), 0.05)
        else:
            zero = ZeroByHand(model, stage, torch.optim.SGD, lr=0.5)
            wrapped, optimizer, clip = model, zero, (lambda z=zero: z.clip_grad_norm_(0.05))
        norms = []
        for step in range(3):
            optimizer.zero_grad()
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            nn.functional.mse_loss(wrapped(x), y).backward()
            norms.append(float(clip()))
            optimizer.step()
        params = [p.detach().clone() for p in model.parameters()] if stage is None else zero.full_parameters()
        found[stage] = {"params": params, "norms": norms}
        wrapped = None
    refused = {}
    for stage in STAGES:
        for cls in (torch.optim.Adafactor, torch.optim.LBFGS, torch.optim.Adam):
            try:
                ZeroByHand(_Net(tied=False, spare=False), stage, cls)
                refused[stage, cls.__name__] = None
            except ValueError as err:
                refused[stage, cls.__name__] = str(err)
    found["refused"] = refused
    return found


def test_clip_grad_norm_clips_as_ddp_and_an_optimizer_that_is_not_elementwise_is_refused():
    for n in (2, 3):
        for found in launch(_clipped, n, echo=False, backend="gloo", timeout_s=120):
            ddp = found[None]
            assert all(norm > 0.05 for norm in ddp["norms"])  # every step clipped
            for stage in STAGES:
                torch.testing.assert_close(found[stage]["norms"], ddp["norms"], rtol=1e-5, atol=0)
                for mine, theirs in zip(found[stage]["params"], ddp["params"], strict=True):
                    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
            for (stage, name), error in found["refused"].items():
                assert (error is not None) == (stage >= 1 and name != "Adam"), (stage, name, error)
                assert error is None or "updates each element on its own" in error


def _changed_after_wrapping(rank, world_size):
    """A parameter's storage replaced after wrapping (p.data = ...), per stage: the error, if any;
    and a user's post-accumulate hook registered after wrapping, which must see the gradient."""
    found = {}
    for stage in STAGES:
        torch.manual_seed(0)
        model = _Net(tied=False, spare=False)
        zero = ZeroByHand(model, stage, torch.optim.SGD, lr=0.1)
        seen = []
        model.head.weight.register_post_accumulate_grad_hook(
            lambda p, seen=seen: seen.append(p.grad is not None))
        model.train(False)  # BatchNorm: its running statistics, not the batch's
        nn.functional.mse_loss(model(torch.randn(4, 6)), torch.zeros(4, 3)).backward()
        zero.step()
        with torch.no_grad():
            model.middle.weight.data = torch.zeros(8, 8)
        try:
            model(torch.randn(4, 6))
            found[stage] = None
        except RuntimeError as err:
            found[stage] = str(err)
        found[stage, "hook saw a gradient"] = seen == [True]
    return found


def test_a_parameter_replaced_after_wrapping_is_refused_and_a_later_hook_sees_the_gradient():
    for found in launch(_changed_after_wrapping, 2, echo=False, backend="gloo", timeout_s=120):
        for stage in STAGES:
            assert found[stage, "hook saw a gradient"], (stage, found)
            if stage >= 1:
                assert "no longer hold the view of the unit's flat buffer" in (found[stage] or ""), found


def _zeroed_by_the_model(rank, world_size):
    """Stages 2-3, two steps with model.zero_grad() between them: the error (the shards of the
    first step would add to the second's)."""
    found = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = _Net(tied=False, spare=False)
        zero = ZeroByHand(model, stage, torch.optim.SGD, lr=0.1)
        try:
            for _ in range(2):
                model.zero_grad()
                nn.functional.mse_loss(model(torch.randn(4, 6)), torch.zeros(4, 3)).backward()
                zero.step()
            found[stage] = None
        except RuntimeError as err:
            found[stage] = str(err)
    return found


def test_model_zero_grad_between_steps_is_refused_at_stages_2_and_3():
    for found in launch(_zeroed_by_the_model, 2, echo=False, backend="gloo", timeout_s=60):
        for stage in (2, 3):
            assert "model.zero_grad() does not reach the shards" in (found[stage] or ""), found
