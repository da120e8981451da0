"""Sphinx extension of the course's book: what the theme and myst-nb do not do for this course.

- Each notebook page opens with its links: "Open in Colab" (the notebook's own badge, its address
  checked against the one built from ``course_utils.REPO`` and ``BRANCH``), the ``.ipynb`` (copied
  beside the page) and the notebook on GitHub. A notebook without its badge, or a badge (in a
  notebook or the README) that points elsewhere, is a warning, so the build fails.
- The Colab badge image is served from the site (``book/assets/colab-badge.svg``), not fetched.
- MathJax is served from the site (the pinned ``sphinx-mathjax-offline`` package's files), copied
  only when some page has math.
- The book has a site per language (book/build.py: English, then each translated edition under
  ``<lang>/``). An edition's notebook pages must carry their edition's badge
  (``notebooks/<lang>/<file>``) and get their .ipynb from ``notebooks/<lang>/``. Every page has a
  language switcher (``templates/layout.html``), written here, not in JavaScript: a link to the same
  page in each other language, or to that language's landing page where it has no such page.
  Edition pages say their language in ``<html lang>`` (``ko``, ``ja``, ``zh-Hans``).
- A link ``book:<path>.html`` (build.py writes them for links to another language's pages) becomes
  a link relative to the page.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform
from sphinx.util import logging

logger = logging.getLogger(__name__)

COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
LOCAL_BADGE = "/_assets/colab-badge.svg"  # staged by build.py; srcdir-relative
MATHJAX = "mathjax/tex-chtml.js"  # under _static
_COLAB_LINK = re.compile(r"https://colab\.research\.google\.com/github/.+/notebooks/((?:([^/]+)/)?[^/]+\.ipynb)")
ENGLISH = "en"
BOOK_SCHEME = "book:"


def colab_url(repo: str, branch: str, notebook: str) -> str:
    """Colab's address of ``notebooks/<notebook>`` at ``branch`` of GitHub's ``repo``
    (``notebook`` is ``00_x.ipynb``, or ``ko/00_x.ipynb`` for an edition's)."""
    return f"https://colab.research.google.com/github/{repo}/blob/{branch}/notebooks/{notebook}"


def edition_path(lang: str, name: str) -> str:
    """A notebook's path under notebooks/ in a language: ``00_x.ipynb`` or ``ko/00_x.ipynb``."""
    return name if lang == ENGLISH else f"{lang}/{name}"


def languages(config) -> dict:
    """build.py's table of the book's languages (name, html lang, prefix, pages); English alone
    when the book is built without one."""
    path = config.course_languages
    if path and Path(path).is_file():
        return json.loads(Path(path).read_text(encoding="utf-8"))
    return {ENGLISH: {"name": "English", "html": "en", "prefix": "", "pages": []}}


def switcher(table: dict, lang: str, pagename: str) -> list[dict]:
    """The language switcher of page ``pagename`` of language ``lang``: for every language, its
    name, the link (relative to the page) to the same page there, or to its landing page where it
    has none, and whether that link is the same page."""
    up = "../" * (pagename.count("/") + table[lang]["prefix"].count("/"))
    links = []
    for code, info in table.items():
        same = pagename in info["pages"] or pagename == "search"
        target = pagename if same else "index"
        links.append({"code": code, "name": info["name"], "hreflang": info["html"], "same": same,
                      "current": code == lang, "href": f"{up}{info['prefix']}{target}.html"})
    return links


def _is_course_notebook(env, docname: str) -> bool:
    return docname.startswith("notebooks/") and str(env.doc2path(docname)).endswith(".ipynb")


class LocalBadgeAndLinks(SphinxTransform):
    """Serve the Colab badge from the site; give every notebook page its Colab and .ipynb links."""

    default_priority = 400

    def apply(self, **kwargs) -> None:
        badges = [img for img in self.document.findall(nodes.image) if img["uri"] == COLAB_BADGE]
        for img in badges:
            img["uri"] = LOCAL_BADGE
            img["classes"].append("colab-badge")
        docname = self.env.docname
        config = self.config
        lang = config.course_language
        up = "../" * (docname.count("/") + (lang != ENGLISH))
        for ref in self.document.findall(nodes.reference):  # a link to another language's page
            if ref.get("refuri", "").startswith(BOOK_SCHEME):
                ref["refuri"] = up + ref["refuri"][len(BOOK_SCHEME):]
                ref["classes"] = [c for c in ref["classes"] if c != "external"] + ["internal"]
        links = [img.parent for img in badges if isinstance(img.parent, nodes.reference)]
        if not _is_course_notebook(self.env, docname):  # the README's table: each badge's address
            known = set(languages(config)) - {ENGLISH}
            for link in links:
                found = _COLAB_LINK.fullmatch(link.get("refuri", ""))
                if found and found.group(2) is not None and found.group(2) not in known:
                    found = None  # notebooks/<folder>/x.ipynb, where <folder> is no edition
                want = found and colab_url(config.course_repo, config.course_branch, found.group(1))
                if not found or link["refuri"] != want:
                    logger.warning("a Colab badge points to %s, expected %s (course_utils.REPO and BRANCH)",
                                   link.get("refuri"), want or "a notebook's address",
                                   location=link, type="course_book", subtype="badge")
            return
        name = Path(docname).name + ".ipynb"
        path = edition_path(lang, name)  # notebooks/<path> in the repository
        want = colab_url(config.course_repo, config.course_branch, path)
        if not links:
            logger.warning("notebook %s has no 'Open in Colab' badge (run nbtools sync)", name,
                           location=docname, type="course_book", subtype="badge")
            return
        badge = links[0]
        if badge.get("refuri") != want:
            logger.warning("the Colab badge of %s points to %s, expected %s (from course_utils.REPO "
                           "and BRANCH; run nbtools sync)", name, badge.get("refuri"), want,
                           location=docname, type="course_book", subtype="badge")
        badge["refuri"] = want
        github = f"https://github.com/{config.course_repo}/blob/{config.course_branch}/notebooks/{path}"
        extra = [
            nodes.Text(" "),
            nodes.reference("", "Download the notebook (.ipynb)", refuri=name,
                            classes=["course-link", "course-ipynb"]),
            nodes.Text(" "),
            nodes.reference("", "View it on GitHub", refuri=github, classes=["course-link"]),
        ]
        parent = badge.parent
        parent.insert(parent.index(badge) + 1, extra)
        parent["classes"].append("course-links")


def copy_site_files(app: Sphinx, exception: Exception | None) -> None:
    """After a good build: each notebook's .ipynb beside its page; MathJax where math is used."""
    if exception is not None or app.builder.name != "html":
        return
    out = Path(app.outdir)
    for docname in sorted(app.env.found_docs):
        if _is_course_notebook(app.env, docname):
            original = Path(app.config.course_notebook_sources) / (Path(docname).name + ".ipynb")
            shutil.copyfile(original, out / (docname + ".ipynb"))
    if getattr(app, "course_math_pages", None):
        import importlib

        package = Path(importlib.import_module("sphinx-mathjax-offline").__file__).parent
        shutil.copytree(package / "static" / "mathjax", out / "_static" / "mathjax", dirs_exist_ok=True)


def note_math(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Remember the pages with math (Sphinx adds MathJax's script to those alone)."""
    if doctree is not None and any(doctree.findall(lambda n: isinstance(n, (nodes.math, nodes.math_block)))):
        app.course_math_pages = {*getattr(app, "course_math_pages", ()), pagename}


def language_links(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """The page's language switcher (templates/layout.html) and its <html lang>."""
    table = languages(app.config)
    lang = app.config.course_language
    if lang not in table:
        return
    context["course_languages"] = switcher(table, lang, pagename) if len(table) > 1 else []
    context["language"] = table[lang]["html"]
    if lang != ENGLISH and pagename.startswith("notebooks/"):  # the theme's Colab button: this edition's
        want = colab_url(app.config.course_repo, app.config.course_branch,
                         edition_path(lang, Path(pagename).name + ".ipynb"))
        groups = context.get("header_buttons", [])
        for button in [b for g in groups for b in g.get("buttons", [g])]:
            if str(button.get("url", "")).startswith("https://colab.research.google.com/"):
                button["url"] = want


def name_the_edition(app: Sphinx, config) -> None:
    """An edition's title says its language: "... (한국어)"."""
    table = languages(config)
    if config.course_language != ENGLISH and config.course_language in table:
        config.html_title = f"{config.html_title} ({table[config.course_language]['name']})"


def setup(app: Sphinx) -> dict:
    app.add_config_value("course_repo", "", "env")
    app.add_config_value("course_branch", "main", "env")
    app.add_config_value("course_notebook_sources", "", "env")
    app.add_config_value("course_language", ENGLISH, "env")  # en, ko, ja, zh (build.py)
    app.add_config_value("course_languages", "", "env")  # build.py's languages.json
    app.connect("config-inited", name_the_edition)
    app.connect("html-page-context", language_links, priority=600)  # after the theme's buttons (501)
    app.config.mathjax_path = MATHJAX
    app.add_transform(LocalBadgeAndLinks)
    app.connect("html-page-context", note_math)
    app.connect("build-finished", copy_site_files)
    return {"parallel_read_safe": True, "parallel_write_safe": False, "version": "1"}
