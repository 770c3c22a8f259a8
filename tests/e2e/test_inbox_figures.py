"""The inbox's figures in a real browser (headless Chromium) against the real ledger: the
permits page draws each capped tool's calls and the budget as bars, an attempt's page draws
its life on a time scale, both as inline SVG the ledger renders (no script). At 360 px and at
1280 px the drawn widths and positions are measured in the page and compared with what the
ledger's admin CLI says; screenshots go to target/test-artifacts/inbox/.
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from datetime import datetime

import httpx
import pytest
from selenium.webdriver.common.by import By

from tests.e2e.conftest import new_key
from tests.e2e.test_inbox import lost_call, screenshot, sign_in
from tests.e2e.test_permits import wait_for_state
from tests.support.browser import PHONE_WIDTH, headless_chromium
from tests.support.mcp_raw import result_text
from tests.support.stack import Ledger, default_ledger_tls, spki_sha256

WIDTHS = (PHONE_WIDTH, 1280)
# How far a drawn edge or centre may be from the figure's own value: one CSS pixel.
PIXEL = 1.0


@contextmanager
def signed_in_at(log_dir, ledger: Ledger, width: int):
    """A fresh headless Chromium whose viewport is `width` CSS px wide, signed in to the inbox."""
    driver = headless_chromium(log_dir, width=width, trusted_spki=(spki_sha256(default_ledger_tls().cert),))
    try:
        sign_in(driver, ledger, "Ana Ops", ledger.admin_token)
        assert driver.execute_script("return window.innerWidth") == width
        yield driver
    finally:
        driver.quit()


def box(element) -> dict:
    return element.parent.execute_script(
        "const r = arguments[0].getBoundingClientRect();"
        "return {left: r.left, right: r.right, width: r.width, centre: r.left + r.width / 2};", element)


def ms(rfc3339: str) -> int:
    return round(datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp() * 1000)


def runs_no_script(driver, ledger: Ledger) -> bool:
    """No script element, no event handler attribute, and the page was sent with the CSP that
    forbids scripts (read with the browser's own session cookie)."""
    handlers = driver.execute_script(
        "return [...document.querySelectorAll('*')].flatMap(e => [...e.attributes])"
        ".filter(a => a.name.startsWith('on')).length")
    cookie = next(c["value"] for c in driver.get_cookies() if c["name"] == "atmost_session")
    csp = httpx.get(driver.current_url, cookies={"atmost_session": cookie}, timeout=10,
                    verify=ledger.http_verify).headers["content-security-policy"]
    return (driver.execute_script("return document.scripts.length") == 0 and handlers == 0
            and "script-src" not in csp and csp.startswith("default-src 'none';"))


def fits(driver, width: int) -> bool:
    return driver.execute_script("return document.documentElement.scrollWidth") <= width


def check_bar(meter, part: str, x_from: float, share: float) -> float:
    """The `part` rectangle of the meter's bar starts at `x_from` of the track and covers
    `share` of it, each within a pixel; returns where it ends (as a share of the track)."""
    track = box(meter.find_element(By.CSS_SELECTOR, "svg rect.track"))
    drawn = box(meter.find_element(By.CSS_SELECTOR, f"svg rect.part-{part}"))
    assert abs(drawn["left"] - (track["left"] + x_from * track["width"])) <= PIXEL, (part, drawn, track)
    assert abs(drawn["width"] - share * track["width"]) <= PIXEL, (part, share, drawn, track)
    return x_from + share


def test_the_permits_page_draws_use_against_caps_and_budget(
        gateway, server, ledger, upstream_proxy, client, log_dir):
    capped = ledger.create_permit("--max-calls", "pay_invoice=3", "--budget", "1000",
                                  "--cost", "pay_invoice=/amount", label=f"figures-{uuid.uuid4().hex[:6]}")
    uncertain, _ = lost_call(client, server, upstream_proxy, ledger, capped, {"invoice": "INV-FIG-1", "amount": 200})
    for invoice, amount in (("INV-FIG-2", 100), ("INV-FIG-3", 250)):
        done = client.call("pay_invoice", {"invoice": invoice, "amount": amount}, capped["token"], new_key())
        assert "executions=" in result_text(done), done.text
    unlimited = ledger.create_permit(label=f"unlimited-{uuid.uuid4().hex[:6]}")
    done = client.call("pay_invoice", {"invoice": "INV-FIG-4", "amount": 5}, unlimited["token"], new_key())
    assert "executions=" in result_text(done), done.text

    shown = ledger.cli_json("permit", "show", capped["id"])
    assert shown["usage"]["pay_invoice"] == {"calls_made": 3, "limit": 3}
    assert shown["budget"] == {"budget": 1000, "spent": 550, "reserved": 0, "left": 450}
    attempt = ledger.cli_json("attempts", "show", uncertain["id"])["attempt"]
    for width in WIDTHS:
        with signed_in_at(log_dir, ledger, width) as browser:
            check_permits_page(browser, ledger, width, capped, unlimited, shown)
            check_attempt_page(browser, ledger, width, attempt)


def check_permits_page(browser, ledger: Ledger, width: int, capped: dict, unlimited: dict, shown: dict) -> None:
    browser.get(ledger.admin_url + "/admin/permits")
    card = browser.find_element(By.ID, capped["id"])
    pay = card.find_element(By.CSS_SELECTOR, "[data-tool='pay_invoice']")
    usage = shown["usage"]["pay_invoice"]
    assert (pay.find_element(By.CSS_SELECTOR, ".used").text, pay.find_element(By.CSS_SELECTOR, ".limit").text) \
        == (str(usage["calls_made"]), str(usage["limit"]))
    check_bar(pay, "used", 0, usage["calls_made"] / usage["limit"])
    assert "full" in pay.find_element(By.CSS_SELECTOR, "svg").get_attribute("class")
    assert pay.find_element(By.CSS_SELECTOR, "svg").get_attribute("aria-label") == "pay_invoice: 3 of 3 calls used"

    budget = card.find_element(By.CSS_SELECTOR, ".budget .meter")
    b = shown["budget"]
    for field, css in (("budget", ".total"), ("spent", ".spent"), ("reserved", ".reserved"), ("left", ".left")):
        assert budget.find_element(By.CSS_SELECTOR, css).text == str(b[field]), field
    end = check_bar(budget, "spent", 0, b["spent"] / b["budget"])
    check_bar(budget, "reserved", end, b["reserved"] / b["budget"])

    free = browser.find_element(By.ID, unlimited["id"])
    meter = free.find_element(By.CSS_SELECTOR, "[data-tool='pay_invoice']")
    assert (meter.find_element(By.CSS_SELECTOR, ".used").text, meter.find_element(By.CSS_SELECTOR, ".limit").text) \
        == ("1", "no cap")
    assert not free.find_elements(By.CSS_SELECTOR, "svg"), "no cap and no budget: nothing to fill"
    assert (free.find_element(By.CSS_SELECTOR, ".total").text, free.find_element(By.CSS_SELECTOR, ".spent").text) \
        == ("no limit", "0")
    assert not free.find_elements(By.CSS_SELECTOR, ".left")

    assert fits(browser, width)
    assert runs_no_script(browser, ledger)
    screenshot(browser, f"permits-{width}")


def check_attempt_page(browser, ledger: Ledger, width: int, attempt: dict) -> None:
    """The lost call's own page: sent, uncertain, now, on one time scale."""
    browser.get(ledger.admin_url + f"/admin/attempts/{attempt['id']}")
    start = browser.find_element(By.CSS_SELECTOR, "time.scale-start").get_attribute("datetime")
    end = browser.find_element(By.CSS_SELECTOR, "time.scale-end").get_attribute("datetime")
    assert start == attempt["created_at"]
    check_marks(browser, start, end, {"sent": attempt["created_at"], "outcome": attempt["updated_at"], "now": end})
    assert browser.find_element(By.CSS_SELECTOR, "li.event.outcome .what").text.startswith(
        f"Uncertain: sent, its answer lost ({attempt['reason']})")
    assert fits(browser, width)
    assert runs_no_script(browser, ledger)
    screenshot(browser, f"attempt-{width}")


def check_marks(driver, start: str, end: str, expected: dict[str, str]) -> None:
    """Each kind of mark is drawn once, where its time falls on the scale from `start` to
    `end` (within a pixel), and the list under the figure gives the same time."""
    axis = box(driver.find_element(By.CSS_SELECTOR, ".timeline svg line.axis"))
    t0, t1 = ms(start), ms(end)
    kinds = [g.get_attribute("data-kind") for g in driver.find_elements(By.CSS_SELECTOR, ".timeline svg g.mark")]
    assert sorted(kinds) == sorted(expected), kinds
    for kind, at in expected.items():
        share = (ms(at) - t0) / (t1 - t0) if t1 > t0 else 0.0
        mark = box(driver.find_element(By.CSS_SELECTOR, f".timeline svg g.mark.{kind} circle"))
        assert abs(mark["centre"] - (axis["left"] + share * axis["width"])) <= PIXEL, (kind, at, mark, axis)
        listed = driver.find_element(By.CSS_SELECTOR, f"ol.events li.{kind} time").get_attribute("datetime")
        assert listed == at, kind


@pytest.fixture
def long_lease_ledger(log_dir, data_root):
    """A ledger of its own whose leases outlast the test: an attempt dispatched under it
    stays in flight (its budget reserved) while the page is read."""
    ledger = Ledger(log_dir, data_root / "ledger-long-lease", name="ledger-long-lease", extra_args=["--lease", "1h"])
    ledger.start()
    yield ledger
    ledger.stop()


def test_a_continued_call_in_flight_shows_its_rounds_its_lease_and_its_reservation(long_lease_ledger, log_dir):
    ledger = long_lease_ledger
    permit = ledger.create_permit("--max-calls", "approve=2", "--budget", "100", "--cost", "approve=/amount",
                                  label="approver")
    svc = {"authorization": f"Bearer {ledger.service_token}"}

    def post(path: str, body: dict) -> dict:
        r = httpx.post(ledger.url + path, headers=svc, json=body, timeout=10, verify=ledger.http_verify)
        assert r.status_code == 200, r.text
        return r.json()

    # As a filter would: dispatched, the upstream asks for input, the continuation is
    # dispatched as round 2 (and is still running).
    asked = {"permit_token": permit["token"], "tool": "approve", "idempotency_key": "k-approve",
             "fingerprint": "f", "arguments": {"amount": 30}}
    first = post("/v1/authorize", asked)
    report = {"attempt_id": first["attempt_id"], "round": 1, "capability": first["capability"],
              "outcome": "input_required", "receipt": "{}"}
    assert post("/v1/outcomes", {"reports": [report]})["acks"] == ["applied"]
    wait_for_state(ledger, permit["id"], "awaiting_input")
    second = post("/v1/authorize", {**asked, "continuation": True})
    assert (second["decision"], second["round"]) == ("dispatch", 2), second
    attempt = ledger.cli_json("attempts", "show", first["attempt_id"])["attempt"]
    assert attempt["state"] == "in_flight"
    shown = ledger.cli_json("permit", "show", permit["id"])
    assert shown["budget"] == {"budget": 100, "spent": 0, "reserved": 30, "left": 70}

    for width in WIDTHS:
        with signed_in_at(log_dir, ledger, width) as browser:
            check_in_flight(browser, ledger, width, permit, attempt)


def check_in_flight(browser, ledger: Ledger, width: int, permit: dict, attempt: dict) -> None:
    browser.get(ledger.admin_url + "/admin/permits")
    budget = browser.find_element(By.ID, permit["id"]).find_element(By.CSS_SELECTOR, ".budget .meter")
    assert budget.find_element(By.CSS_SELECTOR, ".reserved").text == "30"
    check_bar(budget, "reserved", check_bar(budget, "spent", 0, 0.0), 0.30)
    screenshot(browser, f"permits-reserved-{width}")

    browser.get(ledger.admin_url + f"/admin/attempts/{attempt['id']}")
    end = browser.find_element(By.CSS_SELECTOR, "time.scale-end").get_attribute("datetime")
    # The scale reaches the lease's end, an hour ahead; the page was drawn before it.
    assert end == attempt["lease_expires_at"]
    now = browser.find_element(By.CSS_SELECTOR, "ol.events li.now time").get_attribute("datetime")
    check_marks(browser, attempt["created_at"], end, {
        "sent": attempt["created_at"], "dispatched": attempt["updated_at"], "now": now,
        "lease-ends": attempt["lease_expires_at"]})
    assert attempt["updated_at"] <= now < end
    assert "round 2" in browser.find_element(By.CSS_SELECTOR, ".timeline svg g.mark.dispatched text").text
    assert fits(browser, width)
    assert runs_no_script(browser, ledger)
    screenshot(browser, f"attempt-in-flight-{width}")
