"""The report in a real headless browser: Playwright driving the system's Chromium (Debian's ``chromium``;
no browser download). Used by the tests and to make the screenshot in the docs."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@contextmanager
def open_page(html_path: str | os.PathLike, width: int = 1280, height: int = 900):
    """(page, errors): the report loaded; ``errors`` collects console errors and uncaught page errors."""
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError("no Chromium on this machine: apt-get install chromium (make sandbox does)")
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(Path(html_path).resolve().as_uri())
            page.wait_for_load_state("load")
            yield page, errors
        finally:
            browser.close()


def open_transcript(page, search: str) -> str:
    """Search for ``search``, click the first matching transcript, return the detail pane's text."""
    page.fill("#transcript-search", search)
    page.locator(".transcript-item").first.click()
    return page.inner_text("#transcript-view")


def screenshot(html_path: str | os.PathLike, png_path: str | os.PathLike, search: str | None = None) -> None:
    with open_page(html_path) as (page, _):
        if search is not None:
            open_transcript(page, search)
            page.locator("#transcripts").scroll_into_view_if_needed()
        page.screenshot(path=str(png_path), full_page=False)
