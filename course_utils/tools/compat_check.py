"""``make compat``: the course on another torch release, installed the way Colab installs it.

    python3 -m course_utils.tools.compat_check                 # torch 2.11.0, Colab's release
    python3 -m course_utils.tools.compat_check --torch 2.14.1  # any release on the package registry

Run from the repository with any Python 3.11+ (torch is not needed there). It keeps a virtual
environment per release in ``.compat/torch-X.Y.Z/`` (git-ignored; pip's cache keeps the wheels, so
a second run downloads nothing), with that torch and the other pins of ``requirements.txt``, then
installs the course as the set-up cell does in Colab: a plain, non-editable ``pip install`` of the
repository that leaves the installed torch alone (checked: the log shows torch before and after).
Inside it, from outside the repository so that only the installed package is imported:

1. every notebook executed top to bottom, once, in its solutions edition (no comparison with
   stored outputs: a different release prints different warnings and rounds differently; any
   error output fails);
2. every exercise's check read back from that run: each must say right;
3. the launch contract tests (``tests/test_distributed.py``, ``tests/test_launch_modes.py``) and
   the release tests (``tests/test_compat.py``).

It prints one line per notebook and per exercise, then a summary, and exits 1 on any failure.
Tooling for maintainers; learners never need it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["DEFAULT_TORCH", "LAUNCH_TESTS", "TESTED_RELEASES", "check_release", "environment_dir", "main",
           "verdicts", "warnings_in"]

ROOT = Path(__file__).resolve().parents[2]
#: The releases the whole course has passed on here, oldest first: Colab's (its 2026-08 runtime:
#: Python 3.13, torch 2.11.0, one T4 on the free tier), checked by CI's ``make compat``; the pin,
#: which nbval checks; and the newest that installs on Python 3.11 (2.15.0 does not resolve
#: there), checked by CI's ``make compat TORCH=2.14.1``. The oldest is pyproject's torch floor
#: (tests/test_pins.py).
TESTED_RELEASES = ("2.11.0", "2.13.0", "2.14.1")
DEFAULT_TORCH = TESTED_RELEASES[0]
#: The tests run in the environment: the launch contract, and what differs between releases.
LAUNCH_TESTS = ("tests/test_distributed.py", "tests/test_launch_modes.py", "tests/test_compat.py")
NOTEBOOK_TIMEOUT_S = 600.0
_RELEASE = re.compile(r"^\d+\.\d+\.\d+$")
_WARNING = re.compile(r"(\w*Warning: .*)")
_VERDICT = re.compile(r"^([✓✗·]) Exercise (\d\d\.\d+) \((\w+)\): (.*)$", re.MULTILINE)


def check_release(torch_version: str) -> str:
    """``torch_version`` if it names one release exactly ("2.11.0"), else a ValueError."""
    if not isinstance(torch_version, str) or not _RELEASE.match(torch_version):
        raise ValueError(f"TORCH must name one release exactly, like 2.11.0, got {torch_version!r}")
    return torch_version


def environment_dir(torch_version: str) -> Path:
    """Where the environment of ``torch_version`` lives: ``.compat/torch-<version>``."""
    return ROOT / ".compat" / f"torch-{check_release(torch_version)}"


def verdicts(nb) -> dict[str, str]:
    """Every exercise check's status in an executed notebook, by key (``{"10.2": "right"}``)."""
    found = {}
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
            for mark, key, _kind, rest in _VERDICT.findall(text):
                found[key] = rest.split(".")[0] if mark != "✓" else "right"
    return found


def warnings_in(nb) -> list[str]:
    """The distinct warnings (``...Warning: message`` lines) that an executed notebook's cells wrote."""
    found: dict[str, None] = {}
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("name") == "stderr":
                for match in _WARNING.finditer("".join(out.get("text", ""))):
                    found[match.group(1)[:160]] = None
    return list(found)


# ----------------------------------------------------------------------------- outside: the env

def _run(command: list[str], log, **kwargs) -> subprocess.CompletedProcess:
    print("$ " + " ".join(str(c) for c in command), file=log, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    log.write(done.stdout)
    log.flush()
    if done.returncode:
        tail = "\n".join(done.stdout.strip().splitlines()[-15:])
        raise SystemExit(f"compat: this command failed ({done.returncode}):\n  {' '.join(map(str, command))}"
                         f"\n{tail}\n(the whole log: {log.name})")
    return done


def _torch_in(python: Path) -> str:
    done = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, cwd=tempfile.gettempdir())
    return done.stdout.strip() if done.returncode == 0 else "none"


def prepare(torch_version: str, log) -> Path:
    """The environment of ``torch_version``, made or brought up to date; returns its python."""
    env = environment_dir(torch_version)
    python = env / "bin" / "python"
    pins = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
            if not line.split("#")[0].strip().lower().startswith("torch==")]
    stamp_text = hashlib.sha256("\n".join(pins + [torch_version]).encode()).hexdigest()
    stamp = env / ".pins"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(env)], log)
    if not stamp.exists() or stamp.read_text() != stamp_text:
        # --no-compile: pip would compile all of torch and the pins to bytecode (about 40 CPU-s here on
        # 2026-11-28, while CI's other steps wait for the CPU); the runs compile what they import, once
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-compile"]
        _run(pip + [f"torch=={torch_version}"], log)
        other = env / "requirements-without-torch.txt"
        other.write_text("\n".join(pins) + "\n")
        _run(pip + ["-r", str(other)], log)
        stamp.write_text(stamp_text)
    # The course as Colab's set-up cell installs it: plain pip, not editable, dependencies included.
    before = _torch_in(python)
    _run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", "course-utils"], log)
    with tempfile.TemporaryDirectory() as tmp:  # built from a copy: no build/ or egg-info left here
        source = Path(tmp) / "course"
        shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
            ".git", ".venv*", ".compat", "build", "*.egg-info", "__pycache__", "solutions", "_book*", "lab",
            "lab.previous"))
        done = _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", str(source)], log)
    after = _torch_in(python)
    kept = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith(
        "Requirement already satisfied: torch")]
    print(f"compat: torch {before} before `pip install` of the course, {after} after"
          + (f" ({kept[0]})" if kept else ""), flush=True)
    if before != after or not after.startswith(torch_version):
        raise SystemExit(f"compat: installing the course changed torch from {before} to {after}")
    return python


