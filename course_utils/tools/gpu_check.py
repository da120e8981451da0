"""``make gpu-check``: the ``gpu`` tests and every notebook on this machine's GPUs, and a report.

Without a CUDA GPU it prints one line and exits with 2. Otherwise it runs ``pytest -m gpu tests``
(outcomes read from its JUnit XML), executes every notebook top to bottom in memory (nothing is
written back; the kernel starts in ``notebooks/``) and writes a markdown report to stdout and to
``--out``. ``--jobs N`` runs N notebooks at a time beside the tests, from threads (on 2026-11-27 a
one-GPU H100 machine with 16 cores ran the same steps 4, then 5, at a time from processes; the
threads are proven on the CPU). Exit 0 only if every gpu test passed (a skip counts only when
the test needs more GPUs than this machine has) and every notebook ran without an error; else 1.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .._checks import check_number, check_seconds
from .nbtools import first_line

__all__ = ["NO_GPU_EXIT", "NotebookResult", "TestResult", "allowed_skip", "environment", "main",
           "parse_junit", "render_report", "run_gpu_tests", "run_notebook", "verdict"]

ROOT = Path(__file__).resolve().parents[2]
NO_GPU_EXIT = 2
OUTCOMES = ("passed", "failed", "error", "skipped")
#: the reason tests/test_gpu.py gives when a test needs more GPUs than the machine has
_NEEDS_GPUS = re.compile(r"needs (\d+) GPUs?; this machine has (\d+)")


def _existing(path: object, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    return Path(path)


@dataclass(frozen=True)
class _Named:
    """A record of the report, named after a test or a notebook."""

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")


@dataclass(frozen=True)
class TestResult(_Named):
    """One test as pytest's JUnit XML reports it; ``outcome`` is one of ``OUTCOMES``."""

    __test__ = False  # a record, not a test class for pytest to collect
    outcome: str
    message: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {self.outcome!r}")


@dataclass(frozen=True)
class NotebookResult(_Named):
    """One notebook's run: ``error`` is ``"ExceptionName: first line"``, empty when it passed."""

    passed: bool
    seconds: float
    error: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.passed, bool):
            raise TypeError(f"passed must be a bool, got {self.passed!r}")
        check_number("seconds", self.seconds, at_least=0)


