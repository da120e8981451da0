"""Maintaining the notebooks: execute them cleanly, keep their headers in step, check hygiene.

Used by ``make execute`` and by the tests; learners never need it.

    python -m course_utils.tools.nbtools execute notebooks/*.ipynb   # refresh stored outputs
    python -m course_utils.tools.nbtools sync notebooks/*.ipynb      # rewrite badge + set-up cell
    python -m course_utils.tools.nbtools check notebooks/*.ipynb     # hygiene report, exit 1 on problems
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import time
from pathlib import Path
from typing import Any

from .. import BRANCH, REPO
from .kernels import kernel_manager_class

__all__ = [
    "SETUP_SOURCE",
    "badge_markdown",
    "clean_metadata",
    "merge_streams",
    "execute_notebook",
    "first_line",
    "hygiene_problems",
    "run_in_memory",
    "sync_header",
]

SETUP_SOURCE = f'''# Set-up: in Colab, install the course's helpers (this notebook's version); else nothing.
import sys

if "google.colab" in sys.modules:
    import subprocess

    url = "git+https://github.com/{REPO}@{BRANCH}"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", url],
                          capture_output=True, text=True)
    if done.returncode:  # say what to do, not a traceback
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        print(f"Could not install the course's helpers from {{url}} (pip: {{last}}); check that "
              "this runtime can reach GitHub, or in a fork set REPO in course_utils/__init__.py, "
              "then run this cell again.")'''

_BADGE_RE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")

# A path with at least two components that is not part of a URL, or an ipykernel temp name.
# Interpreter paths such as /bin/bash in a printed shell script are the same everywhere.
_MACHINE_PATH = re.compile(r"(?<![\w:/.+=-])/(?!(?:usr/)?bin/\w+\b)(?:[\w.-]+/)+[\w.-]+|ipykernel_\d+")


def badge_markdown(notebook_name: str) -> str:
    """The "Open in Colab" badge for ``notebooks/<notebook_name>``."""
    if not notebook_name.endswith(".ipynb") or "/" in notebook_name:
        raise ValueError(f"expected a notebook file name like '00_x.ipynb', got {notebook_name!r}")
    url = f"https://colab.research.google.com/github/{REPO}/blob/{BRANCH}/notebooks/{notebook_name}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def _load(path: Path):
    import nbformat

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    return nbformat.read(path, as_version=4)


def sync_header(path: str | Path) -> bool:
    """Put the current badge in the first (markdown) cell and the set-up code in the second.

    Returns True if the file changed.
    """
    import nbformat

    path = Path(path)
    nb = _load(path)
    cells = nb.cells
    if len(cells) < 2 or cells[0].cell_type != "markdown" or cells[1].cell_type != "code":
        raise ValueError(f"{path}: expected a markdown title cell, then the set-up code cell")
    badge = badge_markdown(path.name)
    title = cells[0].source
    new_title = _BADGE_RE.sub(badge, title) if _BADGE_RE.search(title) else f"{badge}\n\n{title}"
    changed = new_title != title or cells[1].source != SETUP_SOURCE
    if changed:
        cells[0].source = new_title
        cells[1].source = SETUP_SOURCE
        nbformat.write(nb, path)
    return changed


def clean_metadata(nb) -> None:
    """Keep only what a reader needs: the kernel name and language; no timings, no widget state."""
    if not (hasattr(nb, "metadata") and hasattr(nb, "cells")):
        raise TypeError(f"nb must be a notebook read with nbformat, got {type(nb).__name__}")
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for cell in nb.cells:
        keep = {k: v for k, v in cell.metadata.items() if k in ("tags",)}
        cell.metadata = keep
        for out in cell.get("outputs", []):
            if "metadata" in out:
                out.metadata = {}


_OVERWRITTEN = re.compile(r"^.*\r(?=[^\n])", re.MULTILINE)  # a line's text before its last lone \r


def merge_streams(nb) -> None:
    """Store each run of stream outputs (stdout, stderr) as one output, as a front end shows it.

    A text progress bar redraws its line with ``\r`` on every step: kept, each redraw is an output
    of its own. Merged, only the line's last state remains (what nbval compares anyway).
    """
    for cell in nb.cells:
        merged = []
        for out in cell.get("outputs", []):
            last = merged[-1] if merged else None
            if (out.output_type == "stream" and last is not None and last.output_type == "stream"
                    and last.name == out.name):
                last.text += out.text
            else:
                merged.append(out)
        for out in merged:
            if out.output_type == "stream":
                out.text = _OVERWRITTEN.sub("", out.text)
        if "outputs" in cell:
            cell.outputs = merged


def execute_notebook(path: str | Path, *, timeout: int = 600) -> float:
    """Run a notebook top to bottom in a fresh kernel, store its outputs, clean its metadata.

    The kernel starts in the notebook's folder, as Jupyter would. Returns the seconds it took.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    nb = _load(path)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    start = time.perf_counter()
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        kernel_manager_class=kernel_manager_class(),
        record_timing=False,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    client.execute()
    seconds = time.perf_counter() - start
    clean_metadata(nb)
    merge_streams(nb)
    nbformat.write(nb, path)
    return seconds


