"""The runs of notebook 10: ZeRO stages by hand and through PyTorch's APIs, on the same model.

Every rank function trains ``toy_model()`` on its rows of ``toy_batches`` and returns what the
notebook and the tests compare with ``train_single`` (one process, whole batches):
``zero_by_hand_rank`` (real DDP, then ``ZeroByHand`` at stages 0 to 3), ``api_rank``
(``ZeroRedundancyOptimizer`` with DDP, FSDP2 ``fully_shard`` three ways, a DCP save) and
``dcp_load_rank`` (the DCP checkpoint loaded back, resharded). ``logged_collectives`` counts the
bytes torch's own code sends, and ``cuda_peak`` each run's peak memory on a GPU. The ledgers that
predict those bytes are in :mod:`course_utils.sharding.ledgers`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..models import seeded
from .zero import CommLog, ZeroByHand

__all__ = ["api_rank", "cuda_peak", "dcp_load_rank", "fsdp_model", "logged_collectives", "model_state_bytes",
           "shard_layers", "toy_batches", "toy_model", "train_single", "zero_by_hand_rank"]


#: the collectives whose traffic logged_collectives counts (the flat ones under either release's
#: name, see compat), and the CommLog kind each counts as
_LOGGED = {"all_reduce": "all_reduce", "broadcast": "broadcast",
           "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
           "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}


@contextlib.contextmanager
def logged_collectives(log: CommLog, groups: bool = False) -> Iterator[None]:
    """While inside, count in ``log`` what torch's own code hands to ``dist.all_reduce``,
    ``dist.broadcast`` and the flat all-gather and reduce-scatter (either release's name), as
    ``CommLog`` counts the by-hand stages (notebook 10). It replaces the functions in
    ``torch.distributed``, which torch's Python code calls (a deprecated name calls the new one
    inside ``distributed_c10d``, unreplaced: one count). DDP's all-reduce runs in C++ unless a
    Python communication hook calls ``dist.all_reduce``: register ``allreduce_hook`` to count it.
    With ``groups``, ``log.count`` is also told the group each ran on (``mesh.LinkLog``)."""
    import torch.distributed as dist

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind = _LOGGED[name]
        parameters = inspect.signature(original)

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = parameters.bind(*args, **kwargs)
            bound.apply_defaults()
            first, second = list(bound.arguments.values())[:2]
            tensor = second if kind == "all_gather" else first  # all-gather: (output, input)
            if groups:
                log.count(kind, tensor, bound.arguments.get("group"))
            else:
                log.count(kind, tensor)
            return original(*args, **kwargs)
        return call

    originals = {name: getattr(dist, name) for name in _LOGGED if hasattr(dist, name)}
    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@contextlib.contextmanager
def cuda_peak(device: torch.device, peaks: dict[str, int], name: str) -> Iterator[None]:
    """On a GPU, record in ``peaks[name]`` the most memory allocated on ``device`` during the
    block: the peak is reset first, so what earlier blocks allocated and freed does not count
    (what they left allocated does). Nothing on the CPU."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.reset_peak_memory_stats(device)
    yield
    peaks[name] = torch.cuda.max_memory_allocated(device)


def toy_model(width: int = 32) -> nn.Sequential:
    """Three ``nn.Linear`` layers (the units that get sharded), seeded: the same on every rank."""
    return seeded(0, lambda: nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width),
                                           nn.ReLU(), nn.Linear(width, 4)))


def toy_batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``rows`` rows (inputs, regression targets), from a fixed seed."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(steps)]


