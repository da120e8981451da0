"""`make gpu-check` and the `gpu` tests, checked on a machine without a GPU.

The gpu tests themselves need GPUs; what CI can check is that every CUDA branch has one, that
without GPUs they are all skipped with a reason (never passed silently), and that the check's
report, its JUnit parsing, its notebook runner and its no-GPU exit work.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from course_utils.tools import gpu_check
from course_utils.tools.gpu_check import (
    NotebookResult,
    TestResult,
    allowed_skip,
    parse_junit,
    render_report,
    run_notebook,
    verdict,
)

REPO = Path(__file__).resolve().parent.parent
#: each CUDA branch of course_utils and the test in tests/test_gpu.py that runs it
BRANCHES = {
    "by_hand on cuda:i vs nn.DataParallel": "test_by_hand_equals_nn_data_parallel",
    "by_hand training vs one GPU": "test_compare_training_on_real_gpus",
    "parallel criterion vs one GPU": "test_parallel_criterion_equals_one_device",
    "memory.cuda_peak_bytes vs the ledger": "test_cuda_peak_bytes_agree_with_the_ledger",
    "fp16 autocast with GradScaler('cuda')": "test_fp16_autocast_with_grad_scaler",
    "launch with NCCL: the ddp.demos": "test_ddp_demos_under_nccl",
    "launch with NCCL: train_ddp": "test_train_ddp_under_nccl_equals_the_cpu_reference",
    "torchrun with NCCL and a restart": "test_torchrun_restart_under_nccl_resumes_bitwise",
    "a check and the GPU generators": "test_a_check_leaves_the_gpu_generators_as_the_learner_left_them",
}
NO_GPU = "this machine has a GPU: there the gpu tests run (make gpu-check) instead of skipping"


@pytest.fixture(scope="module")
def gpu_tests(tmp_path_factory):
    """One pytest run of tests/test_gpu.py in a subprocess, shared by the tests below: without a GPU
    the whole run (every test skips at once), with one only the collection (the tests themselves
    are `make gpu-check`'s). Returns (the run, its JUnit XML or None, the collected test names)."""
    xml = tmp_path_factory.mktemp("gpu") / "junit.xml"
    run_them = torch.cuda.device_count() == 0
    mode = [f"--junitxml={xml}"] if run_them else ["--collect-only", "-q"]
    # without the notebooks' options and nbval's plugin (nbformat alone costs 1 s to import)
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", *mode,
                             "-p", "no:cacheprovider", "-o", "addopts=-ra", "-p", "no:nbval"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    names = ([t.name for t in parse_junit(xml)] if run_them
             else [line for line in result.stdout.splitlines() if "::" in line])
    return result, xml if run_them else None, names


def test_every_cuda_branch_has_a_gpu_test(gpu_tests):
    _, _, names = gpu_tests
    assert names
    for branch, name in BRANCHES.items():
        assert any(re.search(f"::{name}(\\[|$)", line) for line in names), f"no gpu test for {branch}"


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason=NO_GPU)
def test_without_a_gpu_every_gpu_test_is_skipped_with_its_reason(gpu_tests):
    result, xml, _ = gpu_tests
    out = result.stdout
    collected = int(re.search(r"collected (\d+) items?", out).group(1))
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(rf"=+ {collected} skipped in [\d.]+s( \([\d:]+\))? =+", summary), summary
    reasons = re.findall(r"^SKIPPED \[(\d+)\] tests/test_gpu\.py:\d+: (.*)$", out, re.MULTILINE)
    assert sum(int(count) for count, _ in reasons) == collected >= len(BRANCHES)
    assert all(re.fullmatch(r"needs \d+ GPUs?; this machine has 0", reason) for _, reason in reasons)
    tests = parse_junit(xml)
    assert len(tests) == collected
    assert all(t.outcome == "skipped" and allowed_skip(t, 0) for t in tests)


