"""``make lab``: JupyterLab on a working copy of the course, so a learner's runs never touch git.

JupyterLab saves each notebook it runs, outputs included (and autosaves every two minutes). Opened
on ``notebooks/``, every run would rewrite the tracked notebooks and the next ``git pull`` would
conflict. ``make lab`` opens ``lab/`` instead: a git-ignored copy of ``notebooks/``.

    python -m course_utils.tools.lab            # copy into lab/ what it lacks; a learner's files stay
    python -m course_utils.tools.lab --refresh  # a fresh lab/; the old one moves to lab.previous/

Copied: the notebooks, the instructor guide, and each edition's notebooks, README and glossary
(not its PO files, the translators' sources). ``lab/.course-copy.json`` records what each copied
file was, so that after a ``git pull`` the command names the notebooks the course has changed
since, which ``--refresh`` brings in.

A copy made before the course's modules moved into one folder per part (``course_utils.ddp_train``
is now ``course_utils.ddp.train``) still imports the old paths: each run rewrites those imports in
the copy's notebooks (:mod:`course_utils.tools.moved`), keeps the notebook as it was in
``lab/.before-update/``, and names any notebook whose names it could not bring along, with what to
run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

__all__ = ["BACKUP", "MANIFEST", "copy_course", "course_files", "main", "update_old_imports",
           "updated_since_copy"]

ROOT = Path(__file__).resolve().parents[2]
#: In the working copy: each copied file's path and the SHA-256 of the course's version it copied.
MANIFEST = ".course-copy.json"
#: In the working copy: each notebook as it was before its imports were brought up to date.
BACKUP = ".before-update"
_SKIP_DIRS = {"po", ".ipynb_checkpoints", BACKUP}


def course_files(source: Path) -> list[Path]:
    """The files of ``source`` (``notebooks/``) that a learner opens, relative to it, sorted."""
    return sorted(p.relative_to(source) for p in source.rglob("*")
                  if p.is_file() and p.suffix in (".ipynb", ".md")
                  and not _SKIP_DIRS & set(p.relative_to(source).parts[:-1]))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest(dest: Path) -> dict[str, str]:
    try:
        return json.loads((dest / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def copy_course(source: Path, dest: Path, *, refresh: bool = False) -> list[Path]:
    """Copy into ``dest`` the course files it lacks (all of them with ``refresh``, after moving
    ``dest`` to ``<dest>.previous``); returns the files copied, relative to ``dest``."""
    if not source.is_dir():
        raise ValueError(f"source must be the course's notebooks folder, got {source}")
    if refresh and dest.exists():
        previous = dest.with_name(dest.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        dest.rename(previous)
    manifest = _manifest(dest)
    copied = []
    for rel in course_files(source):
        target = dest / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / rel, target)
        manifest[rel.as_posix()] = _digest(source / rel)
        copied.append(rel)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return copied


def updated_since_copy(source: Path, dest: Path) -> list[Path]:
    """The course files whose course version changed after ``dest``'s copy of them was made."""
    manifest = _manifest(dest)
    return [rel for rel in course_files(source)
            if rel.as_posix() in manifest and manifest[rel.as_posix()] != _digest(source / rel)]


def update_old_imports(dest: Path) -> tuple[list[Path], dict[Path, list[str]]]:
    """Rewrite, in every notebook of the working copy ``dest``, the imports of course modules that
    have moved (the notebook as it was goes to ``dest/.before-update/``). Returns the notebooks
    rewritten, and those whose cells still name what the course does not have, with those names."""
    from .moved import unresolved, update_cells

    updated, broken = [], {}
    for rel in course_files(dest) if dest.is_dir() else []:
        if rel.suffix != ".ipynb":
            continue
        path = dest / rel
        try:
            notebook = json.loads(path.read_text(encoding="utf-8"))
            cells = [c for c in notebook["cells"] if c.get("cell_type") == "code"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # not a notebook this command can read: left as it is
        sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
        new = update_cells(sources)
        if new != sources:
            backup = dest / BACKUP / rel
            backup.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, backup)
            for cell, source in zip(cells, new, strict=True):
                cell["source"] = source.splitlines(keepends=True)
            path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            updated.append(rel)
        missing = unresolved(new)
        if missing:
            broken[rel] = missing
    return updated, broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.tools.lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refresh", action="store_true",
                        help="make the working copy fresh (the old one moves to lab.previous/)")
    parser.add_argument("--source", type=Path, default=ROOT / "notebooks", help=argparse.SUPPRESS)
    parser.add_argument("--dest", type=Path, default=ROOT / "lab", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    had_copy = args.dest.exists()
    copied = copy_course(args.source, args.dest, refresh=args.refresh)
    name = args.dest.name
    if args.refresh and had_copy:
        print(f"{name}/ is a fresh copy of the course; your previous copy is in {name}.previous/")
    elif copied:
        print(f"copied {len(copied)} files of the course into {name}/ (git ignores it: run and save freely)")
    updated, broken = update_old_imports(args.dest)
    if updated:
        print(f"the course's modules have moved into one folder per part (course_utils.ddp_train is now "
              f"course_utils.ddp.train): the imports of {len(updated)} of your notebooks use the new paths "
              f"now ({', '.join(p.name for p in updated[:4])}{', ...' if len(updated) > 4 else ''}); "
              f"each as it was is in {name}/{BACKUP}/")
    for rel, missing in broken.items():
        print(f"{name}/{rel.as_posix()} uses what the course no longer has ({', '.join(missing[:3])}"
              f"{', ...' if len(missing) > 3 else ''}): run make lab-refresh for a fresh copy of the course "
              f"(yours moves to {name}.previous/, where your answers stay)")
    stale = updated_since_copy(args.source, args.dest)
    if stale:
        print(f"the course has changed {len(stale)} of them since your copy "
              f"({', '.join(p.name for p in stale[:4])}{', ...' if len(stale) > 4 else ''}): "
              f"make lab-refresh takes the new ones (your copy moves to {name}.previous/)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
