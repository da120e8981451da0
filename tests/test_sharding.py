"""ZeRO by hand, the sharded ledgers and the FSDP2 / DCP runs of notebook 10."""

import pytest
import torch

from course_utils.dataparallel.memory import ModelSpec, ledger
from course_utils.distributed import launch
from course_utils.sharding import ledgers, runs
from course_utils.sharding.zero import STAGES, CommLog, ZeroByHand, shard_numel


@pytest.fixture(scope="module")
def single():
    return runs.train_single()


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_stage_equals_ddp_and_one_process(world_size, single):
    results = launch(runs.zero_by_hand_rank, world_size, echo=False)
    for rank, out in enumerate(results):
        assert list(out) == ["ddp", "zero0", "zero1", "zero2", "zero3"]
        for run in out.values():
            torch.testing.assert_close(run["parameters"], single)
            torch.testing.assert_close(run["parameters"], out["ddp"]["parameters"])
        numels = out["zero0"]["numels"]
        padded = sum(shard_numel(n, world_size) for n in numels) * world_size
        for stage in STAGES:
            run = out[f"zero{stage}"]
            strategy = "ddp" if stage == 0 else f"zero{stage}"
            # the ledger's figures are the bytes of the tensors each rank holds
            assert run["held"] == ledgers.sharded_bytes(numels, world_size, strategy, rank=rank)
            # and the bytes counted per step are the formula's, for the padded size
            psi = sum(numels) if stage == 0 else padded  # ZeRO pads each unit to a multiple of N
            expected = ledgers.comm_bytes_per_step(psi, world_size, strategy)
            assert sum(run["sent"].values()) == (expected if stage else pytest.approx(expected, rel=1e-12))
        assert out["zero3"]["sent"]["all_gather"] == 2 * out["zero1"]["sent"]["all_gather"]


def _api_rank_with_peaks_seen(rank, world_size, *args):
    """api_rank, with cuda_peak replaced by a stand-in that notes the blocks it measures, and
    fully_shard by one that notes the device type of the mesh it is given (None: no mesh) beside the
    rank's own."""
    import contextlib

    import torch.distributed.fsdp as fsdp

    blocks, meshes, fully_shard = [], [], fsdp.fully_shard

    @contextlib.contextmanager
    def noting(device, peaks, name):
        blocks.append(name)
        yield
        peaks[name] = len(blocks)

    def sharding(module, *, mesh=None, **options):
        from course_utils.devices import rank_device

        meshes.append((None if mesh is None else mesh.device_type, rank_device().type))
        return fully_shard(module, mesh=mesh, **options)

    runs.cuda_peak, fsdp.fully_shard = noting, sharding
    return runs.api_rank(rank, world_size, *args), blocks, meshes


