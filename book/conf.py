"""Sphinx configuration of the course's HTML book (``make book``; see book/build.py).

Sphinx reads a staged copy of the sources (``_book/src``, written by build.py): the README as the
landing page, the References section as its own page, notebooks NN_*.ipynb with their stored
outputs (never executed), and the instructor guide; and, one Sphinx run each, the translated
editions (build.py sets language, course_language and the edition's notebooks folder).
Everything a page needs is served from the site itself: no CDN, MathJax included.
"""

import sys
from pathlib import Path

BOOK = Path(__file__).resolve().parent
ROOT = BOOK.parent
sys.path[:0] = [str(BOOK), str(ROOT)]

from course_utils import BRANCH, REPO  # noqa: E402  (cheap: no torch)

project = "PyTorch data parallelism, runnable anywhere"
author = "the course's authors"
copyright = ""  # nothing dated, so builds compare equal
root_doc = "index"

extensions = [
    "myst_nb",  # notebooks (stored outputs) and MyST markdown
    "sphinx.ext.mathjax",
    "sphinx.ext.githubpages",  # .nojekyll, so GitHub Pages serves the _static folders
    "course_book",  # book/course_book.py: Colab links, local badge, local MathJax, checks
]

# Notebooks are shown with the outputs nbval checks; the book never runs one.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
# book:<page>.html links another language's page (build.py writes them; course_book resolves them).
myst_url_schemes = ["http", "https", "mailto", "ftp", "book"]
# Every warning fails the build (build.py runs Sphinx with -W), but one: the exercises are level-4
# headings straight under a level-2 section on purpose (small, and out of the page's contents).
suppress_warnings = ["myst.header"]

html_theme = "sphinx_book_theme"
html_title = project
templates_path = ["templates"]  # layout.html: the language switcher (course_book)
html_static_path = ["static"]
html_css_files = ["course-book.css"]
html_js_files = ["course-book.js"]
html_last_updated_fmt = None
html_show_sphinx = False
html_use_index = False  # no index entries: an empty page
html_copy_source = False  # each notebook's .ipynb is copied beside its page instead (course_book)
# Unset, the theme's script logs an error in the console on a reader's first visit.
html_context = {"default_mode": "light"}
html_theme_options = {
    "repository_url": f"https://github.com/{REPO}",
    "repository_branch": BRANCH,
    "path_to_docs": "",  # the staged tree mirrors the repository: notebooks/NN_x.ipynb
    "use_repository_button": True,
    "launch_buttons": {"colab_url": "https://colab.research.google.com"},
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "use_download_button": False,  # each notebook page links its .ipynb itself (course_book)
}

# course_book's settings: the one address of the course (course_utils.REPO and BRANCH).
course_repo = REPO
course_branch = BRANCH
