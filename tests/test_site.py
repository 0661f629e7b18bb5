"""The course as a web book: build it (``docs/build_site.py``, what `make site` runs), serve it on
127.0.0.1 and read every page in headless Chromium, as a visitor would.

Every page: HTTP 200, no console error, no failed request, no request to any host but the local
server, every image decoded, every formula typeset by the site's own MathJax (no raw ``$...$``
left), every internal link's page and anchor found. Lessons come in order with previous/next links;
each notebook page links to Colab at the address ``attn_course/course.py`` gives and to its own
notebook, byte for byte the repository's. The offline search finds lesson 07 for "online softmax".
Solutions stay out. Screenshots of the landing page, lesson 07 and the API page at desktop and
phone widths go to ``artifacts/screenshots/site/`` (git-ignored) for people to look at.

Skips with a message when the site's tools (`make site-deps`), Chromium or Playwright are missing
locally; under CI (``CI`` set), that is a failure, since `make test` installs them.
"""

from __future__ import annotations

import functools
import html
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from _lab import ROOT, private_jupyter_env
from test_browser import CHROMIUM_FLAGS

from attn_course.course import LESSONS, REPO_SLUG, colab_url

ARTIFACTS = ROOT / "artifacts" / "screenshots" / "site"
LESSON_PAGES = [f"notebooks/{lesson.filename[:-6]}.html" for lesson in LESSONS]
EXERCISE_PAGES = [f"exercises/{p.stem}.html" for p in sorted((ROOT / "exercises").glob("*.ipynb"))]
HOST = "127.0.0.1"

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: `make test` installs it, so CI must have it")
    pytest.skip(f"{reason}; `make site-deps` installs the site's tools (see README)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A fresh build of the site, made the way `make site` makes it."""
    try:
        import myst_nb  # noqa: F401
        import sphinx  # noqa: F401
    except ImportError:
        _missing("Sphinx and MyST-NB (the `site` extra) are not installed")
    if not (ROOT / "docs" / "node_modules" / "mathjax").is_dir():
        _missing("MathJax (`npm ci --prefix docs`) is not installed")
    tmp = tmp_path_factory.mktemp("site")
    out = tmp / "site"
    result = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "build_site.py"), "--out", str(out), "--src", str(tmp / "src")],
        cwd=ROOT, env=private_jupyter_env(tmp), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"the site did not build:\n{result.stdout}\n{result.stderr}"
    # Sphinx colours its messages when it thinks it writes to a terminal (as in CI): read them plain.
    stderr = re.sub(r"\x1b\[[0-9;]*m", "", result.stderr)
    complaints = [line for line in stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert not complaints, "Sphinx complained:\n" + "\n".join(complaints)
    return out


@pytest.fixture(scope="module")
def server(site):
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer((HOST, 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://{HOST}:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("Python playwright is not installed")
    executable = shutil.which("chromium")
    if executable is None:
        _missing("Debian's chromium is not installed")
    profile = tmp_path_factory.mktemp("chromium-profile")
    home = tmp_path_factory.mktemp("chromium-home")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900}, env={**os.environ, "HOME": str(home)},
        )
        yield context
        context.close()


def _pages(site: Path) -> list[str]:
    return sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if "_static" not in p.parts)


# What the page reports once loaded and typeset: its ids, links, images and formulas.
INSPECT = """async () => {
  if (window.MathJax && MathJax.startup) { await MathJax.startup.promise; }
  await document.fonts.ready;
  const prose = document.querySelector('article').cloneNode(true);
  prose.querySelectorAll('pre, code, script, style, mjx-container, .highlight').forEach(e => e.remove());
  const math = [...document.querySelectorAll('article .math')];
  return {
    ids: [...document.querySelectorAll('[id]')].map(e => e.id),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
    images: [...document.images].map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0})),
    math: math.length,
    typeset: math.filter(e => e.querySelector('mjx-container')).length,
    mathjaxErrors: document.querySelectorAll('mjx-merror, [data-mjx-error]').length,
    prose: prose.textContent,
    next: document.querySelector('a.next-page')?.href ?? null,
    prev: document.querySelector('a.prev-page')?.href ?? null,
    colab: [...document.querySelectorAll('a.colab-link')].map(a => a.href),
    download: [...document.querySelectorAll('a.download-link')].map(a => a.href),
    setupHidden: [...document.querySelectorAll('details.hide')].filter(d => !d.open).length,
  };
}"""


