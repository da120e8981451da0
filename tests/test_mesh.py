"""Notebook 09's mesh section: a 2-D DeviceMesh, HSDP equal to DDP and one process on 4 ranks, the
bytes each rank sends counted by link against ``ledgers.link_bytes_per_step``, and the ledger's
HSDP row against the bytes each rank holds."""

import pytest
import torch

from course_utils.dataparallel.memory import ModelSpec
from course_utils.distributed import launch
from course_utils.sharding import ledgers
from course_utils.sharding import mesh as mesh_runs
from course_utils.sharding import runs as sharded_runs

RUNS = ("ddp", "fsdp", "hsdp")


@pytest.fixture(scope="module")
def single():
    return sharded_runs.train_single()


@pytest.fixture(scope="module", params=[2, 1, 4], ids=lambda n: f"{n}x{4 // n}")
def runs(request):
    """mesh_rank on 4 ranks laid out as nodes × GPUs: 2 × 2 (the notebook's), 1 × 4 and 4 × 1."""
    return request.param, launch(mesh_runs.mesh_rank, 4, request.param, echo=False, timeout_s=180)


def test_hsdp_equals_ddp_fsdp_and_one_process(runs, single):
    _, results = runs
    for out in results:
        for run in RUNS:
            torch.testing.assert_close(out[run]["parameters"], single)
            torch.testing.assert_close(out[run]["parameters"], out["ddp"]["parameters"])


def test_the_mesh_names_each_rank_s_groups_and_which_stay_in_a_node(runs):
    nodes, results = runs
    gpus = 4 // nodes
    for rank, out in enumerate(results):
        mesh = out["mesh"]
        assert mesh["coordinate"] == {"replicate": rank // gpus, "shard": rank % gpus}
        assert mesh["groups"]["shard"] == [rank // gpus * gpus + g for g in range(gpus)]
        assert mesh["groups"]["replicate"] == [n * gpus + rank % gpus for n in range(nodes)]
        assert mesh["inside one node"] == {"replicate": nodes == 1, "shard": True}
        assert out["hsdp"]["placements"] == "(Replicate(), Shard(dim=0))"
        assert out["fsdp"]["placements"] == "(Shard(dim=0),)"


def test_the_bytes_counted_on_each_link_are_the_formula_s(runs):
    nodes, results = runs
    psi = sum(torch.Size(s).numel() for s in results[0]["shapes"])
    assert psi == 1732  # every layer's rows divide by 4: FSDP pads nothing
    for out in results:
        for run in RUNS:
            formula = ledgers.link_bytes_per_step(psi, nodes, 4 // nodes, run)
            counted = {link: sum(kinds.values()) for link, kinds in out[run]["sent"].items()}
            assert counted == formula, (run, counted, formula)
    if nodes == 2:  # the notebook's table
        sent = results[0]
        assert sent["hsdp"]["sent"]["between nodes"] == {"all_reduce": 3464.0}  # 2 (4Ψ/2)(1/2)
        assert sent["hsdp"]["sent"]["inside node"] == {"all_gather": 6928.0, "reduce_scatter": 3464.0}
        assert sent["hsdp"]["groups"] == {"inside node": [(0, 1)], "between nodes": [(0, 2)]}
        assert sum(sent["fsdp"]["sent"]["between nodes"].values()) == 15588.0
        assert sum(sent["ddp"]["sent"]["between nodes"].values()) == 10392.0


def test_the_ledger_s_hsdp_row_is_what_each_rank_holds(runs):
    nodes, results = runs
    gpus = 4 // nodes
    shapes = results[0]["shapes"]
    numels = [torch.Size(s).numel() for s in shapes]
    for rank, out in enumerate(results):
        assert out["ddp"]["held"] == ledgers.sharded_bytes(numels, 4, "ddp")
        assert out["fsdp"]["held"] == ledgers.sharded_bytes((), 4, "fsdp", rank=rank, shapes=shapes)
        held = ledgers.sharded_bytes((), gpus, "hsdp", rank=rank % gpus, shapes=shapes)
        assert out["hsdp"]["held"] == held
    assert sum(results[0]["hsdp"]["held"].values()) == 16 * 1732 // gpus


@pytest.mark.parametrize(("nodes", "gpus"), [(2, 8), (4, 8), (16, 8), (3, 4)])
def test_link_bytes_per_step(nodes, gpus):
    psi = 10**9
    ddp, fsdp, hsdp = (ledgers.link_bytes_per_step(psi, nodes, gpus, s) for s in RUNS)
    world = nodes * gpus
    assert ddp == {"inside node": 0.0, "between nodes": ledgers.comm_bytes_per_step(psi, world, "ddp")}
    assert fsdp == {"inside node": 0.0, "between nodes": ledgers.comm_bytes_per_step(psi, world, "fsdp")}
    assert hsdp["inside node"] == ledgers.comm_bytes_per_step(psi, gpus, "fsdp")
    assert hsdp["between nodes"] == pytest.approx(2 * 4 * psi / gpus * (nodes - 1) / nodes, rel=1e-12)
    # least on the slow link: HSDP, by a factor of more than G against DDP, more still against FSDP
    assert hsdp["between nodes"] * gpus < ddp["between nodes"] < fsdp["between nodes"]


def test_link_bytes_per_step_refuses_bad_input():
    with pytest.raises(ValueError, match="strategy"):
        ledgers.link_bytes_per_step(10, 2, 2, "zero1")
    with pytest.raises(ValueError, match="nodes"):
        ledgers.link_bytes_per_step(10, 0, 2, "hsdp")
    with pytest.raises(TypeError):
        ledgers.link_bytes_per_step(10, 2, 2.5, "hsdp")
    with pytest.raises(ValueError, match="numel"):
        ledgers.link_bytes_per_step(-1, 2, 2, "hsdp")


def test_hsdp_ledger_shards_over_one_node():
    spec = ModelSpec.bert_like()
    state = ("parameters", "gradients", "optimizer state")
    hsdp = ledgers.sharded_ledger(spec, "hsdp", batch_size=64, num_devices=16, gpus_per_node=8)
    fsdp8 = ledgers.sharded_ledger(spec, "fsdp", batch_size=64, num_devices=8)
    fsdp16 = ledgers.sharded_ledger(spec, "fsdp", batch_size=64, num_devices=16)
    assert hsdp.label == "HSDP"
    assert [hsdp.rows[0][c] for c in state] == [fsdp8.rows[0][c] for c in state]
    assert hsdp.rows[0]["activations"] == fsdp16.rows[0]["activations"]  # the batch splits 16 ways
    with pytest.raises(ValueError, match="divide"):
        ledgers.sharded_ledger(spec, "hsdp", batch_size=64, num_devices=16, gpus_per_node=3)
    with pytest.raises(TypeError):
        ledgers.sharded_ledger(spec, "hsdp", batch_size=64, num_devices=16)
