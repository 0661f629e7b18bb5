"""End to end, as a learner: JupyterLab in headless Chromium runs each lesson that has a widget.

For every lesson that uses ``attn_course.widgets``: open it in JupyterLab (started with the
README's `make lab`), Run All, wait for the kernel to finish, then for each widget move a
control (slider or dropdown) and assert the figure it draws changes. Uncaught JavaScript errors
fail the test. Screenshots go to ``artifacts/screenshots/`` (git-ignored) for people to look at.

Skips with a message when Chromium or Playwright is missing locally; under CI (``CI`` set),
a missing browser is a failure, since `.ci/run` installs it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from _lab import ROOT, running_lab

ARTIFACTS = ROOT / "artifacts" / "screenshots"
WIDGET_LESSONS = sorted(
    p.name for p in (ROOT / "notebooks").glob("*.ipynb") if "ac.widgets." in p.read_text() or "attn_course.widgets" in p.read_text()
)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: .ci/run installs it, so CI must have it")
    pytest.skip(f"{reason}; install it to run the browser tests (see .ci/run)")


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
    home = tmp_path_factory.mktemp("chromium-home")  # Chromium's ~/.pki, ~/.cache land here
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000}, env={**os.environ, "HOME": str(home)},
        )
        yield context
        context.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not (ROOT / ".venv" / ".installed").exists():
        _missing("the README's set-up (.venv) has not run")
    with running_lab(tmp_path_factory.mktemp("lab")) as server:
        yield server


# Where JupyterLab, IPython, matplotlib and Chromium would write in a home directory.
HOME_PLACES = (
    ".jupyter", ".local/share/jupyter", ".ipython", ".config/matplotlib", ".cache/matplotlib",
    ".config/chromium", ".cache/chromium", ".pki",
)


def _home_signature() -> dict[str, tuple[int, int]]:
    """For each place under HOME that exists: (number of files, newest mtime in ns)."""
    signature = {}
    for place in HOME_PLACES:
        root = Path.home() / place
        if root.exists():
            stats = [p.lstat() for p in [root, *root.rglob("*")]]
            signature[place] = (len(stats), max(s.st_mtime_ns for s in stats))
    return signature


@pytest.fixture(scope="module", autouse=True)
def home_untouched():
    """The browser tests must leave the home directory as they found it."""
    before = _home_signature()
    yield
    after = _home_signature()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"the browser tests wrote into the home directory: {[str(Path.home() / c) for c in changed]}"


def test_some_lessons_have_widgets():
    assert WIDGET_LESSONS, "no lesson uses attn_course.widgets: the browser test would cover nothing"


def _wait_idle(page, timeout_s: float) -> None:
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout_s * 1000)


def _dismiss_dialogs(page) -> None:
    """Accept the kernel picker if JupyterLab shows one; decline the news pop-up."""
    select = page.locator(".jp-Dialog button.jp-mod-accept")
    if select.count():
        select.first.click()
    no_news = page.locator(".jp-toast-button:has-text('No')")
    if no_news.count():
        no_news.first.click()


def _kernel_busy(lab) -> bool:
    return any(k.get("execution_state") != "idle" for k in lab.get_json("api/kernels"))


def _run_all(page, lab, timeout_s: float) -> None:
    page.click("text=Run", timeout=30_000)
    page.click("li.lm-Menu-item[data-command='runmenu:run-all']", timeout=10_000)
    # The kernel flips to idle for a moment between queued cells: the run is over only when it
    # has stayed idle for a few seconds.
    deadline, idle_since = time.time() + timeout_s, None
    time.sleep(1.0)
    while time.time() < deadline:
        ui_idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0
        if _kernel_busy(lab) or not ui_idle:
            idle_since = None
        elif idle_since is None:
            idle_since = time.time()
        elif time.time() - idle_since > 4.0:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"Run All did not finish within {timeout_s:g} s")
    _wait_idle(page, 30)


def _wait_until_stable(widget, quiet_s: float = 1.5, timeout_s: float = 30) -> None:
    """Wait until the figure stops changing (each key press queues a redraw)."""
    deadline, last, since = time.time() + timeout_s, _widget_image(widget), time.time()
    while time.time() < deadline and time.time() - since < quiet_s:
        time.sleep(0.3)
        current = _widget_image(widget)
        if current != last:
            last, since = current, time.time()


def _widget_image(widget) -> str:
    images = widget.locator("img")
    return images.first.get_attribute("src") if images.count() else ""


@pytest.mark.parametrize("lesson", WIDGET_LESSONS)
def test_lesson_widgets_render_and_react(lesson, browser, lab):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    stem = Path(lesson).stem
    stored = (ROOT / "notebooks" / lesson).read_bytes()
    page = browser.new_page()
    js_errors: list[str] = []
    page.on("pageerror", lambda error: js_errors.append(str(error)))
    try:
        # ?reset: a fresh workspace, so the previous test's notebooks are not reopened beside this one.
        page.goto(lab.url(f"lab/tree/notebooks/{lesson}?reset"), timeout=60_000)
        page.wait_for_selector(".jp-Notebook", timeout=60_000)
        time.sleep(2.0)
        _dismiss_dialogs(page)
        _wait_idle(page, 60)
        _run_all(page, lab, timeout_s=400)
        page.screenshot(path=str(ARTIFACTS / f"{stem}-after-run-all.png"), full_page=False)

        widgets = page.locator(".jp-OutputArea-output .widget-vbox:has(img)")
        count = widgets.count()
        assert count > 0, f"{lesson}: no rendered widget with a figure found after Run All"
        reacted = 0
        for index in range(count):
            widget = widgets.nth(index)
            widget.scroll_into_view_if_needed()
            before = _widget_image(widget)
            assert before, f"{lesson}: widget {index} shows no figure"
            slider = widget.locator(".widget-hslider .noUi-handle, .widget-hslider .slider-container [role='slider']")
            dropdown = widget.locator(".widget-dropdown select")
            if slider.count():
                slider.first.focus()
                for _ in range(3):
                    page.keyboard.press("ArrowRight")
            elif dropdown.count():
                options = dropdown.first.locator("option").all_inner_texts()
                current = dropdown.first.input_value()
                choice = next((o for o in options if o != current), None)
                assert choice is not None, f"{lesson}: widget {index} dropdown has a single option"
                dropdown.first.select_option(label=choice)
            else:
                continue
            deadline = time.time() + 30
            while _widget_image(widget) == before and time.time() < deadline:
                time.sleep(0.3)
            assert _widget_image(widget) != before, f"{lesson}: widget {index} did not redraw after its control changed"
            _wait_until_stable(widget)
            widget.screenshot(path=str(ARTIFACTS / f"{stem}-widget{index}-after.png"))
            reacted += 1
        assert reacted > 0, f"{lesson}: no widget had a slider or dropdown to move"
        assert not js_errors, f"{lesson}: JavaScript errors in the page: {js_errors}"
    finally:
        page.close()
    assert (ROOT / "notebooks" / lesson).read_bytes() == stored, "the browser run must not save into the repository"