@pytest.fixture(scope="module")
def visits(site, server, browser):
    """Open every page once; return what each showed and every problem seen on the way."""
    report, problems = {}, []
    page = browser.new_page()
    current = {"url": None}

    def off_host(route):
        host = urllib.parse.urlsplit(route.request.url).hostname
        if host != HOST:
            problems.append(f"{current['url']}: request off the loopback address: {route.request.url}")
            route.abort()
        else:
            route.continue_()

    page.route("**/*", off_host)
    page.on("console", lambda m: m.type == "error" and problems.append(f"{current['url']}: console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"{current['url']}: uncaught error: {e}"))
    pending = set()
    page.on("request", lambda r: pending.add(r.url))
    page.on("requestfinished", lambda r: pending.discard(r.url))

    def failed(request):
        pending.discard(request.url)
        problems.append(f"{current['url']}: failed request {request.url}: {request.failure}")

    page.on("requestfailed", failed)
    page.on("response", lambda r: r.status != 200 and problems.append(f"{current['url']}: HTTP {r.status} for {r.url}"))
    for rel in _pages(site):
        current["url"] = rel
        response = page.goto(server + rel, wait_until="load")
        assert response is not None and response.status == 200, f"{rel}: HTTP {response and response.status}"
        report[rel] = page.evaluate(INSPECT)
        # MathJax's fonts finish loading before the next page would cancel them.
        for _ in range(1200):
            if not pending:
                break
            page.wait_for_timeout(50)
        assert not pending, f"{rel}: requests still open after 60 s: {sorted(pending)}"
    page.close()
    return report, problems


def test_site_has_every_lesson_exercise_and_the_reference_and_no_solution(site):
    pages = set(_pages(site))
    for rel in ["index.html", "course-map.html", "api.html", "search.html", *LESSON_PAGES, *EXERCISE_PAGES]:
        assert rel in pages, f"the site has no page {rel}"
    assert len(EXERCISE_PAGES) == len(LESSONS) - 1
    assert not [p for p in site.rglob("*") if "solution" in p.name.lower()], "a solutions file is in the site"
    text = {rel: (site / rel).read_text() for rel in pages}
    # Lines that only the solutions hold never appear on an exercise page.
    block = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        exercise = (ROOT / "exercises" / path.name).read_text()
        code = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        secret = {
            line.strip() for b in block.findall(code) for line in b.splitlines()
            if len(line.strip()) >= 30 and json.dumps(line.strip())[1:-1] not in exercise
        }
        page = html.unescape(re.sub(r"<[^>]+>", "", text[f"exercises/{path.stem}.html"]))
        leaked = sorted(s for s in secret if s in page)
        assert not leaked, f"exercises/{path.stem}.html shows solution code: {leaked[:3]}"
    for rel, body in text.items():
        assert "BEGIN SOLUTION" not in body, f"{rel} shows a solution block"
        if rel in LESSON_PAGES or rel in EXERCISE_PAGES:
            assert not re.search(r"#\s*NBVAL_", html.unescape(re.sub(r"<[^>]+>", "", body))), f"{rel} shows an nbval marker line"
        assert "colab-badge.svg" not in body, f"{rel} loads the Colab badge from another host"


def test_every_page_loads_offline_without_errors(visits):
    report, problems = visits
    assert not problems, "\n".join(problems)
    broken = [f"{rel}: {img['src']}" for rel, r in report.items() for img in r["images"] if not img["ok"]]
    assert not broken, f"images not decoded: {broken}"
    assert sum(len(r["images"]) for r in report.values()) >= 30, "the stored figures are missing"


def test_math_is_typeset_by_the_sites_own_mathjax(visits):
    report, _ = visits
    with_math = [rel for rel, r in report.items() if r["math"]]
    assert len(with_math) >= 10, f"only {with_math} have formulas: MyST's dollarmath is off?"
    for rel, r in report.items():
        assert r["typeset"] == r["math"], f"{rel}: {r['math'] - r['typeset']} of {r['math']} formulas not typeset"
        assert r["mathjaxErrors"] == 0, f"{rel}: MathJax could not typeset a formula"
        raw = re.findall(r"\$[^$\s][^$\n]{0,80}\$|\\\(.{0,80}?\\\)|\\\[.{0,80}?\\\]", r["prose"])
        assert not raw, f"{rel}: raw LaTeX left in the text: {raw[:3]}"


def test_every_internal_link_finds_its_page_and_anchor(site, visits, server):
    report, _ = visits
    missing = []
    for rel, r in report.items():
        for href in r["links"]:
            if not href.startswith(server):
                continue
            url = urllib.parse.urlsplit(href)
            target = url.path.removeprefix(urllib.parse.urlsplit(server).path) or "index.html"
            target = urllib.parse.unquote(target)
            if target.endswith("/"):
                target += "index.html"
            if not (site / target).is_file():
                missing.append(f"{rel} -> {href} (no file)")
            elif url.fragment and target in report and urllib.parse.unquote(url.fragment) not in report[target]["ids"]:
                missing.append(f"{rel} -> {href} (no anchor)")
    assert not missing, "\n".join(missing)
    # The links the lessons make to each other by file name, anchors included, are links on the site.
    links = {h.removeprefix(server) for h in report["notebooks/07_chunked_attention.html"]["links"]}
    assert "notebooks/00_welcome.html#source-article" in links
    assert "exercises/07_chunked_attention.html" in links
    assert "source-article" in report["notebooks/00_welcome.html"]["ids"]


def test_lessons_come_in_order_with_previous_and_next(visits, server):
    report, _ = visits
    for i, rel in enumerate(LESSON_PAGES):
        r = report[rel]
        if i + 1 < len(LESSON_PAGES):
            assert r["next"] == server + LESSON_PAGES[i + 1], f"{rel}: next is {r['next']}"
        if i > 0:
            assert r["prev"] == server + LESSON_PAGES[i - 1], f"{rel}: previous is {r['prev']}"


def test_each_notebook_page_links_to_colab_and_to_its_notebook(site, visits, server):
    report, _ = visits
    assert REPO_SLUG in colab_url("notebooks", "00_welcome.ipynb")
    for rel in LESSON_PAGES + EXERCISE_PAGES:
        folder, name = rel.split("/")
        notebook = name.replace(".html", ".ipynb")
        r = report[rel]
        assert r["colab"] == [colab_url(folder, notebook)], f"{rel}: Colab link {r['colab']}"
        assert r["download"] == [server + f"{folder}/{notebook}"], f"{rel}: download link {r['download']}"
        assert (site / folder / notebook).read_bytes() == (ROOT / folder / notebook).read_bytes()
        assert r["setupHidden"] >= 1, f"{rel}: the setup cell is not collapsed"


def test_search_for_online_softmax_finds_lesson_07(browser, server, visits):
    page = browser.new_page()
    page.route("**/*", lambda route: route.continue_() if urllib.parse.urlsplit(route.request.url).hostname == HOST else route.abort())
    page.goto(server + "search.html?q=online+softmax")
    page.wait_for_selector("#search-results ul.search li", timeout=30_000)
    results = page.eval_on_selector_all("#search-results ul.search li a", "as => as.map(a => a.href)")
    page.close()
    assert any("notebooks/07_chunked_attention.html" in href for href in results), results


@pytest.mark.parametrize("width,height,name", [(1280, 900, "desktop"), (390, 844, "phone")])
def test_screenshots(browser, server, visits, width, height, name):
    """For people to look at (nothing is compared): the landing page, lesson 07 and the API page."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page()
    page.set_viewport_size({"width": width, "height": height})
    page.route("**/*", lambda route: route.continue_() if urllib.parse.urlsplit(route.request.url).hostname == HOST else route.abort())
    for rel, shot in [("index.html", "landing"), ("notebooks/07_chunked_attention.html", "lesson07"), ("api.html", "api")]:
        page.goto(server + rel, wait_until="load")
        page.evaluate("localStorage.clear()")  # the search test's highlighted terms
        page.reload(wait_until="load")
        page.evaluate("async () => { if (window.MathJax && MathJax.startup) await MathJax.startup.promise; }")
        width_px = page.evaluate("document.documentElement.scrollWidth")
        assert width_px <= width + 1, f"{rel} is {width_px} px wide at a {width} px viewport: it scrolls sideways"
        page.screenshot(path=str(ARTIFACTS / f"{shot}-{name}.png"))
    page.close()