def test_without_a_gpu_the_check_says_so_in_one_line_and_fails(tmp_path):
    report = tmp_path / "report.md"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, on any machine
    result = subprocess.run([sys.executable, "-m", "course_utils.tools.gpu_check", "--out", str(report)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == gpu_check.NO_GPU_EXIT == 2
    assert result.stdout.splitlines() == [
        f"gpu-check: no CUDA GPU on this machine (torch {torch.__version__}); nothing to check"]
    assert not report.exists()


ENV = {"devices": ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"], "torch": "2.13.0",
       "cuda": "12.8", "nccl": "2.27.3", "tf32": "matmul allow_tf32=False, cudnn allow_tf32=True"}
NOTEBOOKS = [NotebookResult("00_environment_check.ipynb", True, 12.34),
             NotebookResult("05_distributed_data_parallel.ipynb", False, 61.0,
                            "RankError: rank 1 raised RuntimeError")]
TESTS = [TestResult("tests.test_gpu::test_a[1gpu]", "passed"),
         TestResult("tests.test_gpu::test_a[4gpus]", "skipped", "needs 4 GPUs; this machine has 2"),
         TestResult("tests.test_gpu::test_b", "failed", "AssertionError: 1 | 2"),
         TestResult("tests.test_gpu::test_c", "skipped", "no reason")]


def test_render_report_shows_the_machine_every_row_and_the_verdict():
    report = render_report(ENV, NOTEBOOKS, TESTS)
    for value in ("2: NVIDIA H100 80GB HBM3, NVIDIA H100 80GB HBM3", "| torch | 2.13.0 |",
                  "| CUDA | 12.8 |", "| NCCL | 2.27.3 |", "matmul allow_tf32=False"):
        assert value in report
    assert "| 00_environment_check.ipynb | pass | 12.3 |  |" in report
    assert ("| 05_distributed_data_parallel.ipynb | FAIL | 61.0 | RankError: rank 1 raised RuntimeError |"
            in report)
    assert "| tests.test_gpu::test_a[1gpu] | pass |  |" in report
    assert "| tests.test_gpu::test_a[4gpus] | skip (allowed) | needs 4 GPUs; this machine has 2 |" in report
    assert "| tests.test_gpu::test_b | FAIL | AssertionError: 1 \\| 2 |" in report  # a | is escaped
    assert "| tests.test_gpu::test_c | SKIP (not allowed) | no reason |" in report
    assert "**Verdict: FAIL** (3 problems)" in report
    assert "- notebook 05_distributed_data_parallel.ipynb failed: RankError" in report
    passing = render_report(ENV, NOTEBOOKS[:1], TESTS[:2])
    assert "**Verdict: PASS**" in passing and "## Problems" not in passing


def test_verdict_allows_only_skips_for_missing_gpus():
    assert verdict(NOTEBOOKS[:1], TESTS[:2], gpus=2) == []
    assert verdict(NOTEBOOKS[:1], TESTS[:2], gpus=4) == [
        "test tests.test_gpu::test_a[4gpus] skipped: needs 4 GPUs; this machine has 2"]
    assert verdict([], [], gpus=1) == ["no gpu test ran", "no notebook ran"]
    assert not allowed_skip(TestResult("t", "passed", "needs 4 GPUs; this machine has 1"), 1)


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="2" tests="6">
<testcase classname="tests.test_gpu" name="test_ok[1gpu]" time="0.5"/>
<testcase classname="tests.test_gpu" name="test_ok[2gpus]" time="0.0">
  <skipped type="pytest.skip" message="needs 2 GPUs; this machine has 1">tests/test_gpu.py:9: needs 2 GPUs; \
this machine has 1</skipped></testcase>
<testcase classname="tests.test_gpu" name="test_bad" time="0.1">
  <failure message="AssertionError: assert 1 == 2&#10;second line">trace</failure></testcase>
<testcase classname="tests.test_gpu" name="test_teardown" time="0.1">
  <failure message="assert False">trace</failure><error message="failed on teardown">trace</error></testcase>
<testcase classname="tests.test_gpu" name="test_xfail" time="0.0">
  <skipped type="pytest.xfail" message="known"/></testcase>
<testcase classname="" name="tests.test_gpu" time="0.0">
  <error message="collection failure">x</error></testcase>
</testsuite></testsuites>
"""


def test_parse_junit_reads_each_outcome(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(JUNIT)
    assert parse_junit(xml) == [
        TestResult("tests.test_gpu::test_ok[1gpu]", "passed"),
        TestResult("tests.test_gpu::test_ok[2gpus]", "skipped", "needs 2 GPUs; this machine has 1"),
        TestResult("tests.test_gpu::test_bad", "failed", "AssertionError: assert 1 == 2"),
        TestResult("tests.test_gpu::test_teardown", "error", "failed on teardown"),
        TestResult("tests.test_gpu::test_xfail", "skipped", "known"),
        TestResult("tests.test_gpu", "error", "collection failure"),
    ]
    (tmp_path / "bad.xml").write_text("<testsuite><testcase")
    with pytest.raises(ValueError, match="is not JUnit XML"):
        parse_junit(tmp_path / "bad.xml")


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: render_report([], [], []), TypeError, "env must be a dict"),
    (lambda: render_report(ENV, NOTEBOOKS, ["test"]), TypeError, "tests must be a list of TestResult"),
    (lambda: verdict(NOTEBOOKS, TESTS, gpus=-1), ValueError, "gpus must be an int >= 0"),
    (lambda: parse_junit(3), TypeError, "path must be a str or a path"),
    (lambda: run_notebook("x.ipynb", timeout_s=0), FileNotFoundError, "no notebook at x.ipynb"),
    (lambda: run_notebook(REPO / "notebooks" / "00_environment_check.ipynb", timeout_s=0), ValueError,
     "timeout_s must be a number of seconds > 0"),
    (lambda: TestResult("", "passed"), TypeError, "name must be a non-empty str"),
    (lambda: NotebookResult("n.ipynb", "yes", 1.0), TypeError, "passed must be a bool"),
])
def test_bad_arguments_are_clear_errors(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def notebook(path: Path, *sources: str) -> Path:
    """A notebook of these code cells; a source that starts with "# " is a markdown cell."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(s) if s.startswith("# ") else
                                         nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_run_notebook_executes_in_memory_in_the_notebooks_folder(tmp_path):
    (tmp_path / "data.txt").write_text("beside the notebook")
    good = notebook(tmp_path / "good.ipynb", "text = open('data.txt').read()",
                    "assert text == 'beside the notebook', text")
    bad = notebook(tmp_path / "bad.ipynb", "# A title", "x = 1",
                   "y = 2\nraise ValueError('broken here\\nand more')", "z = 3")
    stored = good.read_bytes(), bad.read_bytes()
    passed = run_notebook(good, 120)
    assert (passed.name, passed.passed, passed.error) == ("good.ipynb", True, "")
    failed = run_notebook(bad, 120)
    assert (failed.name, failed.passed) == ("bad.ipynb", False)
    # the first line of the error, then where: the code cell, counted from 0 as nbval names them
    # ("Cell 1": the markdown cell is not counted), and the line
    where = "(cell 1, line 2: raise ValueError('broken here\\nand more'))"
    assert failed.error == f"ValueError: broken here {where}"
    assert (good.read_bytes(), bad.read_bytes()) == stored  # nothing written back


def test_a_notebook_that_runs_too_long_fails_with_a_timeout(tmp_path):
    slow = notebook(tmp_path / "slow.ipynb", "import time", "time.sleep(600)")
    result = run_notebook(slow, timeout_s=3)
    assert not result.passed and result.error == "Timeout: did not finish within 3 s"


def test_main_runs_the_tests_and_the_notebooks_and_writes_the_report(tmp_path, monkeypatch, capsys):
    """The wiring, with the GPU, the test run and the notebooks stubbed out."""
    (tmp_path / "notebooks").mkdir()
    for name in ("01_b.ipynb", "00_a.ipynb"):
        (tmp_path / "notebooks" / name).write_text("{}")
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(gpu_check, "environment", lambda: ENV)
    monkeypatch.setattr(gpu_check, "run_gpu_tests", lambda root, timeout_s: TESTS[:2])
    ran = []
    monkeypatch.setattr(gpu_check, "run_notebook",
                        lambda path, timeout_s: ran.append(path.name) or NotebookResult(path.name, True, 1.0))
    out = tmp_path / "report.md"
    assert gpu_check.main(["--out", str(out), "--timeout", "30"]) == 0
    assert ran == ["00_a.ipynb", "01_b.ipynb"]
    assert capsys.readouterr().out == out.read_text() + "\n"
    assert "**Verdict: PASS**" in out.read_text()
    monkeypatch.setattr(gpu_check, "run_gpu_tests", lambda root, timeout_s: TESTS)
    assert gpu_check.main(["--out", str(out)]) == 1
    assert "**Verdict: FAIL**" in out.read_text()


def test_jobs_run_the_notebooks_at_once_beside_the_tests_and_report_them_in_order(tmp_path, monkeypatch):
    """--jobs 3: the tests and three notebooks start before any of them ends; the report keeps the
    notebooks' order and each one's result."""
    import threading

    (tmp_path / "notebooks").mkdir()
    for name in ("02_c.ipynb", "00_a.ipynb", "01_b.ipynb"):
        (tmp_path / "notebooks" / name).write_text("{}")
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(gpu_check, "environment", lambda: ENV)
    together = threading.Barrier(4, timeout=30)  # one after the other, this would raise BrokenBarrierError

    def tests(root, timeout_s):
        together.wait()
        return TESTS[:2]

    def notebook(path, timeout_s):
        together.wait()
        failed = path.name == "01_b.ipynb"
        return NotebookResult(path.name, not failed, 1.0, "E: x" if failed else "")

    monkeypatch.setattr(gpu_check, "run_gpu_tests", tests)
    monkeypatch.setattr(gpu_check, "run_notebook", notebook)
    out = tmp_path / "report.md"
    assert gpu_check.main(["--out", str(out), "--jobs", "3"]) == 1
    rows = [line.split(" | ")[:2] for line in out.read_text().splitlines() if line.startswith("| 0")]
    assert rows == [["| 00_a.ipynb", "pass"], ["| 01_b.ipynb", "FAIL"], ["| 02_c.ipynb", "pass"]]
    with pytest.raises(SystemExit):
        gpu_check.main(["--jobs", "0"])
