"""The HTML book's build (book/build.py) and browser check (book/check.py) catch what they promise.

A tiny course (two notebooks with a figure and math, a README with References, an instructor guide,
and two translated editions: Korean with both notebooks, a README and a glossary, Japanese with one
notebook and neither) is built with the book's real configuration, then broken on purpose: a
notebook left out of the table of contents, a missing image, a broken link, a page without its
outputs, a page that fetches from a CDN, a console error, a page too wide for a phone, a Colab
badge that opens another edition, a browser without CJK fonts.

Marked ``book``: they need the book's own venv and Debian's Chromium, so `make test` leaves them out
and `make book-check` runs them (`pytest -m book tests/test_book.py` in .venv-book).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.book

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def book():
    sys.path[:0] = [str(ROOT / "book"), str(ROOT)]  # the book's modules; course_utils (no torch needed)
    import build
    import check

    return build, check


def png(width: int = 24, height: int = 16) -> bytes:
    """A small orange PNG, written by hand (no imaging library in the book's venv)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\0" + b"\xf9\xab\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def notebook(name: str, title: str, *, figure: bool = False, lang: str | None = None) -> str:
    from course_utils.tools.nbtools import badge_markdown

    badge = badge_markdown(name)
    if lang:  # an edition's badge opens the edition's notebook (course_utils.tools.editions)
        badge = badge.replace("/blob/main/notebooks/", f"/blob/main/notebooks/{lang}/")
    not_attempted = ("\u00b7 Exercise 00.1 (predict): not attempted yet. Replace the ... in the answer "
                     "cell with your prediction, run it, then run this check cell again to see it.\n")
    outputs = [{"output_type": "stream", "name": "stdout",
                "text": ["epochs:  50%|#   | 1/2\repochs: 100%|####| 2/2\n", not_attempted]}]
    if figure:
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(png()).decode(), "text/plain": ["<Figure>"]}})
    cells = [
        {"cell_type": "markdown", "metadata": {},
         "source": f"{badge}\n\n# {title}\n\n"
                   "The mean is $\\bar x = \\frac{1}{n}\\sum_i x_i$."},
        {"cell_type": "code", "execution_count": 1, "metadata": {}, "source": "print('hello')",
         "outputs": outputs},
        {"cell_type": "markdown", "metadata": {},
         "source": "## Next\n\nSee [the guide](instructor-guide.md)."},
    ]
    nb = {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                       "language_info": {"name": "python"}}}
    return json.dumps(nb, indent=1)


README = """# A tiny course

| notebook | what |
|---|---|
| [00 · First](notebooks/00_first.ipynb) {badge} | the first idea |
| [01 · Second](notebooks/01_second.ipynb) | the second idea |

Teachers: the [instructor guide](notebooks/instructor-guide.md).

## References

- A source, at https://example.org/a/long/address/that/must/wrap/on/a/phone/screen/somewhere.html
"""


KO_README = """# 작은 강좌 (한국어판)

[English](../../README.md) · [용어집](GLOSSARY.md) · [강사 안내서](../instructor-guide.md)

| 노트북 | 내용 |
|---|---|
| [00 · 처음](00_first.ipynb) {badge} | 첫 번째 생각 |
| [01 · 둘째](01_second.ipynb) | 두 번째 생각 |
"""

KO_GLOSSARY = "# 용어집\n\n| English | 한국어 |\n|---|---|\n| gradient | 변화도 |\n\n[처음](00_first.ipynb)\n"


