"""Check the built book in a real browser: ``make book-check`` (``python book/check.py``).

Debian's Chromium, driven by Playwright (its own browser download is never used), opens every page
of ``_book/site`` from a server on 127.0.0.1, at a desktop and at a phone width (390 px), and
fails on:

- a JavaScript error or an error in the console, or a request that failed or left this machine
  (the site must work offline: no CDN);
- an image that did not load (``naturalWidth == 0``), or math that MathJax did not typeset;
- an internal link to a page or file that is not there, or to an anchor that the page lacks;
- a notebook page that shows fewer outputs or figures than its notebook stores, or a notebook of
  ``notebooks/[0-9][0-9]_*.ipynb`` that has no page or is missing from the navigation;
- at the phone width, something outside a box that scrolls on its own (code, outputs, tables)
  that reaches past the screen's edge;
- visible text that shows a path of the machine that made the outputs or a placeholder of the
  nbval sanitizer (``<DURATION>``...);
- a search for a word of the course that finds nothing (in each language's own search);
- on a translated edition's page (``<lang>/...``, one book per language: build.py), a Colab link
  that does not open that edition's notebook (``notebooks/<lang>/``);
- Korean, Japanese or Chinese drawn as empty boxes ("tofu": no font on the machine has those
  glyphs). On every page, the page's own CJK characters (its translated text, else the language
  switcher's names) are drawn on a canvas in the font the page computes for them, one by one, and
  compared with a character that no font has (U+10FFFD, private use): a character drawn exactly
  like it, or not at all, has no glyph. The fix is Debian's ``fonts-noto-cjk``
  (``make book-browser`` installs it).

It saves a screenshot of every English page at both widths in ``_book/shots`` (git-ignored) for a
person, and of one translated page per language: the edition's page with the most CJK text.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build import ENGLISH, OUT, ROOT, edition_languages, edition_notebooks  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
# Chromium on a machine whose only network is a package registry: no first-run, sync, component
# or background requests (the probe's flags in the machine notes).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
SEARCH_WORD = "DistributedSampler"
FONT_PACKAGE = "fonts-noto-cjk"
# Hangul (jamo, compatibility jamo, syllables), kana, CJK ideographs (extension A, unified, compatibility).
CJK_RANGES = r"\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
CJK = re.compile(f"[{CJK_RANGES}]")

# What must never be visible: a path of the machine that ran the notebooks, an ipykernel file,
# or a placeholder of tests/nbval_sanitize.cfg (they belong to nbval's comparison, not to a page).
MACHINE_TEXT = re.compile(r"(?<![\w.])/(?:root|home|Users|work|tmp|var/folders|private/var)/[\w.-]+"
                          r"|site-packages|ipykernel_\d+|<(?:ADDRESS|ELAPSED|DURATION|PID|PORT|TMPPATH)>")


class _Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs) -> None:
        for name, value in attrs:
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value or "")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(parser.ids)


def stored_outputs(notebook: Path) -> tuple[int, int]:
    """(cells with an output, image outputs) stored in a notebook."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    cells = [c for c in nb["cells"] if c.get("cell_type") == "code" and c.get("outputs")]
    images = sum(1 for c in cells for o in c["outputs"]
                 if any(kind.startswith("image/") for kind in o.get("data", {})))
    return len(cells), images


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:
            pass  # the browser closed a connection it no longer needed (its favicon.ico, say)

    server = Server(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def site_file(site: Path, base: str, url: str) -> Path | None:
    """The file of the site that a same-origin URL names (None for another origin)."""
    parts = urlsplit(url)
    if not url.startswith(base):
        return None
    path = site / unquote(parts.path[len(urlsplit(base).path):])
    return path / "index.html" if parts.path.endswith("/") else path


def link_problems(site: Path, base: str, page_url: str, hrefs: list[str]) -> list[str]:
    problems = []
    for href in sorted(set(hrefs)):
        url = urljoin(page_url, href)
        target = site_file(site, base, url)
        if target is None or href.startswith(("mailto:", "javascript:")):
            continue
        if not target.is_file():
            problems.append(f"link {href!r} leads nowhere ({target.relative_to(site)} is not in the site)")
            continue
        fragment = unquote(urlsplit(url).fragment)
        if fragment and target.suffix == ".html" and fragment not in anchors(target):
            problems.append(f"link {href!r}: {target.relative_to(site)} has no anchor #{fragment}")
    return problems


# Run in the page: images that did not load, links, outputs, and what reaches past the screen.
PAGE_FACTS = r"""async (CJK_RANGES) => {
  const imgs = Array.from(document.images);
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.complete ? null :
      new Promise(done => { i.addEventListener("load", done); i.addEventListener("error", done); })));
  const shown = el => el.checkVisibility({visibilityProperty: true, opacityProperty: false});
  // Boxes that may be wider than the screen because they scroll on their own.
  const box = "pre, div.highlight, div.cell_output, div.output, .pst-scrollable-table-container, " +
              ".table-wrapper, table, mjx-container, .math";
  const scrollsAlone = el => {
    for (let e = el.closest(box); e; e = e.parentElement && e.parentElement.closest(box)) {
      const x = getComputedStyle(e).overflowX;
      if (x === "auto" || x === "scroll") return true;
    }
    return false;
  };
  const describe = el => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") +
      (typeof el.className === "string" && el.className.trim() ?
       "." + el.className.trim().split(/\s+/).join(".") : "");
  const past = r => r.width > 0 && r.height > 0 && (r.right > window.innerWidth + 1 || r.left < -1);
  const wide = [];
  for (const el of document.body.querySelectorAll("*")) {
    if (shown(el) && !scrollsAlone(el) && past(el.getBoundingClientRect()))
      wide.push(`${describe(el)} (${Math.round(el.getBoundingClientRect().left)}..` +
                `${Math.round(el.getBoundingClientRect().right)} px)`);
  }
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let t = walker.nextNode(); t; t = walker.nextNode()) {
    const el = t.parentElement;
    if (!t.textContent.trim() || !el || !shown(el) || scrollsAlone(el)) continue;
    const range = document.createRange();
    range.selectNodeContents(t);
    if (past(range.getBoundingClientRect()))
      wide.push(`text "${t.textContent.trim().slice(0, 60)}" in ${describe(el)}`);
  }
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  const outputs = Array.from(document.querySelectorAll("div.cell_output"));
  // CJK glyphs: the page's own CJK characters (the article's first, else any shown text, such as the
  // language switcher's names) drawn one by one in the font the page computes for them, against a
  // character no font has (U+10FFFD): drawn like it, or blank, means no glyph (an empty box).
  const cjk = new RegExp("[" + CJK_RANGES + "]", "gu");
  const glyphs = {chars: "", missing: "", font: ""};
  const article = document.querySelector("article.bd-article");
  for (const scope of [article, document.body]) {
    if (!scope || glyphs.chars) continue;
    const texts = document.createTreeWalker(scope, NodeFilter.SHOW_TEXT);
    const seen = new Set();
    let holder = null;
    for (let t = texts.nextNode(); t && seen.size < 48; t = texts.nextNode()) {
      const found = t.textContent.match(cjk);
      if (!found || !t.parentElement || !shown(t.parentElement)) continue;
      holder = holder || t.parentElement;
      found.forEach(c => seen.add(c));
    }
    if (!holder) continue;
    const style = getComputedStyle(holder);
    glyphs.font = `${style.fontStyle} ${style.fontWeight} 32px ${style.fontFamily}`;
    glyphs.chars = Array.from(seen).join("");
  }
  if (glyphs.chars) {
    const canvas = document.createElement("canvas");
    canvas.width = canvas.height = 48;
    const ctx = canvas.getContext("2d", {willReadFrequently: true});
    ctx.font = glyphs.font;
    const draw = ch => {
      ctx.clearRect(0, 0, 48, 48);
      ctx.fillText(ch, 4, 38);
      const px = ctx.getImageData(0, 0, 48, 48).data;
      return {ink: px.some((v, i) => i % 4 === 3 && v > 0), image: px.join(",")};
    };
    const none = draw("\u{10FFFD}");
    glyphs.missing = Array.from(glyphs.chars).filter(c => {
      const d = draw(c);
      return !d.ink || d.image === none.image;
    }).join("");
  }
  return {
    glyphs: glyphs,
    colab: Array.from(document.querySelectorAll("a[href^='https://colab.research.google.com/github/']"))
        .map(a => a.getAttribute("href")),
    broken: imgs.filter(i => shown(i) && i.naturalWidth === 0).map(i => i.getAttribute("src")),
    hrefs: Array.from(document.querySelectorAll("a[href]")).map(a => a.getAttribute("href")),
    outputs: outputs.filter(o => o.textContent.trim() || o.querySelector("img")).length,
    figures: outputs.reduce((n, o) => n + Array.from(o.querySelectorAll("img"))
        .filter(i => i.naturalWidth > 0).length, 0),
    nav: Array.from(document.querySelectorAll(".bd-sidebar-primary nav a[href]"))
        .map(a => a.getAttribute("href")),
    math: document.querySelectorAll("span.math, div.math").length,
    typeset: document.querySelectorAll("span.math mjx-container, div.math mjx-container").length,
    pageWidth: document.documentElement.scrollWidth,
    wide: wide,
    text: document.body.innerText,
  };
}"""


def _name(path: Path) -> str:
    return path.with_suffix("").as_posix().replace("/", "__")


def check(site: Path = OUT / "site", *, root: Path = ROOT, shots: Path | None = OUT / "shots",
          search: str | None = SEARCH_WORD, chromium: str = CHROMIUM,
          only: list[str] | None = None) -> list[str]:
    """Every problem found on every page, as 'page: problem' lines (none: the book is good).

    ``only`` opens those pages alone (the tests); ``search=None`` skips the searches.
    """
    from playwright.sync_api import sync_playwright

    site = site.resolve()
    pages = sorted(p.relative_to(site) for p in site.rglob("*.html") if "_static" not in p.parts)
    langs = [ENGLISH, *edition_languages(root)]
    notebooks = {Path(prefix(lang)) / "notebooks" / (nb.stem + ".html"): nb
                 for lang in langs for nb in edition_notebooks(root, lang)}
    problems = [f"{page}: the notebook has no page in the site" for page in notebooks if page not in pages]
    problems += [f"{prefix(lang)}index.html: the {lang} edition has no landing page in the site"
                 for lang in langs if Path(prefix(lang)) / "index.html" not in pages]
    shown = set(pages) if shots is None else {p for p in pages if language_of(p, langs) == ENGLISH}
    shown |= {most_cjk(site, [p for p in pages if language_of(p, langs) == lang]) for lang in langs[1:]}
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
        for old in shots.glob("*.png"):
            old.unlink()
    server, base = serve(site)
    try:
        with sync_playwright() as pw:
            # Playwright gives the browser a new, empty profile (--user-data-dir) of its own.
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
            try:
                for page_path in [p for p in pages if only is None or p.as_posix() in only]:
                    problems += [f"{page_path}: {p}" for p in _check_page(
                        browser, site, base, page_path, notebooks.get(page_path),
                        shots if page_path in shown else None, root, language_of(page_path, langs))]
                for lang in langs if search else []:
                    problems += _check_search(browser, base, search, prefix(lang))
            finally:
                browser.close()
    finally:
        server.shutdown()
    return problems


def prefix(lang: str) -> str:
    """Where a language's pages are in the site: '' for English, 'ko/' for Korean."""
    return "" if lang == ENGLISH else f"{lang}/"


def language_of(page: Path, langs: list[str]) -> str:
    return page.parts[0] if len(page.parts) > 1 and page.parts[0] in langs else ENGLISH


def most_cjk(site: Path, pages: list[Path]) -> Path | None:
    """The page with the most Korean, Japanese or Chinese text in its article (its translation)."""
    def count(page: Path) -> int:
        text = (site / page).read_text(encoding="utf-8")
        start = text.find('<article class="bd-article"')
        return len(CJK.findall(text[start:])) if start >= 0 else 0
    return max(pages, key=lambda p: (count(p), p.name == "index.html"), default=None)


def _network_quiet(page, timeout_ms: int = 20_000) -> None:
    """Wait until the page has had no request in flight for a moment (Playwright's "networkidle");
    past ``timeout_ms`` go on: a request that then fails is reported by the page's handlers."""
    try:
        page.wait_for_load_state("networkidle", timeout=timeout_ms)
    except Exception as err:  # playwright's TimeoutError; the check goes on and reports what failed
        if "Timeout" not in type(err).__name__:
            raise


def _check_page(browser, site: Path, base: str, page_path: Path, notebook: Path | None,
                shots: Path | None, root: Path, lang: str = ENGLISH) -> list[str]:
    problems: list[str] = []
    url = urljoin(base, page_path.as_posix())
    page = browser.new_page(viewport=DESKTOP, service_workers="block")  # a first visit: no storage
    page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"JavaScript error: {e}"))
    page.on("requestfailed", lambda r: r.url.startswith(base) and problems.append(
        f"request failed: {r.url[len(base):]} ({r.failure})"))
    page.on("response", lambda r: r.url.startswith(base) and r.status >= 400 and problems.append(
        f"{r.status} for {r.url[len(base):]}"))

    def offline_only(route) -> None:
        if route.request.url.startswith(base) or route.request.url.startswith("data:"):
            route.continue_()
        else:
            problems.append(f"fetches {route.request.url} from outside the site (it must work offline)")
            route.abort()

    page.route("**/*", offline_only)
    try:
        for label, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
            page.set_viewport_size(viewport)
            page.goto(url, wait_until="load")
            # MathJax fetches its fonts after "load"; moving on while one is in flight aborts it
            # (net::ERR_ABORTED), which read as a failed request on a busy machine: wait for quiet
            _network_quiet(page)
            facts = page.evaluate(PAGE_FACTS, CJK_RANGES)
            if facts["typeset"] < facts["math"]:
                problems.append(f"math not typeset at {label} width: {facts['typeset']} of {facts['math']}")
            for src in facts["broken"]:
                problems.append(f"image did not load at {label} width: {src}")
            if label == "phone" and (facts["wide"] or facts["pageWidth"] > PHONE["width"] + 1):
                problems.append(f"wider than a {PHONE['width']} px phone screen (page {facts['pageWidth']} "
                                "px), outside any box that scrolls: " + "; ".join(facts["wide"][:5]))
            if shots is not None:
                page.screenshot(path=str(shots / f"{_name(page_path)}.{label}.png"), full_page=True)
        problems += link_problems(site, base, url, facts["hrefs"])
        for match in sorted(set(MACHINE_TEXT.findall(facts["text"]))):
            problems.append(f"visible text shows {match!r} (a machine path or a sanitizer placeholder)")
        if page_path == Path(prefix(lang)) / "index.html":
            problems += _check_nav(facts["nav"], root, lang)
        glyphs = facts["glyphs"]
        if glyphs["missing"]:
            problems.append(f"{len(glyphs['missing'])} of {len(glyphs['chars'])} Korean, Japanese or "
                            f"Chinese characters are drawn as empty boxes, no font has them "
                            f"({glyphs['missing'][:12]} in {glyphs['font']}): install Debian's "
                            f"{FONT_PACKAGE} (make book-browser does, as root)")
        if lang != ENGLISH:
            problems += [f"a Colab link opens {href}, not a notebook of notebooks/{lang}/"
                         for href in sorted(set(facts["colab"])) if f"/notebooks/{lang}/" not in href]
        if notebook is not None:
            cells, images = stored_outputs(notebook)
            if facts["outputs"] < cells or facts["figures"] < images:
                problems.append(f"shows {facts['outputs']} outputs and {facts['figures']} figures; "
                                f"{notebook.name} stores {cells} and {images}")
    finally:
        page.context.close()
    return problems


