"""What gloo really puts on the wire, measured from the kernel's own count of the bytes each TCP
socket sent (``ss -tinp``, Linux), against the ring model of notebook 10's ledgers (what NCCL's
ring sends for the calls torch makes).

Measured here, on 4 gloo ranks (where ``ss`` runs): an all-reduce of B bytes sends
``2B(n-1)/n`` per rank, to the previous rank; a reduce-scatter of B bytes sends the same, an
all-reduce's bytes, not the ring model's ``B(n-1)/n``; an all-gather of a b-byte shard sends
``(n-1)b``, to the next rank; an all-to-all of B bytes sends ``B(n-1)/n``, a share to every
other rank. So across the node boundary of 2 nodes of 2, gloo's FSDP sends 3 times HSDP's bytes
where the ring model says 2.25, while DDP's 1.5 and HSDP's own bytes between nodes are the
model's (notebook 10's mesh section).
gloo's Flight Recorder says as much: it logs a reduce-scatter as an all-reduce of the whole tensor.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from course_utils.distributed import launch

needs_ss = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("ss") is None,
                              reason="reads each socket's bytes sent with ss (iproute2), on Linux")

#: elements of the tensors handed to each collective (1 MiB of fp32): far above gloo's headers
NUMEL = 2**18


def _sockets() -> dict[tuple[str, str], int]:
    """(local address:port, peer address:port) -> bytes sent, for this process's TCP sockets."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    pid, found, current = os.getpid(), {}, None
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            current = None
            if f"pid={pid}," in line:
                fields = line.split()
                current = (fields[3], fields[4])
        elif current is not None:
            sent = re.search(r"bytes_sent:(\d+)", line)
            found[current] = int(sent.group(1)) if sent else 0
    return found


def _measured(op) -> dict[tuple[str, str], int]:
    """The bytes each socket of this rank sent while ``op`` ran once (after a first run, which
    opens the connections)."""
    import torch.distributed as dist

    op()
    dist.barrier()
    before = _sockets()
    dist.barrier()
    op()
    dist.barrier()
    after = _sockets()
    return {key: sent - before.get(key, 0) for key, sent in after.items()}