def environment() -> dict:
    """What the report's header shows: GPUs, torch, CUDA and NCCL versions, TF32 settings."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = "-"
    with contextlib.suppress(AttributeError, RuntimeError):  # a build without NCCL has none
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if count else "-"
    tf32 = (f"matmul allow_tf32={torch.backends.cuda.matmul.allow_tf32}, cudnn allow_tf32="
            f"{torch.backends.cudnn.allow_tf32}, matmul precision {torch.get_float32_matmul_precision()!r}")
    return {"devices": [torch.cuda.get_device_name(i) for i in range(count)], "torch": torch.__version__,
            "cuda": torch.version.cuda or "-", "nccl": nccl, "tf32": tf32}


def parse_junit(path: str | os.PathLike) -> list[TestResult]:
    """Each ``testcase`` of a pytest JUnit XML file: error > failure > skipped > passed."""
    path = _existing(path, "JUnit XML")
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        raise ValueError(f"{path} is not JUnit XML: {err}") from None
    results, order = [], ("skipped", "failure", "error")  # the last one found wins
    for case in root.iter("testcase"):
        name = "::".join(part for part in (case.get("classname"), case.get("name")) if part) or "(unnamed)"
        worst = max((c for c in case if c.tag in order), key=lambda c: order.index(c.tag), default=None)
        outcome = "passed" if worst is None else {"failure": "failed"}.get(worst.tag, worst.tag)
        message = "" if worst is None else first_line(worst.get("message", ""))
        results.append(TestResult(name, outcome, message))
    return results


def allowed_skip(test: TestResult, gpus: int) -> bool:
    """True for a skip whose reason is that the test needs more GPUs than ``gpus``."""
    if not isinstance(test, TestResult):
        raise TypeError(f"test must be a TestResult, got {type(test).__name__}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus must be an int >= 0, got {gpus!r}")
    found = _NEEDS_GPUS.search(test.message)
    return test.outcome == "skipped" and found is not None and int(found.group(1)) > gpus


def verdict(notebooks: Sequence[NotebookResult], tests: Sequence[TestResult], gpus: int) -> list[str]:
    """What keeps the check from passing; an empty list means it passed."""
    if not all(isinstance(n, NotebookResult) for n in notebooks):
        raise TypeError("notebooks must be a list of NotebookResult")
    if not all(isinstance(t, TestResult) for t in tests):
        raise TypeError("tests must be a list of TestResult")
    problems = ["no gpu test ran"] * (not tests) + ["no notebook ran"] * (not notebooks)
    for t in tests:
        if t.outcome in ("failed", "error") or (t.outcome == "skipped" and not allowed_skip(t, gpus)):
            problems.append(f"test {t.name} {t.outcome}" + (f": {t.message}" if t.message else ""))
    problems += [f"notebook {n.name} failed: {n.error}" for n in notebooks if not n.passed]
    return problems


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_report(env: dict, notebooks: Sequence[NotebookResult], tests: Sequence[TestResult]) -> str:
    """The markdown report: the machine, one row per notebook, one row per test, the verdict."""
    if not isinstance(env, dict):
        raise TypeError(f"env must be a dict (see environment()), got {type(env).__name__}")
    missing = [k for k in ("devices", "torch", "cuda", "nccl", "tf32") if k not in env]
    if missing:
        raise ValueError(f"env lacks {missing}: build it with environment()")
    gpus = len(env["devices"])
    problems = verdict(notebooks, tests, gpus)
    counted = f" ({len(problems)} problem{'s' if len(problems) > 1 else ''})" if problems else ""
    lines = ["# GPU check", "", f"**Verdict: {'FAIL' if problems else 'PASS'}**{counted}", "",
             "| | |", "|---|---|", f"| GPUs | {gpus}: {_cell(', '.join(env['devices'])) or 'none'} |",
             f"| torch | {_cell(env['torch'])} |", f"| CUDA | {_cell(env['cuda'])} |",
             f"| NCCL | {_cell(env['nccl'])} |", f"| TF32 | {_cell(env['tf32'])} |",
             "", "## Notebooks", "", "| notebook | result | seconds | error |", "|---|---|---:|---|"]
    lines += [f"| {_cell(n.name)} | {'pass' if n.passed else 'FAIL'} | {n.seconds:.1f} | "
              f"{_cell(n.error)} |" for n in notebooks]
    lines += ["", "## gpu tests", "",
              "A skip is allowed only for a test that needs more GPUs than this machine has.", "",
              "| test | result | message |", "|---|---|---|"]
    for t in tests:
        shown = {"passed": "pass", "failed": "FAIL", "error": "ERROR"}.get(t.outcome)
        shown = shown or ("skip (allowed)" if allowed_skip(t, gpus) else "SKIP (not allowed)")
        lines.append(f"| {_cell(t.name)} | {shown} | {_cell(t.message)} |")
    if problems:
        lines += ["", "## Problems", ""] + [f"- {_cell(p)}" for p in problems]
    return "\n".join(lines) + "\n"


def run_gpu_tests(root: str | os.PathLike = ROOT, timeout_s: float = 1800.0) -> list[TestResult]:
    """``pytest -m gpu tests`` in ``root``; pytest's own output goes to stderr."""
    if not (Path(root) / "tests").is_dir():
        raise FileNotFoundError(f"no tests/ folder in {root}")
    check_seconds("timeout_s", timeout_s)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={xml}"]
        try:
            code = subprocess.run(command, cwd=root, stdout=sys.stderr, stderr=sys.stderr,
                                  stdin=subprocess.DEVNULL, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = f"a timeout after {timeout_s:g} s"
        return parse_junit(xml) if xml.is_file() else [
            TestResult("pytest -m gpu tests", "error", f"no JUnit XML (pytest ended with {code})")]


def run_notebook(path: str | os.PathLike, timeout_s: float = 900.0) -> NotebookResult:
    """Execute a notebook top to bottom in memory; the kernel starts in the notebook's folder."""
    import nbformat

    from .nbtools import run_in_memory

    path = _existing(path, "notebook")
    check_seconds("timeout_s", timeout_s)
    print(f"gpu-check: executing {path.name}", file=sys.stderr, flush=True)
    error, seconds = run_in_memory(nbformat.read(path, as_version=4), path.parent, timeout_s)
    return NotebookResult(path.name, not error, seconds, error)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (0 pass, 1 fail, 2 no GPU)."""
    parser = argparse.ArgumentParser(prog="python -m course_utils.tools.gpu_check", description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check-report.md", help="the report's file")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per notebook")
    parser.add_argument("--tests-timeout", type=float, default=1800.0, help="seconds for all the gpu tests")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks run at a time, beside the gpu "
                        "tests (1: the tests, then each notebook in turn)")
    args = parser.parse_args(argv)
    if not (args.timeout > 0 and args.tests_timeout > 0):
        parser.error("--timeout and --tests-timeout must be numbers of seconds > 0")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print(f"gpu-check: no CUDA GPU on this machine (torch {torch.__version__}); nothing to check")
        return NO_GPU_EXIT
    print(f"gpu-check: {gpus} GPU(s); running pytest -m gpu tests", file=sys.stderr, flush=True)
    paths = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.jobs == 1:
        tests = run_gpu_tests(ROOT, args.tests_timeout)
        notebooks = [run_notebook(path, args.timeout) for path in paths]
    else:  # each notebook's kernel and the tests are processes of their own: threads only wait on them
        with concurrent.futures.ThreadPoolExecutor(args.jobs + 1) as pool:
            tests_running = pool.submit(run_gpu_tests, ROOT, args.tests_timeout)
            notebooks = list(pool.map(lambda path: run_notebook(path, args.timeout), paths))
            tests = tests_running.result()
    report = render_report(environment(), notebooks, tests)
    print(report)
    args.out.write_text(report)
    return 0 if not verdict(notebooks, tests, gpus) else 1


if __name__ == "__main__":
    sys.exit(main())
