"""The room pre-flight: what each learner runs before a workshop (``make preflight``).

    python -m course_utils.tools.preflight

It checks, in about ten seconds, what the day relies on: the pinned PyTorch, the devices, two
real ranks meeting over gloo (a port, the fork server, ``launch``), DataParallel's emulation, the
exercise checks and Jupyter's kernel. It ends with ``READY`` (exit code 0) or names each problem
with what to do (exit code 1). The instructor guide lists what it must print.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable

__all__ = ["CHECKS", "TORCH_PIN", "main", "run_checks"]


#: requirements.txt's torch pin (tests/test_pins.py keeps the two equal)
TORCH_PIN = "2.13.0"


def _torch() -> str:
    import torch

    from ..env import device_report

    if not torch.__version__.startswith(TORCH_PIN):
        raise RuntimeError(f"PyTorch {torch.__version__} is installed; the course pins {TORCH_PIN} "
                           "(run `make install` in a fresh clone)")
    report = device_report()
    return f"PyTorch {torch.__version__}; {report.gpu_count} GPU(s)"


def _ranks() -> str:
    from ..ddp import demos
    from ..distributed import launch

    sums = launch(demos.all_reduce_sum, 2, echo=False, timeout_s=60)
    if sums != [[3.0], [3.0]]:
        raise RuntimeError(f"two ranks summed to {sums}, not [[3.0], [3.0]]")
    return "2 ranks met and all-reduced: [[3.0], [3.0]]"


def _dataparallel() -> str:
    import torch
    from torch import nn

    from ..dataparallel.by_hand import data_parallel
    from ..dataparallel.simulated import sim_devices

    model = nn.Linear(4, 2)
    x = torch.randn(30, 4)
    torch.testing.assert_close(data_parallel(model, x, sim_devices(4)), model(x))
    return "DataParallel on 4 simulated devices == one device"


def _exercises() -> str:
    from ..exercises import find, run_source

    verdict = run_source("01.1", find("01.1").solution)
    if not verdict.right:
        raise RuntimeError(f"the exercise checks do not work: {verdict}")
    return "exercise checks work"


def _jupyter() -> str:
    missing = [m for m in ("ipykernel", "jupyterlab", "nbclient") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} missing: run `make install`")
    return "Jupyter and its kernel are installed"


#: (name, check): each check returns what it found, or raises with what to do.
CHECKS: tuple[tuple[str, Callable[[], str]], ...] = (
    ("pytorch", _torch), ("two ranks", _ranks), ("dataparallel", _dataparallel),
    ("exercises", _exercises), ("jupyter", _jupyter),
)


def run_checks(checks: tuple[tuple[str, Callable[[], str]], ...]) -> list[tuple[str, bool, str]]:
    """Run every check; ``(name, passed, message)`` for each, in order. Never raises."""
    if not checks or not all(isinstance(c, tuple) and len(c) == 2 and callable(c[1]) for c in checks):
        raise TypeError("checks must be a non-empty tuple of (name, callable) pairs")
    results = []
    for name, check in checks:
        try:
            results.append((name, True, check()))
        except Exception as err:  # noqa: BLE001 - reported, with what to do
            results.append((name, False, f"{type(err).__name__}: {err}".splitlines()[0]))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.tools.preflight", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    began = time.perf_counter()
    results = run_checks(CHECKS)
    for name, passed, message in results:
        print(f"  {'ok  ' if passed else 'FAIL'}  {name:<13} {message}")
    failed = [name for name, passed, _ in results if not passed]
    if failed:
        print(f"NOT READY: {', '.join(failed)} failed (see above; the instructor guide has the fixes)")
        return 1
    print(f"READY: this machine runs the course ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