def _collective_rank(rank, world_size, kind):
    import torch.distributed as dist

    x = torch.ones(NUMEL)
    ops = {"all_reduce": lambda: dist.all_reduce(x),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(NUMEL // world_size), x),
           "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(NUMEL * world_size), x),
           "all_to_all": lambda: dist.all_to_all_single(torch.empty(NUMEL), x)}
    return _measured(ops[kind])


def _by_peer(results) -> list[dict[int, int]]:
    """Per rank: peer rank -> bytes sent to it. A socket's other end is the socket with its two
    endpoints swapped. A map from local port to rank once counted, under load, a rank's bytes to
    rank 0 as sent to rank 3: rank 3 too had a socket on that port number."""
    owner = {ends: rank for rank, sockets in enumerate(results) for ends in sockets}
    peers = []
    for sockets in results:
        sent: dict[int, int] = {}
        for (local, peer), count in sockets.items():
            other = owner.get((peer, local))
            if other is not None and count:
                sent[other] = sent.get(other, 0) + count
        peers.append(sent)
    return peers


def _near(measured, expected, rel=0.02):
    return abs(measured - expected) <= rel * expected + 8192  # headers and barriers: a few KiB


@needs_ss
@pytest.mark.parametrize(("kind", "factor", "step"), [
    ("all_reduce", 2 * 3 / 4, -1), ("reduce_scatter", 2 * 3 / 4, -1), ("all_gather", 3, +1)])
def test_a_gloo_ring_sends_to_one_neighbour(kind, factor, step):
    """B = 1 MiB on 4 ranks: each rank sends factor × B to one rank only, the next or the previous."""
    n, nbytes = 4, NUMEL * 4
    for rank, sent in enumerate(_by_peer(launch(_collective_rank, n, kind, echo=False, timeout_s=120))):
        big = {peer: count for peer, count in sent.items() if count > nbytes // 8}
        assert list(big) == [(rank + step) % n], (kind, rank, sent)
        assert _near(sum(sent.values()), factor * nbytes), (kind, rank, sent)


@needs_ss
def test_gloo_s_reduce_scatter_sends_an_all_reduce_s_bytes_not_the_ring_model_s():
    n, nbytes = 4, NUMEL * 4
    sent = [sum(s.values()) for s in _by_peer(launch(_collective_rank, n, "reduce_scatter", echo=False,
                                                      timeout_s=120))]
    assert all(_near(s, 2 * nbytes * (n - 1) / n) for s in sent), sent
    assert all(s > 1.9 * nbytes * (n - 1) / n for s in sent)  # the ring model's count, twice over


@needs_ss
def test_an_all_to_all_sends_a_share_to_every_other_rank():
    n, nbytes = 4, NUMEL * 4
    results = launch(_collective_rank, n, "all_to_all", echo=False, timeout_s=120)
    for rank, sent in enumerate(_by_peer(results)):
        assert sorted(sent) == [r for r in range(n) if r != rank], sent
        assert all(_near(count, nbytes / n) for count in sent.values()), sent


def _training_rank(rank, world_size, nodes, run):
    """Bytes each socket sent during one training step of one of notebook 10's mesh runs, width 512."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from course_utils.devices import wrap_ddp
    from course_utils.sharding import mesh, runs

    gpus = world_size // nodes
    grid = mesh.mesh_2d(nodes, gpus)
    strategy = mesh.RUNS[run][0]
    batches = [(x.chunk(world_size)[rank], y.chunk(world_size)[rank]) for x, y in runs.toy_batches(2, 8)]
    if strategy == "ddp":
        model = wrap_ddp(runs.toy_model(512), torch.device("cpu"))
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        model = runs.shard_layers(runs.toy_model(512), mesh=grid if strategy == "hsdp" else None)
    steps = iter([batches[:1], batches[1:]])  # the first opens the connections
    return _measured(lambda: mesh.train(model, next(steps), 1e-2))


@needs_ss
def test_across_nodes_gloo_s_fsdp_sends_three_times_hsdp_s_bytes_not_the_model_s_2_25():
    from course_utils.sharding import ledgers
    from course_utils.sharding.runs import toy_model

    nodes, gpus = 2, 2
    psi = sum(p.numel() for p in toy_model(512).parameters())  # every layer's rows divide by 4
    crossing = {}
    for run in ("ddp", "fsdp", "hsdp"):
        peers = _by_peer(launch(_training_rank, nodes * gpus, nodes, run, echo=False, timeout_s=240))
        per_rank = [sum(c for p, c in sent.items() if p // gpus != r // gpus)
                    for r, sent in enumerate(peers)]
        crossing[run] = sum(per_rank)
        if run == "hsdp":  # every rank sends its shard's all-reduce across, as the model says
            model = ledgers.link_bytes_per_step(psi, nodes, gpus, "hsdp")["between nodes"]
            assert all(_near(b, model) for b in per_rank), (per_rank, model)
    model = {s: 4 * ledgers.link_bytes_per_step(psi, nodes, gpus, s)["between nodes"] for s in crossing}
    assert model["fsdp"] / model["hsdp"] == 2.25 and model["ddp"] / model["hsdp"] == 1.5
    assert crossing["fsdp"] / crossing["hsdp"] == pytest.approx(3.0, rel=0.02), crossing
    assert crossing["ddp"] / crossing["hsdp"] == pytest.approx(1.5, rel=0.02), crossing


def _recorded_rank(rank, world_size):
    import torch.distributed as dist

    from course_utils.compat import dump_flight_recorder
    from course_utils.exercises.on_ranks import collectives_recorded

    with collectives_recorded() as kinds:
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world_size))
    if kinds is None:  # this torch cannot dump the Flight Recorder
        return None
    last = max(dump_flight_recorder(stacks=False)["entries"], key=lambda e: e["record_id"])
    return kinds, last["input_sizes"]


def test_gloo_s_flight_recorder_logs_a_reduce_scatter_as_an_all_reduce_of_the_whole_tensor():
    recorded = launch(_recorded_rank, 2, echo=False, timeout_s=120)
    if None in recorded:
        pytest.skip("this torch cannot dump the Flight Recorder")
    for kinds, sizes in recorded:
        assert kinds == ["all_reduce"] and sizes == [[8]], (kinds, sizes)
