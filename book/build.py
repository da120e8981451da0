"""Build the course as an HTML book: ``make book`` (``python book/build.py``).

1. Stage the sources in ``_book/src`` (git-ignored): the README without its References as the
   landing page (``index.md``), the References as their own page, the notebooks
   ``notebooks/[0-9][0-9]_*.ipynb`` (found on disk, never listed by hand) and the instructor guide.
   Each translated edition found on disk, ``notebooks/<lang>/`` with its own ``NN_*.ipynb`` (Korean,
   Japanese, Chinese), is staged under ``<lang>/``: its README as ``<lang>/index.md`` (a list of its
   notebooks when it has none), its notebooks as ``<lang>/notebooks/NN_*.ipynb`` and its
   ``GLOSSARY.md`` as ``<lang>/glossary.md`` when it has one. Each table of contents is written from
   those same lists, in course order, with captions in the edition's language.
2. Run Sphinx (myst-nb, sphinx-book-theme) once per language, every warning an error (a broken
   cross-reference, a missing image, a staged page left out of the table of contents): English
   into ``_book/site``, each edition into ``_book/site/<lang>/`` as a book of its own, so that its
   navigation, search, theme strings and ``<html lang>`` are its language's. Every page links the
   same page in the other languages (course_book's language switcher).
3. Check that every page of every language is in the site, each notebook with its .ipynb.

Links between the sources are rewritten for the staged layout: a link to a page of the same
language stays a link Sphinx checks, a link to another language's page becomes ``book:<page>.html``
(course_book makes it relative), and a link to another file of the repository opens it on GitHub.

Notebooks are shown with their stored outputs, as nbval checks them: nothing is executed. Only
carriage returns in stream outputs are applied, as a terminal or Jupyter shows them (a progress
bar that redrew itself shows its last state, not every state), and cells that print prose are
tagged so that their long lines wrap (tables and code keep theirs and scroll in their box).
Every build reads every page afresh: a few seconds a language, and no cached page can hide a warning.
"""

from __future__ import annotations

import argparse
import functools
import json
import posixpath
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
OUT = ROOT / "_book"
sys.path.insert(0, str(ROOT))

from course_utils import BRANCH, REPO  # noqa: E402  (cheap: no torch)
from course_utils.tools.editions import LANGUAGES  # noqa: E402  (cheap: polib only when PO files are read)

REFERENCES = "References"
ENGLISH = "en"
# Per language: Sphinx's language (its theme strings and search), the page's <html lang>, and the
# captions of the table of contents. Chinese searches with Sphinx's Japanese splitter, which also
# cuts runs of Han characters: Sphinx 9.0's own Chinese search writes `window.Stemmer =
# ChineseStemmer`, a name it never defines (a JavaScript error on every page, and no search).
LOCALES = {
    ENGLISH: {"name": "English", "sphinx": "en", "html": "en",
              "notebooks": "Notebooks", "reference": "For reference", "glossary": "Glossary"},
    "ko": {"sphinx": "ko", "html": "ko",
           "notebooks": "노트북", "reference": "참고", "glossary": "용어집"},
    "ja": {"sphinx": "ja", "html": "ja",
           "notebooks": "ノートブック", "reference": "参考", "glossary": "用語集"},
    "zh": {"sphinx": "zh_CN", "html": "zh-Hans", "search": "ja",
           "notebooks": "笔记本", "reference": "参考", "glossary": "术语表"},
}
NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"


def course_notebooks(root: Path = ROOT) -> list[Path]:
    """The course's notebooks in course order: ``notebooks/NN_*.ipynb``, not in subfolders."""
    return sorted((root / "notebooks").glob(NOTEBOOK_GLOB))


def edition_languages(root: Path = ROOT) -> list[str]:
    """The translated editions on disk: ``notebooks/<lang>/`` folders with notebooks, in the order
    of course_utils.tools.editions.LANGUAGES (Korean, Japanese, Chinese), any other after them."""
    folder = root / "notebooks"
    found = [d.name for d in folder.iterdir() if d.is_dir() and any(d.glob(NOTEBOOK_GLOB))] \
        if folder.is_dir() else []
    order = list(LANGUAGES)
    return sorted(found, key=lambda lang: (order.index(lang) if lang in order else len(order), lang))


def edition_notebooks(root: Path, lang: str) -> list[Path]:
    if lang == ENGLISH:
        return course_notebooks(root)
    return sorted((root / "notebooks" / lang).glob(NOTEBOOK_GLOB))