# ----------------------------------------------------------------------------- inside: the checks

def _notebooks(folder: Path) -> list[Path]:
    return sorted(folder.glob("[0-9][0-9]_*.ipynb"))


def run_notebooks(repo: Path, work: Path) -> list[str]:
    """Steps 1 and 2 in one pass, in this (the release's) environment; returns the failures.

    Each notebook runs once, in its solutions edition: every cell of the lesson as shipped, with
    the answer cells filled in by the reference solutions, so one execution both runs the lesson
    top to bottom and reads every check (a second run of the plain notebooks would repeat every
    lesson cell; the unanswered checks' "not attempted yet" does not depend on the release, and
    nbval checks it on the pin)."""
    import nbformat

    from ..exercises import bank
    from .nbtools import run_in_memory
    from .solutions import build

    failures = []
    lesson = work / "notebooks"
    shutil.copytree(repo / "notebooks", lesson, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for path in build(_notebooks(lesson), work / "solutions"):
        nb = nbformat.read(path, as_version=4)
        error, seconds = run_in_memory(nb, path.parent, NOTEBOOK_TIMEOUT_S)
        print(f"{'ok  ' if not error else 'FAIL'}  {path.name:44} {seconds:6.1f} s  {error}", flush=True)
        for warning in warnings_in(nb):  # what this release says that the pinned one may not
            print(f"        warns: {warning}", flush=True)
        if error:
            failures.append(f"{path.name}: {error}")
        found = verdicts(nb)
        for key in [ex.key for ex in bank("all") if ex.notebook == path.name[:2]]:
            status = found.get(key, "no check output")
            print(f"{'✓' if status == 'right' else '✗'} solutions {key}: {status}", flush=True)
            if status != "right":
                failures.append(f"solutions edition, exercise {key}: {status}")
    return failures


def run_launch_tests(repo: Path) -> list[str]:
    """Step 3, from outside the repository: the ranks then import the installed package too."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-c", str(repo / "pyproject.toml"), "--rootdir", str(repo),
               *(str(repo / test) for test in LAUNCH_TESTS)]
    done = subprocess.run(command, cwd=tempfile.gettempdir(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    mark = "ok  " if done.returncode == 0 else "FAIL"
    print(f"{mark}  launch contract and release tests: {last}", flush=True)
    if done.returncode:
        print(done.stdout[-4000:])
        return [f"launch contract tests: {last}"]
    return []


def inside(repo: Path) -> int:
    """Everything that runs in the release's environment; returns the exit code."""
    import torch

    import course_utils

    installed = Path(course_utils.__file__).resolve()
    print(f"compat: Python {sys.version.split()[0]}, torch {torch.__version__}, course_utils from "
          f"{'site-packages' if 'site-packages' in installed.parts else installed}", flush=True)
    if "site-packages" not in installed.parts:
        print("compat: course_utils was imported from the repository, not from the installed package")
        return 1
    # one fork server for every notebook's kernel and the launch tests, as in make test
    # (course_utils/launcher/shared_server.py): not one per kernel, about 3 CPU-s each
    from ..launcher import forkserver, shared_server

    if forkserver.use_forkserver(None):
        shared_server.publish(forkserver.PRELOAD)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        failures = run_notebooks(repo, Path(tmp))
    failures += run_launch_tests(repo)
    minutes = (time.perf_counter() - start) / 60
    if failures:
        print(f"compat: torch {torch.__version__}: {len(failures)} failure(s) in {minutes:.1f} min:")
        for failure in failures:
            print(f"  - {failure}")
        return 1
    print(f"compat: torch {torch.__version__}: every notebook ran, every exercise of the solutions "
          f"edition is right, the launch tests passed ({minutes:.1f} min)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.tools.compat_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", default=DEFAULT_TORCH,
                        help=f"the release to check (default {DEFAULT_TORCH})")
    parser.add_argument("--inside", type=Path, metavar="REPO", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside is not None:
        return inside(args.inside)
    try:
        release = check_release(args.torch)
    except ValueError as err:
        parser.error(str(err))
    start = time.perf_counter()
    log_path = ROOT / ".compat" / f"torch-{release}.log"
    log_path.parent.mkdir(exist_ok=True)
    with open(log_path, "w") as log:
        print(f"compat: environment .compat/torch-{release} (pip's output: .compat/torch-{release}.log)",
              flush=True)
        python = prepare(release, log)
    print(f"compat: environment ready in {time.perf_counter() - start:.0f} s", flush=True)
    env = dict(os.environ, PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    # an empty folder of its own: a `course_utils` lying in the temp folder itself would be imported
    outside = tempfile.mkdtemp(prefix="course-compat-")
    try:
        inner = subprocess.Popen([str(python), "-m", "course_utils.tools.compat_check",
                                  "--inside", str(ROOT)],
                                 cwd=outside, env=env, stderr=subprocess.PIPE, text=True)
        for line in inner.stderr:  # every kernel says this once; the rest of stderr passes through
            if "Kernel is running over TCP without encryption" not in line:
                sys.stderr.write(line)
        code = inner.wait()
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    print(f"compat: {time.perf_counter() - start:.0f} s in all", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
