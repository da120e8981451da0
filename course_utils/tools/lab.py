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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

__all__ = ["MANIFEST", "copy_course", "course_files", "main", "updated_since_copy"]

ROOT = Path(__file__).resolve().parents[2]
#: In the working copy: each copied file's path and the SHA-256 of the course's version it copied.
MANIFEST = ".course-copy.json"
_SKIP_DIRS = {"po", ".ipynb_checkpoints"}


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
    stale = updated_since_copy(args.source, args.dest)
    if stale:
        print(f"the course has changed {len(stale)} of them since your copy "
              f"({', '.join(p.name for p in stale[:4])}{', ...' if len(stale) > 4 else ''}): "
              f"make lab-refresh takes the new ones (your copy moves to {name}.previous/)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