def language_name(lang: str) -> str:
    return LOCALES.get(lang, {}).get("name") or LANGUAGES.get(lang, lang)


def locale(lang: str) -> dict:
    own = LOCALES.get(lang, {"sphinx": lang, "html": lang})
    return {**LOCALES[ENGLISH], **own, "name": language_name(lang)}


@dataclass
class Edition:
    """One language of the book: where its sources are staged, its pages, where its site goes."""

    lang: str
    src: Path  # Sphinx's source folder
    notebooks: Path  # the repository's folder of its notebooks (the .ipynb copied beside the pages)
    docnames: list[str] = field(default_factory=list)  # every staged page
    notebook_docs: list[str] = field(default_factory=list)  # its notebooks' pages, in course order

    @property
    def prefix(self) -> str:
        """Where its pages are in the site: '' for English, 'ko/' for Korean."""
        return "" if self.lang == ENGLISH else f"{self.lang}/"


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

# A markdown link (not an image): [text](target "title"); the target without a scheme or anchor only.
_LINK = re.compile(r"(?<!!)(\]\()(<[^>\n]+>|[^()\s]+)((?:\s+\"[^\"\n]*\")?\))")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


class Relinker:
    """Rewrites the relative links of a source for the staged book (see the module's docstring).

    ``pages`` maps a repository path (``notebooks/ko/00_x.ipynb``) to its language and the staged
    source path in that language's source folder (``notebooks/00_x.ipynb``).
    """

    def __init__(self, root: Path, pages: dict[str, tuple[str, str]]) -> None:
        self.root, self.pages = root, pages

    def target(self, target: str, source: str, lang: str, staged: str, fallback: str | None = None) -> str:
        """The link ``target`` of the repository file ``source``, for the page staged at ``staged``
        in ``lang``; ``fallback`` (the English original of a translated source) resolves what the
        translation copied from it (a link to the instructor guide, say)."""
        bare = target[1:-1] if target.startswith("<") else target
        if not bare or _SCHEME.match(bare) or bare.startswith(("#", "/")):
            return target
        path, hash_, fragment = bare.partition("#")
        for base in (source, fallback):
            if base is None:
                continue
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(base), path))
            if resolved in self.pages:
                page_lang, page = self.pages[resolved]
                if page_lang == lang:
                    return posixpath.relpath(page, posixpath.dirname(staged) or ".") + hash_ + fragment
                site = ("" if page_lang == ENGLISH else f"{page_lang}/") + page.rsplit(".", 1)[0] + ".html"
                return f"book:{site}{hash_}{fragment}"
            if not resolved.startswith("..") and (self.root / resolved).exists():
                kind = "tree" if (self.root / resolved).is_dir() else "blob"
                return f"https://github.com/{REPO}/{kind}/{BRANCH}/{resolved}{hash_}{fragment}"
        return target  # leads nowhere: Sphinx says so, and the build fails

    def markdown(self, text: str, source: str, lang: str, staged: str, fallback: str | None = None) -> str:
        return _LINK.sub(lambda m: m.group(1) + self.target(m.group(2), source, lang, staged, fallback)
                         + m.group(3), text)


def display_notebook(path: Path, relink=None) -> str:
    """The notebook as the book shows it: the stored outputs, with carriage returns applied (as a
    terminal shows them), and the cells whose printed lines are prose tagged to wrap. ``relink``,
    given, rewrites each markdown cell's text (its links)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb.get("cells", []):
        if relink is not None and cell.get("cell_type") == "markdown":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["source"] = relink(source)
        streams = [o for o in cell.get("outputs", []) if o.get("output_type") == "stream"]
        for output in streams:
            text = "".join(output["text"]) if isinstance(output["text"], list) else output["text"]
            output["text"] = apply_carriage_returns(text) if "\r" in text else text
        lines = [line for o in streams for line in o["text"].splitlines()]
        if lines and not any(_LAID_OUT.search(line) for line in lines):
            tags = cell.setdefault("metadata", {}).setdefault("tags", [])
            tags.append(WRAP_TAG)
    return json.dumps(nb, ensure_ascii=False, indent=1) + "\n"


def notebook_title(path: Path) -> str:
    """The first heading of a notebook's markdown (its title), else its file name."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            found = re.search(r"^#\s+(.+?)\s*$", source, flags=re.M)
            if found:
                return found.group(1)
    return path.stem


