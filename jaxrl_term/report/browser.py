"""The report in a real headless browser: Playwright (sync API) driving the system's Chromium, nothing
downloaded (no ``playwright install``). Used by the browser test and to make the screenshot in the docs:
``python -m jaxrl_term.report screenshot RUN_DIR/report.html OUT.png [--search TEXT]``."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SETUP_HINT = "run `make sandbox` and `make browser` (`make test` runs both): Debian's chromium, Playwright in the venv"


def chromium_path() -> str | None:
    """The system's Chromium, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


@contextmanager
def open_page(html_path: str | os.PathLike, width: int = 1280, height: int = 900) -> Iterator[tuple]:
    """(page, errors) with the page loaded; ``errors`` collects console errors and uncaught page errors."""
    from playwright.sync_api import sync_playwright

    if not Path(html_path).is_file():
        raise FileNotFoundError(f"{html_path}: no such file (write it: python -m jaxrl_term.report RUN_DIR)")
    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError(f"no Chromium on this machine: {SETUP_HINT}")
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(Path(html_path).resolve().as_uri(), wait_until="load")
            yield page, errors
        finally:
            browser.close()


def open_transcript(page, search: str) -> str:
    """Type ``search`` in the search box, click the first transcript listed, return the detail pane's text."""
    page.fill("#transcript-search", search)
    page.locator(".transcript-item").first.click()
    return page.inner_text("#transcript-view")


def screenshot(html_path: str | os.PathLike, png_path: str | os.PathLike, search: str = "") -> Path:
    """A 1280x900 PNG of the report with the first transcript matching ``search`` opened."""
    with open_page(html_path) as (page, _):
        if page.locator(".transcript-item").count():
            open_transcript(page, search)
        page.locator("#transcripts").scroll_into_view_if_needed()
        page.screenshot(path=str(png_path))
    return Path(png_path)
