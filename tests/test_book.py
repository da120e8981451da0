"""The HTML book's build (book/build.py) and browser check (book/check.py) catch what they promise.

A tiny course (two notebooks with a figure and math, a translated edition in a subfolder, a README
with References, an instructor guide) is built with the book's real configuration, then broken on
purpose: a notebook left out of the table of contents, a missing image, a broken link, a page
without its outputs, a page that fetches from a CDN, a console error, a page too wide for a phone.

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


def notebook(name: str, title: str, *, figure: bool = False) -> str:
    from course_utils.nbtools import badge_markdown

    not_attempted = ("\u00b7 Exercise 00.1 (predict): not attempted yet. Replace the ... in the answer "
                     "cell with your prediction, run it, then run this check cell again to see it.\n")
    outputs = [{"output_type": "stream", "name": "stdout",
                "text": ["epochs:  50%|#   | 1/2\repochs: 100%|####| 2/2\n", not_attempted]}]
    if figure:
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(png()).decode(), "text/plain": ["<Figure>"]}})
    cells = [
        {"cell_type": "markdown", "metadata": {},
         "source": f"{badge_markdown(name)}\n\n# {title}\n\n"
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


@pytest.fixture(scope="module")
def course(book, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("course")
    (root / "notebooks" / "ko").mkdir(parents=True)
    from course_utils.nbtools import badge_markdown

    (root / "README.md").write_text(README.format(badge=badge_markdown("00_first.ipynb")), encoding="utf-8")
    (root / "notebooks" / "00_first.ipynb").write_text(notebook("00_first.ipynb", "00 · First"))
    (root / "notebooks" / "01_second.ipynb").write_text(
        notebook("01_second.ipynb", "01 · Second", figure=True))
    guide = "# Instructor guide\n\nBack to [00](00_first.ipynb).\n"
    (root / "notebooks" / "instructor-guide.md").write_text(guide)
    # A translated edition in a subfolder is not part of this book (and has no badge it could check).
    (root / "notebooks" / "ko" / "00_first.ipynb").write_text(notebook("00_first.ipynb", "00 · 처음"))
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
    """Stage the course, change one staged page, run Sphinx: it must fail. Returns what it printed."""
    build.stage(course, out / "src")
    edit(out / "src" / page, old, new)
    capsys.readouterr()
    assert build.sphinx(out / "src", out, notebooks=course / "notebooks") != 0
    return capsys.readouterr().err


def test_the_tiny_book_builds_and_passes_the_browser_check(book, course, site, tmp_path):
    _, check = book
    assert sorted(p.name for p in (site / "notebooks").glob("*.html")) == [
        "00_first.html", "01_second.html", "instructor-guide.html"]
    assert not (site / "notebooks" / "ko").exists()  # the subfolder edition is not read
    stored = (course / "notebooks" / "01_second.ipynb").read_bytes()
    assert (site / "notebooks" / "01_second.ipynb").read_bytes() == stored  # the .ipynb as stored
    page = (site / "notebooks" / "01_second.html").read_text(encoding="utf-8")
    assert "https://colab.research.google.com/github/" in page and 'href="01_second.ipynb"' in page
    assert "colab.research.google.com/assets" not in page  # the badge is served from the site
    assert "2/2" in page and "1/2" not in page  # a redrawn progress bar shows its last state
    assert "References" in (site / "references.html").read_text(encoding="utf-8")
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
    assert not re.search(r"<(?:script|link)[^>]+(?:src|href)=\"https?://", page)  # nothing from a CDN
    shots = tmp_path / "shots"
    assert check.check(site, root=course, shots=shots, search="idea") == []
    assert (shots / "notebooks__01_second.phone.png").stat().st_size > 0
    assert (shots / "index.desktop.png").stat().st_size > 0


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
    problems = check.check(copy, root=course, shots=None, search="idea")
    assert "index.html: the navigation does not list notebooks/01_second.html" in problems
    assert "notebooks/01_second.html: the notebook has no page in the site" in problems


def test_a_deleted_image_fails_the_check(book, course, site, tmp_path):
    _, check = book
    copy = broken_copy(site, tmp_path)
    figure = re.search(r'<img alt="[^"]*" src="(\.\./_images/[0-9a-f]+\.png)"',
                       (copy / "notebooks" / "01_second.html").read_text(encoding="utf-8")).group(1)
    (copy / "notebooks" / figure).unlink()
    problems = check.check(copy, root=course, shots=None, search="idea")
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
    problems = check.check(copy, root=course, shots=None, search="idea")
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
    problems = check.check(copy, root=course, shots=None, search="idea")
    assert "notebooks/00_first.html: shows 0 outputs and 0 figures; 00_first.ipynb stores 1 and 0" in problems


def test_errors_cdns_machine_paths_and_wide_pages_fail_the_check(book, course, site, tmp_path):
    _, check = book
    copy = broken_copy(site, tmp_path)
    edit(copy / "references.html", "</body>",
         '<script>console.error("boom")</script><script src="https://cdn.example.org/lib.js"></script></body>')
    edit(copy / "notebooks" / "00_first.html", "<h1>",
         '<div id="too-wide" style="width: 900px">too wide</div>'
         "<p>saved to /root/runs/x.pt in &lt;DURATION&gt;</p><h1>")
    problems = check.check(copy, root=course, shots=None, search="idea")
    assert "references.html: console error: boom" in problems
    assert ("references.html: fetches https://cdn.example.org/lib.js from outside the site "
            "(it must work offline)") in problems
    assert any(p.startswith("notebooks/00_first.html: wider than a 390 px phone screen")
               and "div#too-wide" in p for p in problems)
    assert ("notebooks/00_first.html: visible text shows '/root/runs' "
            "(a machine path or a sanitizer placeholder)") in problems
    assert any("'<DURATION>'" in p for p in problems)


@pytest.mark.parametrize("page", ["notebooks/00_first.ipynb", "index.md"])
def test_a_colab_badge_that_points_elsewhere_fails_the_build(book, course, tmp_path, page, capsys):
    err = build_error(book[0], course, tmp_path, capsys, page, "/blob/", "/blob/some-other-branch/")
    assert "Colab badge" in err


def test_the_notebook_list_is_found_on_disk_in_course_order(book, tmp_path):
    build, _ = book
    for name in ("10_last.ipynb", "02_b.ipynb", "00_a.ipynb", "notes.ipynb", "ko/00_a.ipynb"):
        (tmp_path / "notebooks" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "notebooks" / name).write_text("{}")
    assert [p.name for p in build.course_notebooks(tmp_path)] == ["00_a.ipynb", "02_b.ipynb", "10_last.ipynb"]
    assert [p.name for p in build.course_notebooks()] == sorted(
        p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