def _write(path: Path, content: str | bytes, written: set[Path]) -> None:
    """Write only when the content changes (a staged file keeps its time when nothing changed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8") if isinstance(content, str) else content
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)
    written.add(path)


def _pages(root: Path, langs: list[str]) -> dict[str, tuple[str, str]]:
    """Repository path -> (language, staged source path) of every page of the book."""
    pages = {"README.md": (ENGLISH, "index.md")}
    guide = root / "notebooks" / "instructor-guide.md"
    if guide.exists():
        pages["notebooks/instructor-guide.md"] = (ENGLISH, "notebooks/instructor-guide.md")
    for lang in [ENGLISH, *langs]:
        for nb in edition_notebooks(root, lang):
            pages[nb.relative_to(root).as_posix()] = (lang, f"notebooks/{nb.name}")
    for lang in langs:
        pages[f"notebooks/{lang}/README.md"] = (lang, "index.md")
        if (root / "notebooks" / lang / "GLOSSARY.md").exists():
            pages[f"notebooks/{lang}/GLOSSARY.md"] = (lang, "glossary.md")
    return pages


def stage(root: Path, src: Path) -> list[Edition]:
    """Write the book's sources into ``src``; returns its languages, English first, each with its
    pages (its notebooks in course order)."""
    notebooks = course_notebooks(root)
    if not notebooks:
        raise SystemExit(f"no notebooks/{NOTEBOOK_GLOB} under {root}")
    langs = edition_languages(root)
    relinker = Relinker(root, _pages(root, langs))
    written: set[Path] = set()
    badge = (BOOK / "assets" / "colab-badge.svg").read_bytes()

    english = Edition(ENGLISH, src, root / "notebooks")
    landing, references = split_readme((root / "README.md").read_text(encoding="utf-8"))
    english.notebook_docs = [f"notebooks/{nb.stem}" for nb in notebooks]
    guide = root / "notebooks" / "instructor-guide.md"
    extra = (["notebooks/instructor-guide"] if guide.exists() else []) + ["references"]
    words = locale(ENGLISH)
    toc = toctree(english.notebook_docs, words["notebooks"]) + toctree(extra, words["reference"])
    _write(src / "index.md", relinker.markdown(landing, "README.md", ENGLISH, "index.md") + toc, written)
    _write(src / "references.md", references, written)
    for nb in notebooks:
        staged = f"notebooks/{nb.name}"
        _write(src / staged, display_notebook(
            nb, lambda text, t=staged: relinker.markdown(text, t, ENGLISH, t)), written)
    if guide.exists():
        _write(src / "notebooks" / guide.name, relinker.markdown(
            guide.read_text(encoding="utf-8"), "notebooks/instructor-guide.md", ENGLISH,
            "notebooks/instructor-guide.md"), written)
    _write(src / "_assets" / "colab-badge.svg", badge, written)
    english.docnames = ["index", "references", *english.notebook_docs, *extra[:-1]]
    editions = [english]

    for lang in langs:
        folder, esrc = root / "notebooks" / lang, src / lang
        edition = Edition(lang, esrc, folder)
        words = locale(lang)
        enbs = edition_notebooks(root, lang)
        edition.notebook_docs = [f"notebooks/{nb.stem}" for nb in enbs]
        for nb in enbs:
            staged, source = f"notebooks/{nb.name}", f"notebooks/{lang}/{nb.name}"
            # the English original (same path as staged) resolves links the translation copied
            relink = functools.partial(relinker.markdown, source=source, lang=lang, staged=staged,
                                       fallback=staged)
            _write(esrc / staged, display_notebook(nb, relink), written)
        glossary = folder / "GLOSSARY.md"
        extra = ["glossary"] if glossary.exists() else []
        if glossary.exists():
            text = glossary.read_text(encoding="utf-8")
            _write(esrc / "glossary.md",
                   relinker.markdown(text, f"notebooks/{lang}/GLOSSARY.md", lang, "glossary.md"), written)
        readme = folder / "README.md"
        if readme.exists():
            landing = relinker.markdown(readme.read_text(encoding="utf-8"), f"notebooks/{lang}/README.md",
                                        lang, "index.md", "README.md")
        else:  # no README yet: the edition's notebooks, by their titles
            items = "\n".join(f"- [{notebook_title(nb)}](notebooks/{nb.name})" for nb in enbs)
            landing = f"# {english_title(root)} ({words['name']})\n\n{items}\n"
        toc = toctree(edition.notebook_docs, words["notebooks"])
        if extra:
            toc += toctree(extra, words["reference"])
        _write(esrc / "index.md", landing.rstrip() + "\n" + toc, written)
        _write(esrc / "_assets" / "colab-badge.svg", badge, written)
        edition.docnames = ["index", *edition.notebook_docs, *extra]
        editions.append(edition)

    table = json.dumps(languages_table(editions), ensure_ascii=False, indent=1)
    _write(src / "languages.json", table, written)
    for stale in [p for p in src.rglob("*") if p.is_file() and p not in written]:
        stale.unlink()  # a notebook renamed or removed on disk leaves the book too
    return editions


def english_title(root: Path) -> str:
    found = re.search(r"^#\s+(.+?)\s*$", (root / "README.md").read_text(encoding="utf-8"), flags=re.M)
    return found.group(1) if found else "The course"


def languages_table(editions: list[Edition]) -> dict:
    """What course_book's language switcher needs: each language's name, place and pages."""
    return {e.lang: {"name": language_name(e.lang), "html": locale(e.lang)["html"], "prefix": e.prefix,
                     "pages": sorted(e.docnames)} for e in editions}


def check_site(site: Path, editions: list[Edition]) -> list[str]:
    """What the build must have produced: every page of every language; an .ipynb beside every
    notebook's page, and the notebook in its language's navigation."""
    problems = []
    for edition in editions:
        index_path = site / edition.prefix / "index.html"
        index = index_path.read_text(encoding="utf-8") if index_path.exists() else ""
        for doc in edition.docnames:
            if not (site / (edition.prefix + doc + ".html")).is_file():
                problems.append(f"{edition.prefix}{doc}.html is missing from the site")
        for doc in edition.notebook_docs:
            if not (site / (edition.prefix + doc + ".ipynb")).is_file():
                problems.append(f"{edition.prefix}{doc}.ipynb is missing from the site")
            if f'href="{doc}.html"' not in index:
                problems.append(f"the navigation of {edition.prefix}index.html does not link {doc}.html")
    return problems


def sphinx(src: Path, out: Path, *, notebooks: Path, lang: str = ENGLISH, languages: Path | None = None,
           exclude: list[str] = (), conf: Path = BOOK, quiet: bool = True) -> int:
    """Sphinx over one language's staged sources into ``out/site`` (``out/site/<lang>``), every
    warning an error. Returns its exit code.

    Every page is read afresh (-E -a: a few seconds), so no cached page hides a warning.
    """
    from sphinx import locale as sphinx_locale
    from sphinx.cmd.build import build_main

    # Sphinx keeps each catalog's translations for the process: without this, the Chinese book
    # built after the Korean one would say 검색 for "Search".
    sphinx_locale.translators.clear()

    site = out / "site" if lang == ENGLISH else out / "site" / lang
    words = locale(lang)
    args = ["-b", "html", "-E", "-a", "-W", "--keep-going", "-n", "-c", str(conf),
            "-d", str(out / "doctrees" / lang), "-D", f"course_notebook_sources={notebooks}",
            "-D", f"language={words['sphinx']}", "-D", f"course_language={lang}",
            "-D", f"course_languages={languages or src / 'languages.json'}"]
    if words.get("search"):
        args += ["-D", f"html_search_language={words['search']}"]
    if exclude:
        args += ["-D", "exclude_patterns=" + ",".join(exclude)]
    args += [str(src), str(site)]
    return build_main(["-q", *args] if quiet else args)


def build(root: Path = ROOT, out: Path = OUT, *, quiet: bool = True) -> int:
    """Stage, run Sphinx for each language with warnings as errors, check the result. Returns an exit code."""
    src = out / "src"
    editions = stage(root, src)
    shutil.rmtree(out / "site", ignore_errors=True)  # each build as from a clean clone, byte for byte
    others = [e.lang for e in editions[1:]]
    for edition in editions:
        code = sphinx(edition.src, out, notebooks=edition.notebooks, lang=edition.lang,
                      languages=src / "languages.json", exclude=others if edition.lang == ENGLISH else [],
                      quiet=quiet)
        if code:
            print(f"book: Sphinx failed on the {language_name(edition.lang)} pages (warnings are errors); "
                  f"sources staged in {edition.src}", file=sys.stderr)
            return code
    problems = check_site(out / "site", editions)
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
