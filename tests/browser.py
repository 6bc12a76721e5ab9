"""A real headless browser for the dashboard tests: Debian's chromium driven through chromium-driver (selenium).

Waits are explicit and generous: on a busy 2-core machine a page can take seconds to paint.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 60


def _installed() -> bool:
    return Path(CHROMIUM).exists() and (Path(CHROMEDRIVER).exists() or shutil.which("chromedriver") is not None)


def install_chromium() -> bool:
    """As root with apt, install Debian's chromium and its driver when missing, as the sshd, adb and Docker
    peers do: `make test` then runs what `.ci/run` runs. True when both are there."""
    if _installed():
        return True
    if os.geteuid() == 0 and shutil.which("apt-get"):
        for args in (["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"],
                     ["sh", "-c", "apt-get update -qq && apt-get install -y -qq chromium chromium-driver"]):
            if subprocess.run(args, capture_output=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
                              timeout=900).returncode == 0 and _installed():
                return True
    return _installed()


def browser_available() -> str | None:
    """Why the browser cannot run here, or None."""
    if not install_chromium():
        return "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; needs root)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium (pip install -e '.[test]')"
    return None


def _chromium(folder: Path):
    """A headless chromium under chromedriver, its profile and driver log in `folder`; skips when it cannot run."""
    reason = browser_available()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,900", "--no-first-run", "--disable-extensions",
                 f"--user-data-dir={folder / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER, log_output=str(folder / "chromedriver.log")),
                              options=options)
    driver.set_page_load_timeout(WAIT_S)
    return driver


@pytest.fixture(name="browser")
def browser_fixture(tmp_path: Path) -> Iterator["Browser"]:
    """A test takes `browser` as an argument after `from browser import browser_fixture`."""
    driver = _chromium(tmp_path)
    try:
        yield Browser(driver)
    finally:
        driver.quit()


@pytest.fixture(scope="module", name="module_chromium")
def module_chromium_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    driver = _chromium(tmp_path_factory.mktemp("chromium"))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(name="browser")
def shared_browser_fixture(module_chromium) -> Iterator["Browser"]:
    """`browser` for a module whose tests share one chromium (issue 34: a start per test): each test gets it with no
    cookies (no session) on a blank page, as a fresh one. Import this instead of browser_fixture."""
    module_chromium.execute_cdp_cmd("Network.clearBrowserCookies", {})
    module_chromium.get("about:blank")
    yield Browser(module_chromium)


class Browser:
    def __init__(self, driver) -> None:
        self.driver = driver

    def get(self, url: str) -> None:
        self.driver.get(url)

    def wait(self, condition: Callable[[object], object], what: str, timeout: float = WAIT_S) -> object:
        from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait
        try:
            # live regions replace their elements while we look: a stale or missing element is "not yet"
            return WebDriverWait(self.driver, timeout, poll_frequency=0.25, ignored_exceptions=(
                NoSuchElementException, StaleElementReferenceException)).until(condition)
        except TimeoutException:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; page {self.driver.current_url}:\n"
                                 f"{self.text()[:3000]}") from None

    def find(self, css: str):
        from selenium.webdriver.common.by import By
        return self.wait(lambda d: d.find_element(By.CSS_SELECTOR, css), f"an element {css!r}")

    def find_all(self, css: str) -> list:
        from selenium.webdriver.common.by import By
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def attribute(self, css: str, name: str) -> str | None:
        """Read in the page itself, in one step: a live region may replace the element between two calls."""
        return self.driver.execute_script(
            "const el = document.querySelector(arguments[0]); return el ? el.getAttribute(arguments[1]) : null;", css, name)

    def text(self) -> str:
        from selenium.webdriver.common.by import By
        try:
            return self.driver.find_element(By.TAG_NAME, "body").text
        except Exception:
            return self.driver.page_source

    def log_in(self, base_url: str, token: str) -> None:
        self.get(base_url + "login")
        self.find("#token").send_keys(token)
        self.find("#login").click()
        self.wait(lambda d: "/lab" in d.current_url and d.find_elements("css selector", "header nav"), "the lab page")