def test_api_runs_equal_one_process_and_a_checkpoint_reshards_bitwise(tmp_path, single):
    path = str(tmp_path / "ckpt")
    saved, blocks, meshes = zip(*launch(_api_rank_with_peaks_seen, 2, 3, 12, 1e-2, path, echo=False),
                                strict=True)
    # each run's GPU peak is measured over that run alone (cuda_peak resets, see below)
    assert blocks[0] == ["zero_redundancy", "fsdp", "fsdp_kept", "bf16"]
    # every fully_shard is given a mesh on the rank's device (the CPU under gloo): fully_shard's own
    # default mesh would be on the machine's GPU, where a gloo job's rank 1 asks for cuda:1
    assert len(meshes[0]) == len(meshes[1]) == 12  # three runs, four fully_shard calls each
    assert all(given == device for calls in meshes for given, device in calls), meshes
    assert saved[0]["cuda_peak_bytes"] == {"zero_redundancy": 1, "fsdp": 2, "fsdp_kept": 3, "bf16": 4}
    psi = sum(p.numel() for p in single)  # 1732: every layer splits evenly over 2 ranks
    for out in saved:
        # bytes per step, counted as the by-hand stages are: ZeroRedundancyOptimizer with DDP
        # all-reduces every gradient, then broadcasts every parameter: 1.5 times DDP's traffic
        assert out["sent"]["zero_redundancy"] == {"all_reduce": ledgers.comm_bytes_per_step(psi, 2, "ddp"),
                                                  "broadcast": 4 * psi / 2}
        assert sum(out["sent"]["zero_redundancy"].values()) == ledgers.comm_bytes_per_step(
            psi, 2, "zero_redundancy") == 1.5 * ledgers.comm_bytes_per_step(psi, 2, "zero1")
        assert out["sent"]["fsdp"] == {"reduce_scatter": 4 * psi / 2, "all_gather": 2 * 4 * psi / 2}
        assert sum(out["sent"]["fsdp_kept"].values()) == ledgers.comm_bytes_per_step(psi, 2, "zero2")
        # bf16 compute: parameters gathered in bf16, gradients reduced in fp32, as the policy says
        assert out["bf16"]["all-gathered in"] == ["torch.bfloat16"]
        assert out["bf16"]["reduce-scattered in"] == ["torch.float32"]
        assert out["bf16"]["gradient dtype"] == "torch.float32"
    for rank, out in enumerate(saved):
        torch.testing.assert_close(out["zero_redundancy"], single)
        torch.testing.assert_close(out["fsdp"], single)
        assert all(torch.equal(a, b) for a, b in zip(out["fsdp"], out["fsdp_kept"], strict=True))
        assert out["dtensor"]["type"] == "DTensor" and out["dtensor"]["placements"] == "(Shard(dim=0),)"
        assert out["dtensor"]["local"] == (16, 16) and out["dtensor"]["global"] == (32, 16)
        assert out["fsdp_held"] == ledgers.sharded_bytes((), 2, "fsdp", rank=rank, shapes=out["shapes"])
        assert out["bf16"]["output dtype"] == "torch.bfloat16"
        assert out["bf16"]["sharded dtype"] == "torch.float32"
    # clipping sees the norm of the whole gradient: the shards' squares summed over ranks
    norms = [out["dtensor"]["local_norm_alone"] for out in saved]
    clip = saved[0]["dtensor"]["clip_norm"]
    assert saved[1]["dtensor"]["clip_norm"] == clip
    assert clip == pytest.approx(sum(n * n for n in norms) ** 0.5, rel=1e-5)
    assert all(n < clip for n in norms)
    # ZeroRedundancyOptimizer splits whole parameters: together the ranks hold Adam's state once
    psi = sum(p.numel() for p in single)
    states = [out["zero_redundancy_state"] for out in saved]
    assert sum(states) == 8 * psi and max(states) < 8 * psi
    loaded = launch(runs.dcp_load_rank, 3, path, echo=False)
    for out in loaded:
        assert all(torch.equal(a, b) for a, b in zip(out["parameters"], saved[0]["fsdp"], strict=True))
    assert [out["local"][0] for out in loaded] == [(11, 16), (11, 16), (10, 16)]


def test_fsdp_local_numel_follows_torch_chunk():
    shapes = [(32, 16), (32,), (4, 32), (4,), (1, 3)]
    for n in (1, 2, 3, 5, 8):
        for rank in range(n):
            expected = 0
            for shape in shapes:
                chunks = torch.empty(shape).chunk(n)
                expected += chunks[rank].numel() if rank < len(chunks) else 0
            assert ledgers.fsdp_local_numel(shapes, n, rank) == expected
        assert sum(ledgers.fsdp_local_numel(shapes, n, r) for r in range(n)) == 544 + 132 + 3


def test_sharded_bytes_is_the_table():
    psi = 1000  # divisible by 4: no padding
    full = {"parameters": 4 * psi, "gradients": 4 * psi, "optimizer state": 8 * psi}
    assert ledgers.sharded_bytes([psi], 4, "ddp") == full
    assert ledgers.sharded_bytes([psi], 4, "zero1") == {**full, "optimizer state": 2 * psi}
    assert ledgers.sharded_bytes([psi], 4, "zero2") == {**full, "gradients": psi, "optimizer state": 2 * psi}
    assert ledgers.sharded_bytes([psi], 4, "zero3") == {"parameters": psi, "gradients": psi,
                                                         "optimizer state": 2 * psi}
    assert ledgers.sharded_bytes([5], 4, "zero3")["parameters"] == 8  # padded to 8: 2 each


