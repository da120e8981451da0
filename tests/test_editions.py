"""The Korean, Japanese and Chinese editions: complete, up to date, and the English code unchanged.

The editions are built by ``course_utils.tools.editions`` from the English notebooks and the PO files in
``notebooks/<lang>/po``. These tests read the committed files; the last ones change an English
cell in a copy and check what the generator does with it.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import polib
import pytest

from course_utils.tools import editions

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ENGLISH = editions.english_notebooks(NOTEBOOKS)
LANGS = sorted(editions.LANGUAGES)
LINK = re.compile(r"\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _nb(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _po(lang: str, notebook: Path) -> polib.POFile:
    return polib.pofile(str(editions.po_path(NOTEBOOKS, lang, notebook)), wrapwidth=0)


def test_the_course_has_three_editions_of_every_notebook():
    assert len(ENGLISH) == 13 and LANGS == ["ja", "ko", "zh"]
    for lang in LANGS:
        assert sorted(p.name for p in (NOTEBOOKS / lang).glob("*.ipynb")) == [p.name for p in ENGLISH]
        assert sorted(p.name for p in (NOTEBOOKS / lang / "po").glob("*.po")) == \
            [p.stem + ".po" for p in ENGLISH]


@pytest.mark.parametrize("lang", LANGS)
def test_every_entry_is_translated_and_every_edition_is_what_the_po_files_build(lang):
    found = editions.problems(lang, NOTEBOOKS)
    assert not found, f"{len(found)} problem(s) in the {lang} edition:\n" + "\n".join(map(str, found))


@pytest.mark.parametrize("lang", LANGS)
def test_code_cells_and_outputs_are_the_english_ones_byte_for_byte(lang):
    for english in ENGLISH:
        mine, theirs = _nb(NOTEBOOKS / lang / english.name), _nb(english)
        assert [(c["id"], c["cell_type"]) for c in mine["cells"]] == \
            [(c["id"], c["cell_type"]) for c in theirs["cells"]], english.name
        for a, b in zip(mine["cells"], theirs["cells"], strict=True):
            if b["cell_type"] == "code":
                assert a == b, f"{lang}/{english.name} cell {b['id']} differs from the English"
        assert mine["metadata"] == {**theirs["metadata"], "course_edition": lang}


def _code_of(text: str) -> list[str]:
    """The fenced blocks and inline code spans of a markdown text: what a translation keeps."""
    without_fences = FENCE.sub("", text)
    return sorted(FENCE.findall(text) + [m.group(2) for m in CODE_SPAN.finditer(without_fences)])


def _table_shape(text: str) -> list[int]:
    return [line.count("|") for line in text.splitlines() if line.lstrip().startswith("|")]


@pytest.mark.parametrize("lang", LANGS)
def test_translations_keep_the_code_the_tables_and_the_headings(lang):
    wrong = []
    for english in ENGLISH:
        for entry in _po(lang, english):
            if entry.obsolete or not entry.msgstr:
                continue
            where = f"{english.name} cell {entry.msgctxt}"
            if _code_of(entry.msgstr) != _code_of(entry.msgid):
                lost = set(_code_of(entry.msgid)) - set(_code_of(entry.msgstr))
                added = set(_code_of(entry.msgstr)) - set(_code_of(entry.msgid))
                wrong.append(f"{where}: code differs (missing {sorted(lost)[:3]}, new {sorted(added)[:3]})")
            if _table_shape(entry.msgstr) != _table_shape(entry.msgid):
                wrong.append(f"{where}: a table's rows or columns differ")
            heads = [re.match(r"#+", h).group() for h in re.findall(r"^#+ ", entry.msgid, re.M)]
            if heads != [re.match(r"#+", h).group() for h in re.findall(r"^#+ ", entry.msgstr, re.M)]:
                wrong.append(f"{where}: headings differ in number or level")
    assert not wrong, "\n".join(wrong)


def _targets(text: str) -> list[str]:
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("lang", LANGS)
def test_links_and_images_in_the_editions_resolve(lang):
    folder = NOTEBOOKS / lang
    pages = [(p.name, "".join(c["source"])) for p in sorted(folder.glob("*.ipynb"))
             for c in _nb(p)["cells"] if c["cell_type"] == "markdown"]
    pages += [(p.name, p.read_text(encoding="utf-8")) for p in (folder / "README.md", folder / "GLOSSARY.md")]
    broken = []
    for name, text in pages:
        for target in _targets(text):
            if target.startswith("https://colab.research.google.com/github/"):
                path = target.split("/blob/main/", 1)[1]
                ok = path.startswith(f"notebooks/{lang}/") and (ROOT / path).is_file()
            elif target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            else:
                ok = (folder / target.split("#")[0]).exists()
            if not ok:
                broken.append(f"{lang}/{name}: {target}")
    assert not broken, "\n".join(broken)
    readme = (folder / "README.md").read_text(encoding="utf-8")
    assert all(p.name in readme for p in ENGLISH), f"{lang}/README.md does not list every notebook"


def test_the_english_readme_links_every_edition():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for lang in LANGS:
        assert f"(notebooks/{lang}/README.md)" in readme


@pytest.mark.parametrize("lang", LANGS)
def test_each_edition_says_at_the_top_of_notebook_00_that_outputs_stay_in_english(lang):
    cells = _nb(NOTEBOOKS / lang / ENGLISH[0].name)["cells"]
    first = next(c for c in cells if c["cell_type"] == "markdown")
    note = next(e for e in _po(lang, ENGLISH[0]) if e.msgctxt == editions.NOTE_CONTEXT)
    assert note.msgstr and note.msgstr != note.msgid
    assert f"> {note.msgstr}" in "".join(first["source"])
    assert len(re.findall(r"[.。!?]", note.msgstr.strip())) <= 2  # one sentence (a Korean one ends in '.')


@pytest.fixture
def copy_of_notebook_01(tmp_path: Path) -> tuple[Path, Path]:
    """A notebooks folder with notebook 01 and its three PO files, to change without harm."""
    english = next(p for p in ENGLISH if p.name.startswith("01_"))
    shutil.copy(english, tmp_path / english.name)
    for lang in LANGS:
        (tmp_path / lang / "po").mkdir(parents=True)
        shutil.copy(editions.po_path(NOTEBOOKS, lang, english), editions.po_path(tmp_path, lang, english))
    return tmp_path, tmp_path / english.name


def test_changing_one_english_cell_makes_it_fuzzy_in_all_three_languages(copy_of_notebook_01):
    root, notebook = copy_of_notebook_01
    nb = _nb(notebook)
    cell = next(c for c in nb["cells"][1:] if c["cell_type"] == "markdown")
    old = "".join(cell["source"])
    cell["source"] = (old.rstrip("\n") + " One more sentence.").splitlines(keepends=True)
    notebook.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for lang in LANGS:
        path = str(editions.po_path(root, lang, notebook))
        before = next(e for e in polib.pofile(path) if e.msgctxt == cell["id"])
        counts = editions.update_po(notebook, lang, root)
        assert counts == {"new": 0, "fuzzy": 1, "obsolete": 0}
        entry = next(e for e in polib.pofile(path) if e.msgctxt == cell["id"])
        assert "fuzzy" in entry.flags and entry.msgstr == before.msgstr and entry.previous_msgid == old
        named = [p for p in editions.problems(lang, root) if p.cell == cell["id"]]
        assert named and named[0].what.startswith("fuzzy"), (lang, named)
        # until a translator clears the flag, the edition shows the new English, not the old translation
        built = editions.build_notebook(notebook, lang, root)
        shown = next(c for c in built["cells"] if c["id"] == cell["id"])
        assert "One more sentence." in "".join(shown["source"])


def test_a_new_cell_gets_an_empty_entry_and_a_removed_one_becomes_obsolete(copy_of_notebook_01):
    root, notebook = copy_of_notebook_01
    nb = _nb(notebook)
    gone = next(c for c in nb["cells"][1:] if c["cell_type"] == "markdown")
    nb["cells"].remove(gone)
    nb["cells"].append({"cell_type": "markdown", "id": "new-cell", "metadata": {},
                        "source": ["A new paragraph."]})
    notebook.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for lang in LANGS:
        assert editions.update_po(notebook, lang, root) == {"new": 1, "fuzzy": 0, "obsolete": 1}
        po = polib.pofile(str(editions.po_path(root, lang, notebook)))
        assert [e.msgstr for e in po if e.msgctxt == "new-cell"] == [""]
        assert [e.obsolete for e in po if e.msgctxt == gone["id"]] == [True]
        assert any(p.cell == "new-cell" and p.what == "not translated" for p in editions.problems(lang, root))


def test_the_command_line_check_fails_on_a_stale_edition(copy_of_notebook_01, monkeypatch, capsys):
    root, notebook = copy_of_notebook_01
    monkeypatch.setattr(editions, "NOTEBOOKS", root)
    for lang in LANGS:  # the editions themselves are not in the copy yet: stale
        assert editions.main(["--check", "--lang", lang]) == 1
    assert "the committed edition differs" in capsys.readouterr().out
    assert editions.main([]) == 0  # build them
    assert all((root / lang / notebook.name).is_file() for lang in LANGS)
