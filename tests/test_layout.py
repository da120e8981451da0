"""The package's layout: one folder per part of the course above the shared ground, imports running
one way between them (import-linter's contracts in pyproject.toml, run by `make lint`), and modules
small enough to read."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "course_utils"
#: the shared ground and distributed.py: the only modules at the top
TOP_MODULES = {"__init__", "_checks", "compat", "data", "devices", "distributed", "env", "models",
               "progress_bars", "show"}
#: one folder per part of the course, with the notebooks it serves, then the machinery
WINGS = {"dataparallel": "02", "ddp": "05", "faults": "09", "sharding": "10", "debugging": "12"}
FOLDERS = set(WINGS) | {"launcher", "exercises", "tools"}
MAX_LINES = 300
MAX_ARROWS = 75


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_top_level_holds_the_shared_ground_and_one_folder_per_part():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert modules == TOP_MODULES, "a lesson module at the top, or a shared one gone"
    assert folders == FOLDERS


@pytest.mark.parametrize("wing", sorted(WINGS))
def test_each_wing_says_what_it_teaches_and_re_exports_nothing(wing):
    tree = ast.parse((PACKAGE / wing / "__init__.py").read_text())
    doc = ast.get_docstring(tree)
    assert doc and "notebook" in doc and WINGS[wing] in doc, "the wing's docstring names its notebooks"
    assert [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))] == [], (
        "a wing's __init__ re-exports nothing: lessons import from its modules")


def test_every_module_is_at_most_300_lines():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules()}
    long = {path: n for path, n in lines.items() if n > MAX_LINES}
    assert long == {}, f"split these by idea (at most {MAX_LINES} lines each)"


def _room(module: str) -> str:
    """A top-level module, or a top-level folder counted as one room."""
    return ".".join(module.split(".")[:2])


def test_the_rooms_import_graph_stays_small():
    graph = grimp.build_graph("course_utils", exclude_type_checking_imports=True)
    arrows = {(_room(m), _room(i)) for m in graph.modules for i in graph.find_modules_directly_imported_by(m)
              if _room(m) != _room(i)}
    assert 0 < len(arrows) <= MAX_ARROWS, sorted(arrows)


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=tree,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(tree)})


@pytest.fixture(scope="module")
def copy_of_the_package(tmp_path_factory):
    tree = tmp_path_factory.mktemp("layout")
    shutil.copytree(PACKAGE, tree / "course_utils", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree)
    return tree


@pytest.mark.parametrize(("module", "line", "broken"), [
    (None, None, None),
    # a lower part importing a higher one
    ("course_utils/faults/cluster.py", "from ..ddp import amp", "are layered"),
    # the shared ground importing a part
    ("course_utils/devices.py", "from .dataparallel import splits", "are layered"),
    # two parts of one layer importing each other
    ("course_utils/sharding/zero.py", "from ..debugging import hangs", "are layered"),
    # a circle inside a part
    ("course_utils/dataparallel/splits.py", "from . import memory", "no import circle"),
], ids=["as-is", "faults-imports-ddp", "shared-ground-imports-a-part", "siblings", "circle"])
def test_the_import_contracts_hold_and_catch_a_wrong_way_import(copy_of_the_package, module, line, broken):
    tree = copy_of_the_package
    target = tree / module if module else None
    before = target.read_text() if target else None
    if target:
        target.write_text(before + f"\n{line}  # noqa\n")
    try:
        result = _lint_imports(tree)
    finally:
        if target:
            target.write_text(before)
    out = result.stdout + result.stderr
    if broken is None:
        assert result.returncode == 0 and "2 kept, 0 broken" in out, out[-2000:]
    else:
        assert result.returncode != 0, out[-2000:]
        summary = " ".join(out.split())  # a contract's name may wrap over two lines
        assert re.search(re.escape(broken) + r"(?:(?!KEPT).)*?BROKEN", summary), out[-2000:]