def train_single(steps: int = 3, rows: int = 12, lr: float = 1e-2) -> list[torch.Tensor]:
    """One process, whole batches, AdamW: the parameters every sharded run must reproduce."""
    model = toy_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for x, y in toy_batches(steps, rows):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def zero_by_hand_rank(rank: int, world_size: int, stages: Sequence[int] = (0, 1, 2, 3),
                      steps: int = 3, rows: int = 12, lr: float = 1e-2) -> dict:
    """One rank: real DDP, then ``ZeroByHand`` at each stage, on this rank's rows of each batch.

    Returns, per run, the full parameters after training, and for the stages the bytes held
    after the last step (``held_bytes``) and the bytes sent per step (``CommLog``).
    """
    from ..devices import rank_device, wrap_ddp

    device = rank_device()
    batches = [(x.chunk(world_size)[rank].to(device), y.chunk(world_size)[rank].to(device))
               for x, y in toy_batches(steps, rows)]
    model = toy_model().to(device)
    ddp_model = wrap_ddp(model, device)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp_model(x), y).backward()
        optimizer.step()
    out: dict = {"ddp": {"parameters": [p.detach().cpu() for p in model.parameters()]}}
    del ddp_model, optimizer
    for stage in stages:
        model = toy_model().to(device)
        zero = ZeroByHand(model, stage, lr=lr, comm=CommLog())
        for x, y in batches:
            zero.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            zero.step()
        held, sent = zero.held_bytes(), {k: v / steps for k, v in zero.comm.sent.items()}
        out[f"zero{stage}"] = {"parameters": [p.cpu() for p in zero.full_parameters()],
                               "held": held, "sent": sent, "numels": [u.numel for u in zero.units]}
    return out


