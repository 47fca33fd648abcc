"""Headless Chromium driven by selenium, for the pages plainformer writes: Debian's `chromium` and
`chromium-driver` (what .ci/run installs), never a driver downloaded by selenium's manager."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER = "/usr/bin/chromedriver"
WINDOW = (1280, 900)


def missing_browser() -> str | None:
    """Why no headless browser can run here, or None when one can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    if not any(shutil.which(path) for path in CHROMIUM) or not shutil.which(CHROMEDRIVER):
        return f"no chromium and {CHROMEDRIVER} (apt install chromium chromium-driver)"
    return None


@contextlib.contextmanager
def headless_chromium() -> Iterator[Any]:
    """A selenium Chrome driver of headless Chromium that keeps the console and the network log."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(path for path in CHROMIUM if shutil.which(path))
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={WINDOW[0]},{WINDOW[1]}", "--hide-scrollbars"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    os.environ.setdefault("SE_AVOID_STATS", "true")  # selenium's manager must not reach the network
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