def test_sharded_ledger_mixed_precision_is_the_zero_papers_2_2_k():
    spec = ModelSpec.linear(1023, 1)  # 1024 parameters
    base = ledger(spec, "ddp", batch_size=8, num_devices=8)
    for strategy, per_param in (("ddp", 16), ("zero1", 4 + 12 / 8), ("zero2", 2 + 14 / 8), ("zero3", 16 / 8)):
        led = ledgers.sharded_ledger(spec, strategy, batch_size=8, num_devices=8, mixed_precision=True)
        model_state = sum(led.rows[0][c] for c in ("parameters", "gradients", "optimizer state"))
        assert model_state == per_param * 1024
        assert led.rows[0]["activations"] == base.rows[0]["activations"]
        assert led.rows[0]["inputs"] == base.rows[0]["inputs"]
        assert led.label == {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}[strategy]
    fp32 = ledgers.sharded_ledger(spec, "ddp", batch_size=8, num_devices=8)
    assert fp32.rows == base.rows  # fp32 DDP is notebook 04's ledger, buckets included


def test_comm_formulas():
    assert ledgers.comm_bytes_per_step(100, 1, "ddp") == 0
    assert ledgers.comm_bytes_per_step(100, 4, "zero2") == 2 * 400 * 3 / 4
    assert ledgers.comm_bytes_per_step(100, 4, "zero3") == 3 * 400 * 3 / 4
    assert ledgers.comm_bytes_per_step(100, 4, "fsdp") == ledgers.comm_bytes_per_step(100, 4, "zero3")


def test_zero_by_hand_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs a process group"):
        ZeroByHand(torch.nn.Linear(2, 2), 1)


def test_cuda_peak_measures_each_block_alone(monkeypatch):
    """A block's peak is its own: reset first, so a larger earlier block does not show in a later one."""
    allocator = {"now": 0, "peak": 0}

    def allocate(nbytes):
        allocator["now"] += nbytes
        allocator["peak"] = max(allocator["peak"], allocator["now"])
        allocator["now"] -= nbytes  # freed at once

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device: allocator.update(peak=allocator["now"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocator["peak"])
    peaks = {}
    cuda = torch.device("cuda", 0)
    with runs.cuda_peak(cuda, peaks, "big"):
        allocate(1000)
    with runs.cuda_peak(cuda, peaks, "small"):
        allocate(10)
    assert peaks == {"big": 1000, "small": 10}
    with runs.cuda_peak(torch.device("cpu"), peaks, "cpu"):
        allocate(5)
    assert "cpu" not in peaks


def test_logged_collectives_counts_torchs_calls_once_under_either_name():
    results = launch(_logged_calls, 2, echo=False, backend="gloo")
    for sent, calls, dtypes in results:
        assert calls == {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 2, "broadcast": 1}
        # the all-gathers' shards: 16 bytes of float32, then 8 of bfloat16
        assert sent == {"all_reduce": 2 * 16 / 2, "reduce_scatter": 2 * 8, "all_gather": 16 + 8,
                        "broadcast": 8 / 2}
        assert dtypes["all_gather"] == {"torch.float32", "torch.bfloat16"}


def _logged_calls(rank, world_size):
    import torch.distributed as dist

    log, original = CommLog(), dist.all_reduce
    with runs.logged_collectives(log):
        dist.all_reduce(torch.ones(4))  # 16 bytes
        dist.broadcast(torch.ones(2), 0)  # 8 bytes
        for old in (False, True):  # 2.13's names, then the deprecated ones (which call them)
            gather = dist.all_gather_into_tensor if old else dist.all_gather_single
            scatter = dist.reduce_scatter_tensor if old else dist.reduce_scatter_single
            dtype = torch.bfloat16 if old else torch.float32
            gather(torch.empty(4 * world_size, dtype=dtype), torch.ones(4, dtype=dtype))
            scatter(torch.empty(2), torch.ones(2 * world_size))
    assert dist.all_reduce is original  # put back on the way out
    return log.sent, log.calls, log.dtypes
