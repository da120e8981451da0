"""The Korean, Japanese and Chinese editions of the notebooks, built from gettext PO files.

Each edition (``notebooks/ko``, ``notebooks/ja``, ``notebooks/zh``) is the English notebook with
its markdown cells translated; code cells and their outputs are the English ones, byte for byte.
The translations live in ``notebooks/<lang>/po/<notebook>.po``: one entry per markdown cell, the
cell's id as ``msgctxt`` and its English text as ``msgid``, so Poedit, Weblate or Crowdin can edit
them. ``python -m course_utils.tools.editions`` (``make editions``) brings the PO files up to date with
the English notebooks (a changed cell keeps its translation, flagged fuzzy; a new cell gets an
empty entry) and writes the editions; ``--check`` only reports what is missing, fuzzy or stale.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

LANGUAGES = {"ko": "한국어", "ja": "日本語", "zh": "简体中文"}
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# notebook 00 says, in each edition's language, that printed outputs and hints stay in English
EDITION_NOTE = ("In this edition the explanations are translated; code, printed outputs and the "
                "exercises' hints come from `course_utils` and stay in English.")
NOTE_CONTEXT = "edition-note"


def _polib():
    import polib  # a translation tool's library: imported only where PO files are read or written

    return polib


def english_notebooks(root: Path = NOTEBOOKS) -> list[Path]:
    return sorted(root.glob("[0-9][0-9]_*.ipynb"))


def po_path(root: Path, lang: str, notebook: Path) -> Path:
    return root / lang / "po" / f"{notebook.stem}.po"


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _write(path: Path, nb: dict) -> None:
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _markdown_cells(nb: dict):
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown":
            yield index, cell["id"], "".join(cell["source"])


def _wanted(notebook: Path, nb: dict) -> list[tuple[str, str, int]]:
    """(msgctxt, English text, cell index) for every entry this notebook's PO file must have."""
    wanted = [(cell_id, text, index) for index, cell_id, text in _markdown_cells(nb)]
    if notebook.name.startswith("00_"):
        wanted.append((NOTE_CONTEXT, EDITION_NOTE, 0))
    return wanted


def update_po(notebook: Path, lang: str, root: Path = NOTEBOOKS) -> dict[str, int]:
    """Bring one PO file in step with its English notebook; returns counts of what changed.

    An entry whose English is unchanged stays as it is. A cell whose English changed keeps its
    translation, flagged ``fuzzy``, with the old English as ``previous_msgid``. A new cell gets an
    empty entry; an entry whose cell is gone becomes obsolete.
    """
    polib = _polib()
    path = po_path(root, lang, notebook)
    if path.exists():
        po = polib.pofile(str(path), wrapwidth=0)
    else:
        po = polib.POFile(wrapwidth=0)
        po.metadata = {"Project-Id-Version": "pytorch-data-parallel-course",
                       "Language": lang, "MIME-Version": "1.0",
                       "Content-Type": "text/plain; charset=UTF-8",
                       "Content-Transfer-Encoding": "8bit"}
    live = [e for e in po if not e.obsolete]
    by_text = {e.msgid: e for e in live}
    by_context = {e.msgctxt: e for e in live}
    counts = {"new": 0, "fuzzy": 0, "obsolete": 0}
    entries = []
    wanted = _wanted(notebook, _read(notebook))
    contexts = {context for context, _, _ in wanted}
    for context, text, index in wanted:
        entry = by_context.get(context)
        if entry is None or entry.msgid != text:
            moved = by_text.get(text)  # the same English under another id: reuse it as it is
            if moved is not None and moved.msgctxt not in contexts:
                entry = moved
                entry.msgctxt = context
            elif entry is not None:
                if entry.msgstr:
                    entry.previous_msgid = entry.msgid
                    if "fuzzy" not in entry.flags:
                        entry.flags.append("fuzzy")
                    counts["fuzzy"] += 1
                entry.msgid = text
            else:
                entry = polib.POEntry(msgctxt=context, msgid=text, msgstr="")
                counts["new"] += 1
        entry.occurrences = [(notebook.name, str(index))]
        entries.append(entry)
    kept = {id(e) for e in entries}
    for e in po:
        if id(e) not in kept and not e.obsolete:
            e.obsolete = True
            counts["obsolete"] += 1
    old = [e for e in po if e.obsolete and id(e) not in kept]
    po[:] = entries + old
    path.parent.mkdir(parents=True, exist_ok=True)
    po.save(str(path))
    return counts