def _check_nav(nav: list[str], root: Path, lang: str = ENGLISH) -> list[str]:
    """The landing page's navigation lists every notebook of its language on disk, in course order."""
    want = [f"notebooks/{nb.stem}.html" for nb in edition_notebooks(root, lang)]
    listed = [href for href in nav if href in want]
    missing = [href for href in want if href not in listed]
    problems = [f"the navigation does not list {href}" for href in missing]
    if not missing and listed != want:
        problems.append(f"the navigation lists the notebooks out of course order: {listed}")
    return problems


def _check_search(browser, base: str, word: str, where: str = "") -> list[str]:
    page = browser.new_page()
    try:
        page.goto(urljoin(base, f"{where}search.html?q={word}"), wait_until="load")
        try:
            page.wait_for_selector("#search-results li", timeout=15_000)
        except Exception:
            return [f"{where}search.html: searching for {word!r} finds nothing"]
        return []
    finally:
        page.context.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=OUT / "site")
    parser.add_argument("--shots", type=Path, default=OUT / "shots", help="where the screenshots go")
    parser.add_argument("--no-shots", action="store_true", help="take no screenshots (faster)")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"book-check: no book at {args.site}: run `make book` first", file=sys.stderr)
        return 2
    if not Path(CHROMIUM).exists():
        print(f"book-check: {CHROMIUM} is missing: install Debian's chromium (make book-check does)",
              file=sys.stderr)
        return 2
    start = time.perf_counter()
    shots = None if args.no_shots else args.shots
    problems = check(args.site, shots=shots)
    for problem in problems:
        print(f"book-check: {problem}", file=sys.stderr)
    pages = len([p for p in args.site.rglob("*.html") if "_static" not in p.parts])
    verdict = f"{len(problems)} problem(s)" if problems else "no problems"
    saved = f"; screenshots in {shots}" if shots else ""
    langs = ", ".join([ENGLISH, *edition_languages(ROOT)])
    print(f"book-check: {pages} pages ({langs}) at {DESKTOP['width']} and {PHONE['width']} px, {verdict} "
          f"({time.perf_counter() - start:.0f} s){saved}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
