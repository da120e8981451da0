"""Where the course's modules moved, and a learner's copy of a notebook brought along (``make lab``).

In November 2026 the lesson modules left the top of ``course_utils`` for one folder per part of
the course (``course_utils.ddp_by_hand`` became ``course_utils.ddp.by_hand``, and so on:
:data:`MOVED`). The notebooks of the course moved with them, but a learner's copy in ``lab/`` (made
by an earlier ``make lab``) still imports the old paths. :func:`update_cells` rewrites those
imports in one notebook's code cells, name by name, keeping the names the learner's code uses
(``from course_utils import ddp_demos`` becomes ``from course_utils.ddp import demos as
ddp_demos``); :func:`unresolved` then checks that every name the cells import from the course, and
every attribute they read from a course module, exists. What cannot be brought along is named,
never left to fail as a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import types

__all__ = ["MOVED", "unresolved", "update_cells", "uses_old_paths"]

#: old module (under course_utils) -> where its names are now; the first that has a name holds it
MOVED: dict[str, tuple[str, ...]] = {
    "amp": ("ddp.amp",), "by_hand": ("dataparallel.by_hand",), "cluster": ("faults.cluster",),
    "collectives": ("ddp.collectives",), "ddp_by_hand": ("ddp.by_hand",),
    "ddp_by_hand_runs": ("ddp.by_hand_runs", "ddp.by_hand_timing"), "ddp_demos": ("ddp.demos",),
    "ddp_job": ("ddp.job",), "ddp_train": ("ddp.train",),
    "diagrams": ("dataparallel.diagrams", "ddp.diagrams"), "dp_evidence": ("dataparallel.evidence",),
    "dp_primitives": ("dataparallel.primitives",), "failure_zoo": ("debugging.failure_zoo",),
    "fault_demos": ("faults.crashes",), "flight_recorder": ("debugging.flight_recorder",),
    "gradient_compression": ("debugging.gradient_compression",), "hangs": ("debugging.hangs",),
    "memory": ("dataparallel.memory",), "mesh_runs": ("sharding.mesh",),
    "model_specs": ("dataparallel.model_specs",),
    "parallel_criterion": ("dataparallel.parallel_criterion",), "sharded_runs": ("sharding.runs",),
    "sharding": ("sharding.ledgers", "sharding.runs"), "sim_primitives": ("dataparallel.sim_primitives",),
    "simulated": ("dataparallel.simulated",), "snapshots": ("faults.snapshots",),
    "splits": ("dataparallel.splits",), "strategy_harness": ("sharding.strategies",),
    "torchrun": ("faults.torchrun",), "training_bugs": ("debugging.training_bugs",),
    "zero": ("sharding.zero",),
}
_OLD = "|".join(sorted(MOVED, key=len, reverse=True))
_NAMES = r"(?P<names>\([^)]*\)|[^\n#]*?)(?P<tail>[ \t]*#[^\n]*)?$"
#: ``from course_utils.OLD import names`` and ``from course_utils import names`` (one line or in parentheses)
_FROM_OLD = re.compile(rf"^(?P<ind>[ \t]*)from course_utils\.(?P<old>{_OLD}) import {_NAMES}", re.M)
_FROM_PACKAGE = re.compile(rf"^(?P<ind>[ \t]*)from course_utils import {_NAMES}", re.M)
#: any other mention of an old module path: ``import course_utils.OLD``, a string naming it
_DOTTED = re.compile(rf"\bcourse_utils\.(?P<old>{_OLD})\b(?:\.(?P<attr>\w+))?+(?!\s+import\b)")


def _module(path: str):
    return importlib.import_module(f"course_utils.{path}")


def _submodules(package: str) -> set[str]:
    """The modules of ``course_utils.<package>`` if it is a package now (``sharding``), else none."""
    module = _module(package) if package in ("sharding",) else None
    return {info.name for info in pkgutil.iter_modules(module.__path__)} if module else set()


def _home(old: str, name: str) -> str | None:
    """Where ``name`` of the old module ``old`` is now (a path under course_utils), or None."""
    return next((new for new in MOVED[old] if hasattr(_module(new), name)), None)


def _names(text: str) -> list[tuple[str, str]]:
    """``a, b as c`` (maybe in parentheses, over lines) as [(name, bound name)]."""
    found = []
    for part in text.strip().strip("()").replace("\n", " ").split(","):
        if part.strip():
            name, _, alias = part.strip().partition(" as ")
            found.append((name.strip(), alias.strip() or name.strip()))
    return found


def _import(indent: str, module: str, pairs: list[tuple[str, str]]) -> str:
    names = ", ".join(name if name == bound else f"{name} as {bound}" for name, bound in pairs)
    return f"{indent}from {'.'.join(['course_utils', *filter(None, [module])])} import {names}"


def _attributes(code: str, bound: str) -> set[str]:
    return set(re.findall(rf"(?<![\w.]){re.escape(bound)}\.(\w+)", code))


def _old_module_imports(code: str) -> dict[str, str]:
    """bound name -> old module, for each ``from course_utils import OLD [as bound]`` in ``code``
    that imports an old module (not a package of the same name imported for its modules)."""
    found = {}
    for m in _FROM_PACKAGE.finditer(code):
        for name, bound in _names(m["names"]):
            read = _attributes(code, bound)
            if name in MOVED and not (read and read <= _submodules(name)):
                found[bound] = name
    return found


def update_cells(cells: list[str]) -> list[str]:
    """One notebook's code cells with every old module path replaced by where its names are now.

    A module imported by name keeps its name when everything the notebook reads from it lives in
    one module now; otherwise the attributes that moved elsewhere are read from that module under
    ``<name>_<module>`` (``sharding.api_rank`` becomes ``sharding_runs.api_rank``)."""
    whole = "\n".join(cells)
    # bound name -> (the module it names now, {attribute read elsewhere: the name to read it from})
    plans: dict[str, tuple[str, dict[str, str]]] = {}
    for bound, old in _old_module_imports(whole).items():
        homes = {a: _home(old, a) for a in sorted(_attributes(whole, bound))}
        found = [h for h in homes.values() if h]
        first = max(MOVED[old], key=found.count) if found else MOVED[old][0]
        elsewhere = {a: f"{bound}_{h.rsplit('.', 1)[1]}" for a, h in homes.items() if h and h != first}
        plans[bound] = (first, elsewhere)

    def from_old(m: re.Match) -> str:
        pairs = _names(m["names"])
        if {name for name, _ in pairs} <= _submodules(m["old"]):
            return m[0]  # already the package's modules
        by_home: dict[str, list[tuple[str, str]]] = {}
        for name, bound in pairs:
            by_home.setdefault(_home(m["old"], name) or MOVED[m["old"]][0], []).append((name, bound))
        return "\n".join(_import(m["ind"], home, p) for home, p in by_home.items()) + (m["tail"] or "")

    def from_package(m: re.Match) -> str:
        kept, lines = [], []
        for name, bound in _names(m["names"]):
            if bound not in plans:
                kept.append((name, bound))
                continue
            first, elsewhere = plans[bound]
            homes = {first: bound} | {_home(name, a): alias for a, alias in elsewhere.items()}
            for home, alias in homes.items():
                wing, new = home.rsplit(".", 1)
                lines.append(_import(m["ind"], wing, [(new, alias)]))
        if not lines:
            return m[0]
        return "\n".join(([_import(m["ind"], "", kept)] if kept else []) + lines) + (m["tail"] or "")

    def dotted(m: re.Match) -> str:
        if m["attr"] in _submodules(m["old"]):
            return m[0]
        home = (_home(m["old"], m["attr"]) if m["attr"] else None) or MOVED[m["old"]][0]
        return f"course_utils.{home}" + (f".{m['attr']}" if m["attr"] else "")

    updated = []
    for code in cells:
        code = _FROM_PACKAGE.sub(from_package, _FROM_OLD.sub(from_old, code))
        for bound, (_, elsewhere) in plans.items():
            for attr, alias in elsewhere.items():
                code = re.sub(rf"(?<![\w.]){re.escape(bound)}\.{attr}\b", f"{alias}.{attr}", code)
        updated.append(_DOTTED.sub(dotted, code))
    return updated


def uses_old_paths(cells: list[str]) -> bool:
    """Whether a notebook's code cells name a course module by a path it has left."""
    return update_cells(cells) != cells


def _parsable(code: str) -> str:
    """``code`` with IPython's magics and shell escapes blanked, for ``ast``."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines())


def unresolved(cells: list[str]) -> list[str]:
    """What a notebook's code cells import from the course, or read from a course module, that does
    not exist: ``"course_utils.ddp.demos.nothing"``, one per missing name, in order."""
    missing, modules = [], {}
    for code in cells:
        try:
            tree = ast.parse(_parsable(code))
        except SyntaxError:
            continue  # the learner's own code, mid-edit: nothing to say about the course's names
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == "course_utils"):
                continue
            try:
                source = importlib.import_module(node.module)
            except ImportError:
                missing.append(node.module)
                continue
            for alias in node.names:
                value = getattr(source, alias.name, None)
                if value is None:
                    try:
                        value = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{node.module}.{alias.name}")
                        continue
                if isinstance(value, types.ModuleType) and value.__name__.startswith("course_utils"):
                    modules[alias.asname or alias.name] = value
    whole = "\n".join(cells)
    for bound, value in modules.items():
        missing += [f"{value.__name__}.{attr}" for attr in sorted(_attributes(whole, bound))
                    if not hasattr(value, attr)]
    return list(dict.fromkeys(missing))