def shard_layers(model: nn.Module, *, mixed_precision: bool = False,
                 reshard_after_forward: bool | int | None = None, mesh: Any = None) -> nn.Module:
    """FSDP2: ``fully_shard`` on each ``nn.Linear`` of ``model`` (one unit each), then on the root;
    over all ranks (a 1-D mesh on this rank's device type), or over ``mesh`` (a 2-D ``DeviceMesh``:
    HSDP, :mod:`course_utils.sharding.mesh`).

    ``reshard_after_forward``: ``fully_shard``'s default, ``None``, frees each layer's gathered parameters
    after its forward but keeps the root's (none here); ``False`` keeps every layer's until backward; an
    int H keeps them sharded over H ranks (a node's), where the backward all-gather then runs."""
    from torch.distributed import get_world_size
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..devices import rank_device

    # fully_shard's default mesh is on the machine's accelerator, whatever the backend: on a GPU machine
    # a gloo job's rank 1 would ask for cuda:1 (LOCAL_RANK) and fail, on one GPU (seen on an H100)
    mesh = init_device_mesh(rank_device().type, (get_world_size(),)) if mesh is None else mesh
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision else MixedPrecisionPolicy()
    for layer in model.modules():
        if isinstance(layer, nn.Linear) and layer is not model:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def fsdp_model(mixed_precision: bool = False, reshard_after_forward: bool | None = None) -> nn.Module:
    """``toy_model()`` on this rank's device, sharded by ``shard_layers``."""
    from ..devices import rank_device

    return shard_layers(toy_model().to(rank_device()), mixed_precision=mixed_precision,
                        reshard_after_forward=reshard_after_forward)


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state, counted from the tensors.

    A DTensor counts its local shard; ``ZeroRedundancyOptimizer`` counts the state it keeps.
    """

    def nbytes(tensors: list[torch.Tensor]) -> int:
        return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)

    state = getattr(optimizer, "optim", optimizer).state
    return {"parameters": nbytes(list(model.parameters())),
            "gradients": nbytes([p.grad for p in model.parameters() if p.grad is not None]),
            "optimizer state": nbytes([v for s in state.values() for v in s.values()
                                       if torch.is_tensor(v) and v.dim() > 0])}


def api_rank(rank: int, world_size: int, steps: int = 3, rows: int = 12, lr: float = 1e-2,
             checkpoint: str | None = None) -> dict:
    """One rank: ``ZeroRedundancyOptimizer`` with DDP, then FSDP2 (fp32, with gradient clipping
    measured across shards; with ``reshard_after_forward=False``; a bf16 forward and backward),
    optionally saving the fp32 model with DCP. Counts what each run sends per step
    (:func:`logged_collectives`) and, on a GPU, each run's own peak memory (:func:`cuda_peak`)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ..devices import rank_device, wrap_ddp

    device = rank_device()
    batches = [(x.chunk(world_size)[rank].to(device), y.chunk(world_size)[rank].to(device))
               for x, y in toy_batches(steps, rows)]
    peaks: dict[str, int] = {}
    logs = {run: CommLog() for run in ("zero_redundancy", "fsdp", "fsdp_kept", "bf16")}
    model = toy_model().to(device)
    ddp_model = wrap_ddp(model, device)
    ddp_model.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's all-reduce, counted
    with cuda_peak(device, peaks, "zero_redundancy"), logged_collectives(logs["zero_redundancy"]):
        # region: zero-redundancy
        optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp_model(x), y).backward()
            optimizer.step()
        # endregion
    zero_state = model_state_bytes(model, optimizer)["optimizer state"]
    out: dict = {"zero_redundancy": [p.detach().cpu() for p in model.parameters()],
                 "zero_redundancy_state": zero_state}
    del ddp_model, optimizer, model

    with cuda_peak(device, peaks, "fsdp"), logged_collectives(logs["fsdp"]):
        # region: fsdp
        model = fsdp_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # measures, clips nothing
            optimizer.step()
        # endregion
    weight = model[0].weight
    local_grad_sq = sum(p.grad.to_local().float().square().sum() for p in model.parameters())
    out["fsdp"] = [p.full_tensor().cpu() for p in model.parameters()]
    out["dtensor"] = {"type": type(weight).__name__, "placements": str(weight.placements),
                      "global": tuple(weight.shape), "local": tuple(weight.to_local().shape),
                      "local_norm_alone": local_grad_sq.sqrt().item(),
                      "clip_norm": norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item()}
    out["fsdp_held"] = model_state_bytes(model, optimizer)
    out["shapes"] = [tuple(p.shape) for p in model.parameters()]
    if checkpoint is not None:
        dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint)
        dist.barrier()
    del optimizer, model

    with cuda_peak(device, peaks, "fsdp_kept"), logged_collectives(logs["fsdp_kept"]):
        kept = fsdp_model(reshard_after_forward=False)  # parameters stay gathered from forward to backward
        optimizer = torch.optim.AdamW(kept.parameters(), lr=lr)
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.mse_loss(kept(x), y).backward()
            optimizer.step()
    out["fsdp_kept"] = [p.full_tensor().cpu() for p in kept.parameters()]
    del optimizer, kept

    with cuda_peak(device, peaks, "bf16"), logged_collectives(logs["bf16"]):
        mixed = fsdp_model(mixed_precision=True)
        x, y = batches[0]
        output = mixed(x)
        loss = nn.functional.mse_loss(output.float(), y)
        loss.backward()
    out["bf16"] = {"output dtype": str(output.dtype), "sharded dtype": str(mixed[0].weight.dtype),
                   "gradient dtype": str(mixed[0].weight.grad.dtype), "loss": loss.item(),
                   "all-gathered in": sorted(logs["bf16"].dtypes["all_gather"]),
                   "reduce-scattered in": sorted(logs["bf16"].dtypes["reduce_scatter"])}
    out["sent"] = {run: {kind: sent / steps for kind, sent in logs[run].sent.items() if sent}
                   for run in ("zero_redundancy", "fsdp", "fsdp_kept")}  # bytes per training step
    out["cuda_peak_bytes"] = peaks
    return out


def dcp_load_rank(rank: int, world_size: int, checkpoint: str) -> dict:
    """One rank: a fresh FSDP model (other weights) loads the DCP checkpoint, whatever N saved it."""

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = fsdp_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # so that nothing loaded could pass for the original by accident
    # region: dcp-load
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state)
    # endregion
    return {"parameters": [p.full_tensor().cpu() for p in model.parameters()],
            "local": [tuple(p.to_local().shape) for p in model.parameters()]}
