"""The HTML report (`simulate --html`) in a real headless browser: Chromium from the Debian packages (`apt-get
install chromium chromium-driver`, which .ci/run installs) driven by selenium (the `dev` extra). tests/
test_html_report.py loads a report with these helpers; run as a script, this writes the pictures of
docs/pictures/README.md:

    python bench/html_report_browser.py    # docs/pictures/html-report.png and html-report-llama-3-8b.png

Each picture is a report opened at 1400 x 1000 with the pointer on the peak's dot, so the tooltip lists the
tensors live at the peak. The reports' sizes are printed.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VIEWPORT = (1400, 1000)


def chromium_paths() -> tuple[str | None, str | None]:
    """(the browser, its driver) as the Debian packages install them, or None for each one missing."""
    browser = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
    return browser, shutil.which("chromedriver")


def missing() -> str | None:
    """Why the browser cannot run here (None when it can)."""
    browser, driver = chromium_paths()
    if browser is None or driver is None:
        return ("Chromium and its driver are not installed (apt-get install -y chromium chromium-driver; .ci/run "
                "installs them)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


@contextlib.contextmanager
def chromium(width: int = VIEWPORT[0], height: int = VIEWPORT[1]):
    """A headless Chromium (selenium WebDriver) whose page is `width` x `height` CSS pixels, keeping the
    console's messages (driver.get_log("browser")); quit on leaving."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                "--force-device-scale-factor=1", f"--window-size={width},{height}", "--lang=en-US"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        yield driver
    finally:
        driver.quit()


def open_report(driver, path: Path) -> list[dict]:
    """Load the report from file:// and return the console's messages while it loaded."""
    driver.get(path.resolve().as_uri())
    driver.find_element("css selector", "#chart path")  # drawn
    return driver.get_log("browser")


def hover_peak(driver):
    """The pointer on the peak's dot; the tooltip element, shown."""
    from selenium.webdriver.common.action_chains import ActionChains

    marker = driver.find_element("id", "peak-marker")
    ActionChains(driver).move_to_element(marker).perform()
    return driver.find_element("id", "tooltip")


def tooltip_tensors(driver) -> list[tuple[str, str, str]]:
    """The tooltip's live tensors: (bytes as written, category, name), as listed."""
    rows = driver.find_elements("css selector", "#tooltip-live tr")
    return [tuple(td.text for td in r.find_elements("tag name", "td")) for r in rows]


def picture(report: Path, png: Path) -> None:
    with chromium() as driver:
        errors = [m for m in open_report(driver, report) if m["level"] in ("SEVERE", "WARNING")]
        if errors:
            raise SystemExit(f"{report}: the console says {errors}")
        hover_peak(driver)
        png.write_bytes(driver.get_screenshot_as_png())


def main() -> int:
    reason = missing()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    from peakledger.cli import main as peakledger

    cases = {"html-report.png": ["simulate"],
             "html-report-llama-3-8b.png": ["simulate", "--preset", "llama-3-8b"]}
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in cases.items():
            page = Path(tmp) / "report.html"
            with contextlib.redirect_stdout(io.StringIO()):
                assert peakledger([*argv, "--html", str(page)]) == 0
            print(f"peakledger {' '.join(argv)} --html: {page.stat().st_size:,} bytes")
            picture(page, REPO / "docs" / "pictures" / name)
            print(f"  docs/pictures/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
