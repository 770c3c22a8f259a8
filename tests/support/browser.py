"""Headless Chromium for the inbox tests: Debian's `chromium` and `chromium-driver`
(`make browser-tools` installs them) driven by Selenium from PyPI. Nothing is downloaded:
Selenium is given both paths, and the browser resolves no host name but loopback ones, so it
talks only to the ledger under test.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

# Selenium's own helper never fetches a driver or a browser here.
os.environ.setdefault("SE_OFFLINE", "true")

CHROMIUM = Path(os.environ.get("ATMOST_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("ATMOST_CHROMEDRIVER", "/usr/bin/chromedriver"))

# Width of the narrowest phone the inbox must work on, in CSS pixels.
PHONE_WIDTH = 360


def headless_chromium(log_dir: Path, width: int = PHONE_WIDTH, height: int = 900,
                      trusted_spki: tuple[str, ...] = ()) -> webdriver.Chrome:
    """A fresh headless Chromium (its own profile, no cookies) with a `width` px wide window.
    `trusted_spki`: certificates (local_ca.spki_sha256) it accepts though no root it knows
    signed them, as a person accepts the ledger's local CA once; every other check stays."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            raise RuntimeError(f"{path} is missing: `make browser-tools` installs Debian's chromium and chromium-driver")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        # Tests run as root here; Chromium refuses to start its sandbox as root.
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        f"--user-data-dir={tempfile.mkdtemp(prefix='atmost-chromium-')}",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-domain-reliability",
        "--no-pings",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(arg)
    if trusted_spki:
        options.add_argument(f"--ignore-certificate-errors-spki-list={','.join(trusted_spki)}")
    # A desktop window is never narrower than 500 px: a phone's viewport is emulated instead.
    options.add_experimental_option("mobileEmulation", {"deviceMetrics": {"width": width, "height": height,
                                                                          "pixelRatio": 1}})
    # Warnings only: at its default level the driver logs every command with its arguments,
    # the admin token typed into the sign-in form among them, and the suites' logs hold no
    # secret (the fault suite's last test scans them).
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(log_dir / "chromedriver.log"),
                      service_args=["--log-level=WARNING"])
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    return driver