def _translated(entry) -> str | None:
    return entry.msgstr if entry is not None and entry.msgstr and "fuzzy" not in entry.flags else None


def _edition_url(text: str, lang: str) -> str:
    """The Colab badge and other links to ``notebooks/NN_x.ipynb`` on GitHub open this edition."""
    return text.replace("/blob/main/notebooks/", f"/blob/main/notebooks/{lang}/")


def build_notebook(notebook: Path, lang: str, root: Path = NOTEBOOKS) -> dict:
    """The edition of one notebook: the English one with its markdown cells translated.

    A cell without a usable translation (missing, empty or fuzzy) stays in English, so an edition
    is always whole; :func:`problems` lists those cells.
    """
    polib = _polib()
    nb = _read(notebook)
    path = po_path(root, lang, notebook)
    po = polib.pofile(str(path), wrapwidth=0) if path.exists() else []
    entries = {e.msgctxt: e for e in po if not e.obsolete}
    edition = copy.deepcopy(nb)
    for index, cell_id, text in _markdown_cells(nb):
        entry = entries.get(cell_id)
        new = _translated(entry) if entry is not None and entry.msgid == text else None
        edition["cells"][index]["source"] = _edition_url(new or text, lang).splitlines(keepends=True)
    if notebook.name.startswith("00_"):
        note = _translated(entries.get(NOTE_CONTEXT)) or EDITION_NOTE
        first = next(i for i, c in enumerate(edition["cells"]) if c["cell_type"] == "markdown")
        source = "".join(edition["cells"][first]["source"]).rstrip("\n") + f"\n\n> {note}\n"
        edition["cells"][first]["source"] = source.splitlines(keepends=True)
    edition["metadata"] = {**edition["metadata"], "course_edition": lang}
    return edition


@dataclass(frozen=True)
class Problem:
    lang: str
    notebook: str
    cell: str
    what: str

    def __str__(self) -> str:
        return f"{self.lang}/{self.notebook} cell {self.cell}: {self.what}"


def problems(lang: str, root: Path = NOTEBOOKS) -> list[Problem]:
    """Every entry that is missing, empty, fuzzy or stale, and every edition that is out of date."""
    polib = _polib()
    found = []
    for notebook in english_notebooks(root):
        path = po_path(root, lang, notebook)
        po = polib.pofile(str(path), wrapwidth=0) if path.exists() else []
        entries = {e.msgctxt: e for e in po if not e.obsolete}
        for context, text, _ in _wanted(notebook, _read(notebook)):
            entry = entries.get(context)
            if entry is None:
                what = "no entry (run make editions)"
            elif entry.msgid != text:
                what = "the English changed since the PO file was updated (run make editions)"
            elif "fuzzy" in entry.flags:
                what = "fuzzy: the English changed; check the translation, then clear the flag"
            elif not entry.msgstr.strip():
                what = "not translated"
            else:
                continue
            found.append(Problem(lang, notebook.name, context, what))
        edition = root / lang / notebook.name
        if not edition.exists() or _read(edition) != build_notebook(notebook, lang, root):
            found.append(Problem(lang, notebook.name, "-", "the committed edition differs from "
                                 "what the PO file builds (run make editions)"))
    return found


def update(root: Path = NOTEBOOKS, languages=tuple(LANGUAGES)) -> None:
    for lang in languages:
        for notebook in english_notebooks(root):
            counts = update_po(notebook, lang, root)
            _write(root / lang / notebook.name, build_notebook(notebook, lang, root))
            changed = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
            if changed:
                print(f"{lang}/{notebook.name}: {changed}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.tools.editions",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; list what is missing, fuzzy or out of date, exit 1 if any")
    parser.add_argument("--lang", choices=sorted(LANGUAGES), action="append",
                        help="only this language (repeatable); default: all three")
    args = parser.parse_args(argv)
    languages = tuple(args.lang or LANGUAGES)
    if not args.check:
        update(NOTEBOOKS, languages)
    found = [p for lang in languages for p in problems(lang, NOTEBOOKS)]
    for p in found:
        print(p)
    print(f"{len(found)} problem(s) in {', '.join(languages)}" if found else
          f"editions up to date: {', '.join(languages)}")
    return 1 if found and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