def first_line(text: str) -> str:
    """The first non-blank line of ``text``, stripped ("" if none): an error's headline."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _where_it_failed(nb: Any) -> str:
    """`` (cell N, line K: the line)`` for the first cell whose outputs hold an error: N counts the
    code cells from 0, as nbval names them ("Cell N"), and K is the line the traceback points at."""
    for index, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        for out in cell.get("outputs", []):
            if out.get("output_type") != "error":
                continue
            traceback = _ANSI.sub("", "\n".join(out.get("traceback", [])))
            frame = re.search(r"Cell In\[\d+\], line (\d+)", traceback)
            lines = cell.source.splitlines()
            if frame and 0 < int(frame[1]) <= len(lines):
                return f" (cell {index}, line {frame[1]}: {lines[int(frame[1]) - 1].strip()[:100]})"
            return f" (cell {index})"
    return ""


def run_in_memory(nb: Any, folder: str | Path, timeout_s: float) -> tuple[str, float]:
    """Execute the notebook ``nb`` top to bottom, its kernel started in ``folder``, within ``timeout_s``.

    The outputs land in ``nb`` (nothing is written to disk). Returns ``(error, seconds)``, where
    ``error`` is "" when every cell ran, else the first line of what went wrong (a cell's
    exception, followed by where: the cell and its line; a dead kernel; or the whole notebook's
    time running out). Used by ``make gpu-check`` and ``make compat``.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    if not Path(folder).is_dir():
        raise NotADirectoryError(f"folder must be an existing directory, got {folder!r}")
    client = NotebookClient(nb, timeout=int(timeout_s) + 1, kernel_name="python3", record_timing=False,
                            kernel_manager_class=kernel_manager_class(),
                            resources={"metadata": {"path": str(Path(folder).resolve())}})

    async def execute() -> None:  # the whole notebook, not just each cell, within timeout_s
        task = asyncio.ensure_future(client.async_execute())
        if task not in (await asyncio.wait({task}, timeout=timeout_s))[0]:
            task.cancel()  # nbclient shuts the kernel down on the way out
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
            raise TimeoutError
        task.result()  # raises the notebook's error, if any

    start, error = time.perf_counter(), ""
    try:
        asyncio.run(execute())
    except CellExecutionError as err:
        error = f"{err.ename}: {first_line(err.evalue)}{_where_it_failed(nb)}"
    except TimeoutError:
        error = f"Timeout: did not finish within {timeout_s:g} s"
    except Exception as err:  # a dead kernel, a kernel that cannot start: the notebook failed
        error = f"{type(err).__name__}: {first_line(str(err))}"
    return error, time.perf_counter() - start


_WIDGET = "application/vnd.jupyter.widget-view+json"


def hygiene_problems(path: str | Path) -> list[str]:
    """What a learner or nbval would trip over in a stored notebook; empty when it is clean."""
    path = Path(path)
    nb = _load(path)
    problems: list[str] = []
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    if not code:
        return [f"{path.name}: no code cells"]
    if not any(c.get("outputs") for c in code):
        problems.append(f"{path.name}: no stored outputs; nbval would have nothing to compare")
    counts = [c.execution_count for c in code]
    if counts != list(range(1, len(counts) + 1)):
        problems.append(f"{path.name}: execution counts {counts[:6]}... are not one clean run")
    for i, cell in enumerate(code):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and "NBVAL_RAISES_EXCEPTION" not in cell.source:
                problems.append(f"{path.name}: code cell {i} stores an error ({out.get('ename')})")
            data = out.get("data", {})
            text = "".join(out.get("text", "")) + "".join(data.get("text/plain", ""))
            found = _MACHINE_PATH.search(text)
            if found:
                problems.append(f"{path.name}: code cell {i} shows a path {found.group(0)!r}")
            if _WIDGET in data:  # saved from a front end: elsewhere it reads "HBox(children=...)"
                problems.append(f"{path.name}: code cell {i} stores a widget (run make execute)")
        if set(cell.metadata) - {"tags"}:
            problems.append(f"{path.name}: code cell {i} keeps metadata {sorted(cell.metadata)}")
    if "widgets" in nb.metadata:
        problems.append(f"{path.name}: notebook metadata stores widget state")
    first = nb.cells[0].source if nb.cells else ""
    if badge_markdown(path.name) not in first:
        problems.append(f"{path.name}: the first cell lacks this notebook's current Colab badge")
    if len(nb.cells) < 2 or nb.cells[1].source != SETUP_SOURCE:
        problems.append(f"{path.name}: the second cell is not the current set-up cell")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.tools.nbtools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["execute", "sync", "check"])
    parser.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)
    status = 0
    for path in args.notebooks:
        if args.command == "execute":
            sync_header(path)
            seconds = execute_notebook(path)
            print(f"executed {path} in {seconds:.1f} s", flush=True)
        elif args.command == "sync":
            print(f"{path}: {'updated' if sync_header(path) else 'up to date'}")
        else:
            for problem in hygiene_problems(path):
                print(problem)
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