@pytest.fixture(scope="module")
def course(book, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("course")
    (root / "notebooks" / "ko").mkdir(parents=True)
    (root / "notebooks" / "ja").mkdir(parents=True)
    from course_utils.tools.nbtools import badge_markdown

    (root / "README.md").write_text(README.format(badge=badge_markdown("00_first.ipynb")), encoding="utf-8")
    (root / "notebooks" / "00_first.ipynb").write_text(notebook("00_first.ipynb", "00 · First"))
    (root / "notebooks" / "01_second.ipynb").write_text(
        notebook("01_second.ipynb", "01 · Second", figure=True))
    guide = "# Instructor guide\n\nBack to [00](00_first.ipynb).\n"
    (root / "notebooks" / "instructor-guide.md").write_text(guide)
    # The editions: placeholders written here only, never into the course's notebooks/<lang>/.
    ko = root / "notebooks" / "ko"
    ko_badge = badge_markdown("00_first.ipynb").replace("/notebooks/", "/notebooks/ko/")
    (ko / "00_first.ipynb").write_text(notebook("00_first.ipynb", "00 · 처음", lang="ko"), encoding="utf-8")
    (ko / "01_second.ipynb").write_text(notebook("01_second.ipynb", "01 · 둘째", figure=True, lang="ko"),
                                        encoding="utf-8")
    (ko / "README.md").write_text(KO_README.format(badge=ko_badge), encoding="utf-8")
    (ko / "GLOSSARY.md").write_text(KO_GLOSSARY, encoding="utf-8")
    (root / "notebooks" / "ja" / "00_first.ipynb").write_text(
        notebook("00_first.ipynb", "00 · 最初の一歩", lang="ja"), encoding="utf-8")
    (root / "notebooks" / "ja" / "po").mkdir()  # an edition's PO files are not pages
    return root


@pytest.fixture(scope="module")
def site(book, course, tmp_path_factory) -> Path:
    build, _ = book
    out = tmp_path_factory.mktemp("book")
    assert build.build(course, out) == 0
    return out / "site"


def broken_copy(site: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    return copy


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{old!r} not in {path.name}"
    path.write_text(text.replace(old, new), encoding="utf-8")


def build_error(build, course: Path, out: Path, capsys, page: str, old: str, new: str) -> str:
    """Stage the course, change one staged page (``ko/...``: an edition's), run Sphinx on its
    language: it must fail. Returns what it printed."""
    editions = {e.lang: e for e in build.stage(course, out / "src")}
    edit(out / "src" / page, old, new)
    lang = page.split("/")[0] if page.split("/")[0] in editions else "en"
    edition = editions[lang]
    capsys.readouterr()
    assert build.sphinx(edition.src, out, notebooks=edition.notebooks, lang=lang,
                        languages=out / "src" / "languages.json",
                        exclude=[e for e in editions if e != "en"] if lang == "en" else []) != 0
    return capsys.readouterr().err


def test_the_tiny_book_builds_and_passes_the_browser_check(book, course, site, tmp_path):
    _, check = book
    assert sorted(p.name for p in (site / "notebooks").glob("*.html")) == [
        "00_first.html", "01_second.html", "instructor-guide.html"]
    assert not (site / "notebooks" / "ko").exists()  # an edition is a book of its own, under ko/
    assert sorted(p.relative_to(site / "ko").as_posix() for p in (site / "ko").rglob("*.html")
                  if "_static" not in p.parts) == [
        "glossary.html", "index.html", "notebooks/00_first.html", "notebooks/01_second.html", "search.html"]
    assert sorted(p.relative_to(site / "ja").as_posix() for p in (site / "ja").rglob("*.html")
                  if "_static" not in p.parts) == ["index.html", "notebooks/00_first.html", "search.html"]
    stored = (course / "notebooks" / "01_second.ipynb").read_bytes()
    assert (site / "notebooks" / "01_second.ipynb").read_bytes() == stored  # the .ipynb as stored
    ko_stored = (course / "notebooks" / "ko" / "01_second.ipynb").read_bytes()
    assert ko_stored != stored and (site / "ko" / "notebooks" / "01_second.ipynb").read_bytes() == ko_stored
    for page, lang in [("index.html", "en"), ("ko/notebooks/00_first.html", "ko"), ("ja/index.html", "ja")]:
        assert re.search(r'<html lang="([^"]+)"', (site / page).read_text(encoding="utf-8")).group(1) == lang
    ko_page = (site / "ko" / "notebooks" / "00_first.html").read_text(encoding="utf-8")
    colab = set(re.findall(r'href="(https://colab\.research\.google\.com/github/[^"]+)"', ko_page))
    assert colab == {"https://colab.research.google.com/github/pytorch-data-parallel-course/course/blob/main/"
                     "notebooks/ko/00_first.ipynb"}  # the badge and the theme's launch button
    assert "노트북" in (site / "ko" / "index.html").read_text(encoding="utf-8")  # its own captions
    page = (site / "notebooks" / "01_second.html").read_text(encoding="utf-8")
    assert "https://colab.research.google.com/github/" in page and 'href="01_second.ipynb"' in page
    assert "colab.research.google.com/assets" not in page  # the badge is served from the site
    assert "2/2" in page and "1/2" not in page  # a redrawn progress bar shows its last state
    assert "References" in (site / "references.html").read_text(encoding="utf-8")
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
    assert not re.search(r"<(?:script|link)[^>]+(?:src|href)=\"https?://", page)  # nothing from a CDN
    shots = tmp_path / "shots"
    assert check.check(site, root=course, shots=shots, search="mean") == []
    assert (shots / "notebooks__01_second.phone.png").stat().st_size > 0
    assert (shots / "index.desktop.png").stat().st_size > 0
    # one translated page per edition: the one with the most CJK text (the Korean README; Japanese
    # has no README: the landing page that lists its notebooks by their translated titles)
    assert sorted(p.name for p in shots.glob("ko__*")) == ["ko__index.desktop.png", "ko__index.phone.png"]
    assert sorted(p.name for p in shots.glob("ja__*")) == ["ja__index.desktop.png", "ja__index.phone.png"]
    assert not list(shots.glob("ko__notebooks__*"))  # not every translated page: the check stays fast


def test_a_notebook_left_out_of_the_table_of_contents_fails_the_build(book, course, tmp_path, capsys):
    err = build_error(book[0], course, tmp_path, capsys, "index.md", "notebooks/01_second\n", "")
    assert "01_second.ipynb: WARNING: document isn't included in any toctree" in err


def test_a_notebook_missing_from_the_navigation_fails_the_check(book, course, site, tmp_path):
    _, check = book
    copy = broken_copy(site, tmp_path)
    index = copy / "index.html"
    text = index.read_text(encoding="utf-8")
    text, n = re.subn(r'<li class="toctree-l1"><a class="reference internal" href="notebooks/01_second.html">'
                      r".*?</li>", "", text, flags=re.S)
    assert n == 1
    index.write_text(text, encoding="utf-8")
    (copy / "notebooks" / "01_second.html").unlink()
    problems = check.check(copy, root=course, shots=None, search=None,
                           only=["index.html"])
    assert "index.html: the navigation does not list notebooks/01_second.html" in problems
    assert "notebooks/01_second.html: the notebook has no page in the site" in problems


def test_a_deleted_image_fails_the_check(book, course, site, tmp_path):
    _, check = book
    copy = broken_copy(site, tmp_path)
    figure = re.search(r'<img alt="[^"]*" src="(\.\./_images/[0-9a-f]+\.png)"',
                       (copy / "notebooks" / "01_second.html").read_text(encoding="utf-8")).group(1)
    (copy / "notebooks" / figure).unlink()
    problems = check.check(copy, root=course, shots=None, search=None,
                           only=["notebooks/01_second.html"])
    assert f"notebooks/01_second.html: image did not load at desktop width: {figure}" in problems
    assert any(p.startswith("notebooks/01_second.html: shows 1 outputs and 0 figures") for p in problems)


def test_a_missing_image_in_the_sources_fails_the_build(book, course, tmp_path, capsys):
    err = build_error(book[0], course, tmp_path, capsys, "references.md", "# References",
                      "# References\n\n![a figure](figures/missing.png)")
    assert "image file not readable: figures/missing.png" in err


def test_a_broken_link_fails_the_build_and_the_check(book, course, site, tmp_path, capsys):
    build, check = book
    err = build_error(build, course, tmp_path / "out", capsys, "index.md", "notebooks/01_second.ipynb",
                      "notebooks/02_gone.ipynb")
    assert "notebooks/02_gone.ipynb" in err

    copy = broken_copy(site, tmp_path)
    edit(copy / "references.html", 'href="index.html"', 'href="gone.html"')
    edit(copy / "notebooks" / "00_first.html", 'href="instructor-guide.html"',
         'href="instructor-guide.html#gone"')
    problems = check.check(copy, root=course, shots=None, search=None,
                           only=["references.html", "notebooks/00_first.html"])
    assert "references.html: link 'gone.html' leads nowhere (gone.html is not in the site)" in problems
    assert ("notebooks/00_first.html: link 'instructor-guide.html#gone': "
            "notebooks/instructor-guide.html has no anchor #gone") in problems


def test_a_notebook_page_without_its_outputs_fails_the_check(book, course, site, tmp_path):
    _, check = book
    copy = broken_copy(site, tmp_path)
    page = copy / "notebooks" / "00_first.html"
    text, n = re.subn(r'<div class="cell_output docutils container">.*?</pre></div>\s*</div>\s*</div>', "",
                      page.read_text(encoding="utf-8"), flags=re.S)
    assert n == 1
    page.write_text(text, encoding="utf-8")
    problems = check.check(copy, root=course, shots=None, search=None,
                           only=["notebooks/00_first.html"])
    assert "notebooks/00_first.html: shows 0 outputs and 0 figures; 00_first.ipynb stores 1 and 0" in problems


def test_errors_cdns_machine_paths_and_wide_pages_fail_the_check(book, course, site, tmp_path):
    _, check = book
    copy = broken_copy(site, tmp_path)
    edit(copy / "references.html", "</body>",
         '<script>console.error("boom")</script><script src="https://cdn.example.org/lib.js"></script></body>')
    edit(copy / "notebooks" / "00_first.html", "<h1>",
         '<div id="too-wide" style="width: 900px">too wide</div>'
         "<p>saved to /root/runs/x.pt in &lt;DURATION&gt;</p><h1>")
    problems = check.check(copy, root=course, shots=None, search=None,
                           only=["references.html", "notebooks/00_first.html"])
    assert "references.html: console error: boom" in problems
    assert ("references.html: fetches https://cdn.example.org/lib.js from outside the site "
            "(it must work offline)") in problems
    assert any(p.startswith("notebooks/00_first.html: wider than a 390 px phone screen")
               and "div#too-wide" in p for p in problems)
    assert ("notebooks/00_first.html: visible text shows '/root/runs' "
            "(a machine path or a sanitizer placeholder)") in problems
    assert any("'<DURATION>'" in p for p in problems)


@pytest.mark.parametrize("page", ["notebooks/00_first.ipynb", "index.md", "ko/notebooks/00_first.ipynb",
                                  "ko/index.md"])
def test_a_colab_badge_that_points_elsewhere_fails_the_build(book, course, tmp_path, page, capsys):
    err = build_error(book[0], course, tmp_path, capsys, page, "/blob/", "/blob/some-other-branch/")
    assert "Colab badge" in err


@pytest.mark.parametrize("page, old, new", [
    ("ko/notebooks/00_first.ipynb", "/notebooks/ko/", "/notebooks/"),  # the English notebook
    ("ko/notebooks/00_first.ipynb", "/notebooks/ko/", "/notebooks/ja/"),  # another edition's
    ("notebooks/00_first.ipynb", "/notebooks/", "/notebooks/ko/"),  # English page, Korean badge
    ("index.md", "/notebooks/00_first", "/notebooks/xx/00_first"),  # a folder that is no edition
])
def test_an_edition_badge_must_open_its_own_edition(book, course, tmp_path, page, old, new, capsys):
    err = build_error(book[0], course, tmp_path, capsys, page, old, new)
    assert "Colab badge" in err and "expected" in err


def test_the_editions_are_staged_from_disk(book, course, tmp_path):
    build, _ = book
    editions = build.stage(course, tmp_path / "src")
    assert [(e.lang, e.prefix) for e in editions] == [("en", ""), ("ko", "ko/"), ("ja", "ja/")]  # ko, ja, zh
    ko, ja = editions[1], editions[2]
    assert ko.notebook_docs == ["notebooks/00_first", "notebooks/01_second"]
    assert ko.docnames == ["index", "notebooks/00_first", "notebooks/01_second", "glossary"]
    assert ja.docnames == ["index", "notebooks/00_first"]  # no README, no glossary: neither is needed
    src = tmp_path / "src"
    assert not (src / "ja" / "po").exists() and not (src / "ja" / "glossary.md").exists()
    index = (src / "ko" / "index.md").read_text(encoding="utf-8")
    assert index.startswith("# 작은 강좌 (한국어판)")
    assert ":caption: 노트북\n\nnotebooks/00_first\nnotebooks/01_second\n" in index
    assert ":caption: 참고\n\nglossary\n" in index
    # links for the staged layout: the English README and guide (another book), its own pages
    assert "[English](book:index.html)" in index and "(book:notebooks/instructor-guide.html)" in index
    assert "[용어집](glossary.md)" in index and "[00 · 처음](notebooks/00_first.ipynb)" in index
    assert "[처음](notebooks/00_first.ipynb)" in (src / "ko" / "glossary.md").read_text(encoding="utf-8")
    # a link the translation copied from the English notebook resolves as the English one does
    staged = json.loads((src / "ko" / "notebooks" / "00_first.ipynb").read_text(encoding="utf-8"))
    assert "[the guide](book:notebooks/instructor-guide.html)" in staged["cells"][2]["source"]
    ja_index = (src / "ja" / "index.md").read_text(encoding="utf-8")
    assert "- [00 · 最初の一歩](notebooks/00_first.ipynb)" in ja_index
    assert ":caption: ノートブック" in ja_index
    table = json.loads((src / "languages.json").read_text(encoding="utf-8"))
    assert [(k, v["name"], v["html"]) for k, v in table.items()] == [
        ("en", "English", "en"), ("ko", "한국어", "ko"), ("ja", "日本語", "ja")]
    # the English sources are unchanged: no edition folder is read into them
    english = json.loads((src / "notebooks" / "00_first.ipynb").read_text(encoding="utf-8"))
    assert "[the guide](instructor-guide.md)" in english["cells"][2]["source"]


def test_a_missing_edition_page_fails_check_site(book, course, site, tmp_path):
    build, _ = book
    editions = build.stage(course, tmp_path / "src")
    assert build.check_site(site, editions) == []
    copy = broken_copy(site, tmp_path)
    (copy / "ko" / "glossary.html").unlink()
    (copy / "ja" / "notebooks" / "00_first.ipynb").unlink()
    assert build.check_site(copy, editions) == ["ko/glossary.html is missing from the site",
                                                "ja/notebooks/00_first.ipynb is missing from the site"]


SWITCHER = re.compile(r'<nav class="course-languages[^"]*"[^>]*>(.*?)</nav>', re.S)


def switcher_links(page: Path) -> list[tuple[str, str | None]]:
    """(language name, href or None for the current language) of a page's language switcher."""
    nav = SWITCHER.search(page.read_text(encoding="utf-8"))
    assert nav, f"{page} has no language switcher"
    return [(name, href or None) for href, name in
            re.findall(r'<(?:a [^>]*href="([^"]+)"|strong)[^>]*>([^<]+)</(?:a|strong)>', nav.group(1))]


def test_every_page_links_the_same_page_in_every_other_language(book, site):
    pages = sorted(p for p in site.rglob("*.html") if "_static" not in p.parts)
    assert len(pages) == 14  # en: 5 and search; ko: 4 and search; ja: 2 and search
    names = {"en": "English", "ko": "한국어", "ja": "日本語"}
    for page in pages:
        rel = page.relative_to(site)
        lang = rel.parts[0] if rel.parts[0] in ("ko", "ja") else "en"
        doc = rel.relative_to(lang) if lang != "en" else rel
        links = switcher_links(page)
        assert [name for name, _ in links] == list(names.values()), rel
        for (code, name), (_, href) in zip(names.items(), links, strict=True):
            if code == lang:
                assert href is None, f"{rel}: its own language is not a link"
                continue
            target = (page.parent / href).resolve()
            assert target.is_file(), f"{rel}: {name} links {href}, which is not in the site"
            home = site / ("" if code == "en" else code)
            same = home / doc  # the same page there, else that language's landing page
            assert target == (same if same.is_file() else home / "index.html"), (rel, href)
    assert dict(switcher_links(site / "notebooks" / "01_second.html")) == {
        "English": None, "한국어": "../ko/notebooks/01_second.html", "日本語": "../ja/index.html"}
    assert dict(switcher_links(site / "ko" / "glossary.html")) == {
        "English": "../index.html", "한국어": None, "日本語": "../ja/index.html"}
    assert dict(switcher_links(site / "references.html"))["한국어"] == "ko/index.html"
    assert dict(switcher_links(site / "ja" / "search.html"))["English"] == "../search.html"


def test_an_edition_page_with_another_editions_colab_link_fails_the_check(book, course, site, tmp_path):
    _, check = book
    copy = broken_copy(site, tmp_path)
    page = copy / "ko" / "notebooks" / "01_second.html"
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace("/notebooks/ko/01_second.ipynb", "/notebooks/01_second.ipynb"),
                    encoding="utf-8")
    index = copy / "ja" / "index.html"
    entry = r'<li class="toctree-l1"><a class="reference internal" href="notebooks/00_first.html">.*?</li>'
    index.write_text(re.sub(entry, "", index.read_text(encoding="utf-8"), flags=re.S), encoding="utf-8")
    problems = check.check(copy, root=course, shots=None, search=None,
                           only=["ko/notebooks/01_second.html", "ja/index.html"])
    assert ("ko/notebooks/01_second.html: a Colab link opens https://colab.research.google.com/github/"
            "pytorch-data-parallel-course/course/blob/main/notebooks/01_second.ipynb, not a notebook of "
            "notebooks/ko/") in problems
    assert "ja/index.html: the navigation does not list notebooks/00_first.html" in problems


def test_cjk_drawn_as_empty_boxes_fails_the_check(book, course, site, tmp_path, monkeypatch):
    """A browser that has only DejaVu (no CJK font, as on a bare machine) draws tofu: the check says
    which package to install. With the machine's fonts the same pages pass (the first test)."""
    _, check = book
    dejavu = Path("/usr/share/fonts/truetype/dejavu")
    if not dejavu.is_dir():
        pytest.skip("needs Debian's fonts-dejavu-core to stand for a machine without CJK fonts")
    conf = tmp_path / "fonts.conf"
    conf.write_text(f'<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "fonts.dtd">\n<fontconfig>'
                    f"<dir>{dejavu}</dir><cachedir>{tmp_path / 'cache'}</cachedir></fontconfig>\n")
    monkeypatch.setenv("FONTCONFIG_FILE", str(conf))
    problems = check.check(site, root=course, shots=None, search=None, only=["ko/index.html", "index.html"])
    tofu = [p for p in problems if "drawn as empty boxes" in p]
    assert [p.split(":")[0] for p in tofu] == ["index.html", "ko/index.html"]  # the switcher's names too
    assert all("install Debian's fonts-noto-cjk" in p for p in tofu)


def test_the_notebook_list_is_found_on_disk_in_course_order(book, tmp_path):
    build, _ = book
    for name in ("10_last.ipynb", "02_b.ipynb", "00_a.ipynb", "notes.ipynb", "ko/00_a.ipynb"):
        (tmp_path / "notebooks" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "notebooks" / name).write_text("{}")
    assert [p.name for p in build.course_notebooks(tmp_path)] == ["00_a.ipynb", "02_b.ipynb", "10_last.ipynb"]
    assert [p.name for p in build.course_notebooks()] == sorted(
        p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
