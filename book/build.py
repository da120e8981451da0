"""Build the course as an HTML book: ``make book`` (``python book/build.py``).

1. Stage the sources in ``_book/src`` (git-ignored): the README without its References as the
   landing page (``index.md``), the References as their own page, the notebooks
   ``notebooks/[0-9][0-9]_*.ipynb`` (found on disk, never listed by hand; subfolders such as a
   translated edition are not read) and the instructor guide. The table of contents is written
   from that same list, in course order.
2. Run Sphinx (myst-nb, sphinx-book-theme) into ``_book/site`` with every warning an error: a broken
   cross-reference, a missing image, a staged page left out of the table of contents.
3. Check that every course notebook has its page and its .ipynb in the site.

Notebooks are shown with their stored outputs, as nbval checks them: nothing is executed. Only
carriage returns in stream outputs are applied, as a terminal or Jupyter shows them (a progress
bar that redrew itself shows its last state, not every state), and cells that print prose are
tagged so that their long lines wrap (tables and code keep theirs and scroll in their box).
Every build reads every page afresh: a few seconds, and no cached page can hide a warning.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
OUT = ROOT / "_book"

REFERENCES = "References"


def course_notebooks(root: Path = ROOT) -> list[Path]:
    """The course's notebooks in course order: ``notebooks/NN_*.ipynb``, not in subfolders."""
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def split_readme(text: str) -> tuple[str, str]:
    """README text -> (landing page without the References section, the References page)."""
    match = re.search(rf"^## {REFERENCES}[ \t]*\n", text, flags=re.M)
    if match is None:
        raise SystemExit(f"README.md has no '## {REFERENCES}' section for the book's References page")
    rest = text[match.end():]
    following = re.search(r"^## ", rest, flags=re.M)
    body, after = (rest[: following.start()], rest[following.start():]) if following else (rest, "")
    landing = text[: match.start()] + after
    return landing.rstrip() + "\n", f"# {REFERENCES}\n\n{body.strip()}\n"


def toctree(entries: list[str], caption: str) -> str:
    lines = "\n".join(entries)
    return f"\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{lines}\n```\n"


def apply_carriage_returns(text: str) -> str:
    """Each line as a terminal leaves it: what follows the last carriage return."""
    return "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line else line
                     for line in text.replace("\r\n", "\n").split("\n"))


# A printed line that is part of a table (columns lined up with runs of spaces) or of code
# (indented): such outputs keep their lines and scroll in their box; prose wraps, as in Jupyter.
_LAID_OUT = re.compile(r"\S {2,}\S|^(?: {4}|\t)")
WRAP_TAG = "book-wrap"  # myst-nb gives the cell the class tag_book-wrap (course-book.css)


def display_notebook(path: Path) -> str:
    """The notebook as the book shows it: the stored outputs, with carriage returns applied (as a
    terminal shows them), and the cells whose printed lines are prose tagged to wrap."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb.get("cells", []):
        streams = [o for o in cell.get("outputs", []) if o.get("output_type") == "stream"]
        for output in streams:
            text = "".join(output["text"]) if isinstance(output["text"], list) else output["text"]
            output["text"] = apply_carriage_returns(text) if "\r" in text else text
        lines = [line for o in streams for line in o["text"].splitlines()]
        if lines and not any(_LAID_OUT.search(line) for line in lines):
            tags = cell.setdefault("metadata", {}).setdefault("tags", [])
            tags.append(WRAP_TAG)
    return json.dumps(nb, ensure_ascii=False, indent=1) + "\n"


def _write(path: Path, content: str | bytes, written: set[Path]) -> None:
    """Write only when the content changes (a staged file keeps its time when nothing changed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8") if isinstance(content, str) else content
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)
    written.add(path)


def stage(root: Path, src: Path) -> list[str]:
    """Write the book's sources into ``src``; returns the notebooks' docnames, in course order."""
    notebooks = course_notebooks(root)
    if not notebooks:
        raise SystemExit(f"no notebooks/[0-9][0-9]_*.ipynb under {root}")
    written: set[Path] = set()
    landing, references = split_readme((root / "README.md").read_text(encoding="utf-8"))
    docnames = [f"notebooks/{nb.stem}" for nb in notebooks]
    guide = root / "notebooks" / "instructor-guide.md"
    toc = toctree(docnames, "Notebooks") + toctree(
        (["notebooks/instructor-guide"] if guide.exists() else []) + ["references"], "For reference")
    _write(src / "index.md", landing + toc, written)
    _write(src / "references.md", references, written)
    for nb in notebooks:
        _write(src / "notebooks" / nb.name, display_notebook(nb), written)
    if guide.exists():
        _write(src / "notebooks" / guide.name, guide.read_text(encoding="utf-8"), written)
    _write(src / "_assets" / "colab-badge.svg", (BOOK / "assets" / "colab-badge.svg").read_bytes(), written)
    for stale in [p for p in src.rglob("*") if p.is_file() and p not in written]:
        stale.unlink()  # a notebook renamed or removed on disk leaves the book too
    return docnames


def check_site(site: Path, docnames: list[str]) -> list[str]:
    """What the build must have produced: a page and an .ipynb for every notebook, in the nav."""
    problems = []
    index = (site / "index.html").read_text(encoding="utf-8") if (site / "index.html").exists() else ""
    for doc in docnames:
        for suffix in (".html", ".ipynb"):
            if not (site / (doc + suffix)).is_file():
                problems.append(f"{doc}{suffix} is missing from the site")
        if f'href="{doc}.html"' not in index:
            problems.append(f"the landing page's navigation does not link {doc}.html")
    return problems


def sphinx(src: Path, out: Path, *, notebooks: Path, conf: Path = BOOK, quiet: bool = True) -> int:
    """Sphinx over the staged sources into ``out/site``, every warning an error. Returns its exit code.

    Every page is read afresh (-E -a: a few seconds), so no cached page hides a warning.
    """
    from sphinx.cmd.build import build_main

    args = ["-b", "html", "-E", "-a", "-W", "--keep-going", "-n", "-c", str(conf),
            "-d", str(out / "doctrees"), "-D", f"course_notebook_sources={notebooks}",
            str(src), str(out / "site")]
    return build_main(["-q", *args] if quiet else args)


def build(root: Path = ROOT, out: Path = OUT, *, quiet: bool = True) -> int:
    """Stage, run Sphinx with warnings as errors, check the result. Returns an exit code."""
    src = out / "src"
    docnames = stage(root, src)
    shutil.rmtree(out / "site", ignore_errors=True)  # each build as from a clean clone, byte for byte
    code = sphinx(src, out, notebooks=root / "notebooks", quiet=quiet)
    if code:
        print(f"book: Sphinx failed (warnings are errors); sources staged in {src}", file=sys.stderr)
        return code
    problems = check_site(out / "site", docnames)
    for problem in problems:
        print(f"book: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the course's checkout (default: this one)")
    parser.add_argument("--out", type=Path, default=OUT, help="where src/, site/ and doctrees/ go")
    parser.add_argument("--clean", action="store_true", help="start from nothing (no cached pages)")
    parser.add_argument("-v", "--verbose", action="store_true", help="Sphinx's progress, not only warnings")
    args = parser.parse_args(argv)
    if args.clean:
        shutil.rmtree(args.out, ignore_errors=True)
    start = time.perf_counter()
    code = build(args.root.resolve(), args.out.resolve(), quiet=not args.verbose)
    if code == 0:
        print(f"book: built {args.out / 'site' / 'index.html'} in {time.perf_counter() - start:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
