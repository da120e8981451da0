import random
import re
import sys
import types
from pathlib import Path

import nbformat
import pytest
import torch

from course_utils import env

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_report_describes_this_machine():
    report = env.device_report()
    assert report.torch == torch.__version__
    assert report.cuda_available == torch.cuda.is_available()
    assert report.gpu_count == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report.gloo == torch.distributed.is_gloo_available()
    text = str(report)
    assert f"PyTorch          : {torch.__version__}" in text
    assert "gloo available" in text and "NCCL available" in text
    # every notebook after this one, numbered as its file is: derived from notebooks/, not typed
    after_00 = [p.name[:2] for p in NOTEBOOKS if not p.name.startswith("00_")]
    assert len(after_00) >= 10
    assert [line.split()[0] for line in report.plan_lines()] == after_00
    assert env.course_notebooks() == [p.stem for p in NOTEBOOKS if not p.name.startswith("00_")]


def test_every_notebook_has_its_own_plan_entry_and_row_in_notebook_00():
    stems = [p.stem for p in NOTEBOOKS if not p.name.startswith("00_")]
    for (label, text), stem in zip(env.course_plan(0, nccl=False, gloo=True), stems, strict=True):
        assert label.startswith(stem[:2] + " ") and text != "see the notebook", stem
    # installed without the notebooks (Colab): the topics in the course's order, numbered alike
    assert env.course_notebooks("no-such-folder") == stems
    table = [c.source for c in nbformat.read(NOTEBOOKS[0], as_version=4).cells
             if c.cell_type == "markdown" and "| notebook |" in c.source]
    assert [row[2:4] for row in table[0].splitlines() if re.match(r"\| \d\d ", row)] == \
        [stem[:2] for stem in stems]


def test_the_plan_follows_the_notebooks_it_is_given():
    plan = env.course_plan(0, nccl=False, gloo=True, notebooks=["01_single_gpu", "02_new_topic"])
    assert plan == (("01 one device", "the CPU (cuda:N is explained, not run)"),
                    ("02 new topic", "see the notebook"))


def topics(plan):
    """The plan's rows by label without the number, which a renumbering changes."""
    return {label.split(" ", 1)[1]: text for label, text in plan}


def test_plan_follows_the_hardware():
    no_gpu = topics(env.course_plan(0, nccl=False, gloo=True))
    two = topics(env.course_plan(2, nccl=True, gloo=True))
    assert "pass-through" in no_gpu["nn.DataParallel"]
    assert "emulation" in no_gpu["DataParallel by hand"]
    assert "gloo" in no_gpu["DistributedDataParallel"]
    assert "2 GPUs" in two["nn.DataParallel"]
    assert "NCCL" in two["DistributedDataParallel"]
    assert "unavailable" in topics(env.course_plan(0, nccl=False, gloo=False))["DistributedDataParallel"]


@pytest.mark.parametrize("gpus", [0, 1, 2, 3, 8])
@pytest.mark.parametrize("nccl", [True, False])
def test_the_plan_says_what_the_launchers_decide(gpus, nccl, monkeypatch):
    """Notebook 00's plan agrees with the decisions the code makes on 0, 1 and 2+ GPUs."""
    from course_utils import devices
    from course_utils.sharding.strategies import STRATEGIES, strategy_placement

    monkeypatch.delenv(devices.BACKEND_VARIABLE, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    from course_utils.debugging import hangs

    plan = topics(env.course_plan(gpus, nccl=nccl, gloo=True))
    two_rank_backend = devices.choose_backend(2, gpus=gpus, nccl_available=nccl)
    assert ("NCCL, one GPU per rank" in plan["DistributedDataParallel"]) == (two_rank_backend == "nccl")
    on_gpus = strategy_placement(STRATEGIES, 2, gpus=gpus, nccl=nccl) == "gpu"
    assert ("on GPUs" in plan["choosing a strategy"]) == on_gpus
    node_env = devices.emulated_node_env(0, 2, 1, gpus=gpus)
    nodes_on_gpus = "CUDA_VISIBLE_DEVICES" in node_env and two_rank_backend == "nccl"
    assert ("GPUs of its own" in plan["faults and nodes"]) == nodes_on_gpus
    assert ("cuda:0" in plan["one device"]) == (gpus > 0)
    assert ("measured on" in plan["memory per device"]) == (gpus >= 2)
    # notebook 10 launches 2 ranks with launch's choice; notebook 12's zoo is gloo by name
    assert ("NCCL, one GPU per rank" in plan["sharded data parallel"]) == (two_rank_backend == "nccl")
    assert hangs.ZOO_BACKEND == "gloo" and "broken programs on gloo" in plan["debugging"]
    assert ("fixes on NCCL" in plan["debugging"]) == (two_rank_backend == "nccl")
    assert ("fork error reproduced" in plan["debugging"]) == (gpus > 0)  # where CUDA is available


def test_in_colab(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert env.in_colab() is False
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert env.in_colab() is True


def test_seed_everything_makes_draws_repeatable():
    env.seed_everything(123)
    a = (random.random(), torch.randn(4))
    env.seed_everything(123)
    b = (random.random(), torch.randn(4))
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1])
    env.seed_everything(124)
    assert not torch.equal(torch.randn(4), b[1])


@pytest.mark.parametrize("bad, error", [(1.5, TypeError), ("0", TypeError), (-1, ValueError),
                                        (2**32, ValueError), (None, TypeError)])
def test_seed_everything_rejects_bad_seeds(bad, error):
    with pytest.raises(error, match="seed"):
        env.seed_everything(bad)


def test_pick_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert env.pick_device() == torch.device("cpu")
    assert env.pick_device(3) == torch.device("cpu")  # the sources' fallback: no GPU, use the CPU


def test_pick_device_with_simulated_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert env.pick_device() == torch.device("cuda:0")
    assert env.pick_device(1) == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"cuda:2 does not exist: this machine has 2 GPU\(s\)"):
        env.pick_device(2)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (0.0, TypeError), ("cuda:0", TypeError)])
def test_pick_device_rejects_bad_index(bad, error):
    with pytest.raises(error, match="index"):
        env.pick_device(bad)


def test_importing_the_package_does_not_initialise_cuda():
    import subprocess

    code = ("import course_utils, course_utils.env, course_utils.dataparallel.splits, course_utils.models, "
            "course_utils.data, torch; print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
