"""The reconciliation inbox in a real browser (headless Chromium, Debian's, driven by
Selenium), against the real ledger: a call the lost-response path left uncertain through the
real gateway is found, resolved, and its slot comes back; a wrong token, a form without the
CSRF token and an expired session are each refused; signing out or revoking every session
ends it on the ledger, for every copy of its cookie. Screenshots at phone width go to
target/test-artifacts/inbox/.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from pathlib import Path

import httpx
import pytest
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.e2e.conftest import UPSTREAM_SECRET, new_key
from tests.e2e.test_permits import attempts, wait_for_state
from tests.support.browser import PHONE_WIDTH, headless_chromium
from tests.support.mcp_raw import result_text
from tests.support.stack import ROOT, Ledger, default_ledger_tls, spki_sha256, wait_until

ARTIFACTS = ROOT / "target" / "test-artifacts" / "inbox"


@pytest.fixture
def browser(log_dir):
    # The suites' ledgers serve TLS with one certificate of a CA the browser does not know.
    driver = headless_chromium(log_dir, trusted_spki=(spki_sha256(default_ledger_tls().cert),))
    yield driver
    driver.quit()


def screenshot(driver, name: str) -> Path:
    """The whole page (not only the viewport) as a PNG artifact."""
    import base64

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
    })
    path = ARTIFACTS / f"{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def submit(driver, button) -> None:
    """Clicks a form's button and waits, bounded, for the page it leads to: a new document
    (a mark left on the old one's window is gone) that has finished loading. While the
    browser navigates, the driver may fail to answer; that means "not yet"."""
    driver.execute_script("window.atmostBeforeSubmit = true")
    button.click()
    WebDriverWait(driver, 15, ignored_exceptions=(WebDriverException,)).until(
        lambda d: d.execute_script(
            "return window.atmostBeforeSubmit === undefined && document.readyState === 'complete'"))


def sign_in(driver, ledger: Ledger, name: str, token: str) -> None:
    driver.get(ledger.admin_url + "/admin/")
    driver.find_element(By.ID, "name").send_keys(name)
    driver.find_element(By.ID, "token").send_keys(token)
    submit(driver, driver.find_element(By.CSS_SELECTOR, "form[action='/admin/sign-in'] button"))


def session_cookie(driver) -> str | None:
    return next((c["value"] for c in driver.get_cookies() if c["name"] == "atmost_session"), None)


def permit_card(driver, ledger: Ledger, permit_id: str):
    driver.get(ledger.admin_url + "/admin/permits")
    return driver.find_element(By.ID, permit_id)


def cell(card, css: str) -> str:
    return card.find_element(By.CSS_SELECTOR, css).text


def fits_the_phone(driver) -> bool:
    """Nothing wider than the viewport: no sideways scrolling at phone width."""
    return driver.execute_script("return document.documentElement.scrollWidth") <= PHONE_WIDTH


def lost_call(client, server, upstream_proxy, ledger: Ledger, permit: dict, args: dict) -> tuple[dict, str]:
    """The lost-response path through the real gateway: the tool runs, the answer is cut.
    Returns the uncertain attempt and the Idempotency-Key value the upstream received."""
    key = new_key()
    upstream_proxy.mode = "cut_response"
    try:
        lost = client.call("pay_invoice", args, permit["token"], key)
    finally:
        upstream_proxy.mode = "pass"
    assert lost.status_code >= 500, lost.text
    [attempt] = wait_for_state(ledger, permit["id"], "uncertain")
    [request] = [r for r in server.state()["requests"]
                 if r.get("tool") == "pay_invoice" and r["method"] == "POST"]
    forwarded = request["headers"]["idempotency-key"]
    expected = hmac.new(UPSTREAM_SECRET.encode(), f"{permit['id']}:{key}".encode(), hashlib.sha256).hexdigest()
    assert forwarded == expected
    return attempt, forwarded


def test_a_person_finds_the_lost_call_resolves_it_and_the_slot_comes_back(
        gateway, server, ledger, upstream_proxy, client, browser):
    label = f"billing-agent-{uuid.uuid4().hex[:6]}"
    permit = ledger.create_permit("--max-calls", "pay_invoice=1", "--budget", "1000",
                                  "--cost", "pay_invoice=/amount", label=label)
    args = {"invoice": "INV-INBOX-1", "amount": 250}
    attempt, forwarded = lost_call(client, server, upstream_proxy, ledger, permit, args)

    sign_in(browser, ledger, "Ana Ops", ledger.admin_token)
    assert browser.current_url == ledger.admin_url + "/admin/"
    assert session_cookie(browser)
    # No token in any URL the browser was sent to.
    assert ledger.admin_token not in browser.current_url

    card = permit_card(browser, ledger, permit["id"])
    assert (cell(card, "[data-tool='pay_invoice'] .used"), cell(card, "[data-tool='pay_invoice'] .limit")) == ("1", "1")
    assert (cell(card, ".spent"), cell(card, ".left")) == ("250", "750")
    screenshot(browser, "permits-before")

    browser.get(ledger.admin_url + "/admin/")
    item = browser.find_element(By.ID, attempt["id"])
    text = item.text
    for shown in (label, "pay_invoice", forwarded, "INV-INBOX-1", "uncertain for"):
        assert shown in text, f"{shown!r} not in the inbox entry:\n{text}"
    assert fits_the_phone(browser)
    screenshot(browser, "inbox-uncertain")

    note = "INV-INBOX-1 has no charge in the provider's dashboard"
    item.find_element(By.CSS_SELECTOR, "textarea[name='note'][id^='note-n-']").send_keys(note)
    submit(browser, item.find_element(By.CSS_SELECTOR, "button.not-executed"))
    assert "resolved=" in browser.current_url
    assert f"Resolved {attempt['id']}" in browser.page_source
    assert not browser.find_elements(By.ID, attempt["id"])

    # The slot and the budget came back, on the page and at the gateway.
    card = permit_card(browser, ledger, permit["id"])
    assert cell(card, "[data-tool='pay_invoice'] .used") == "0"
    assert (cell(card, ".spent"), cell(card, ".left")) == ("0", "1000")
    assert fits_the_phone(browser)
    screenshot(browser, "permits-after")
    browser.get(ledger.admin_url + "/admin/history")
    entry = browser.find_element(By.ID, attempt["id"])
    assert (cell(entry, ".by"), cell(entry, ".note")) == ("Ana Ops", note)
    assert "not executed" in entry.text and forwarded in entry.text
    screenshot(browser, "history")
    [resolved] = attempts(ledger, permit["id"], "resolved_not_executed")
    assert (resolved["resolution"]["by"], resolved["resolution"]["note"]) == ("Ana Ops", note)
    again = client.call("pay_invoice", {"invoice": "INV-INBOX-2", "amount": 250}, permit["token"], new_key())
    assert "executions=2" in result_text(again), again.text


def test_a_wrong_token_gives_no_session(ledger, browser):
    sign_in(browser, ledger, "Mallory", "not-the-admin-token")
    assert "That is not the admin token" in browser.page_source
    assert session_cookie(browser) is None
    sign_in(browser, ledger, "Mallory", ledger.service_token)
    assert session_cookie(browser) is None
    browser.get(ledger.admin_url + "/admin/permits")
    assert browser.find_elements(By.CSS_SELECTOR, "form[action='/admin/sign-in']")
    assert not browser.find_elements(By.CSS_SELECTOR, "article.permit")


def test_a_resolution_without_the_csrf_token_is_refused(gateway, server, ledger, upstream_proxy, client, browser):
    permit = ledger.create_permit("--max-calls", "pay_invoice=1", label=f"csrf-{uuid.uuid4().hex[:6]}")
    attempt, _ = lost_call(client, server, upstream_proxy, ledger, permit, {"invoice": "INV-CSRF", "amount": 1})
    sign_in(browser, ledger, "Ana Ops", ledger.admin_token)
    item = browser.find_element(By.ID, attempt["id"])
    form = item.find_element(By.CSS_SELECTOR, "form:has(button.executed)")
    # The form as a forging page would send it: everything but the session's CSRF token.
    browser.execute_script("arguments[0].querySelector(\"input[name='csrf']\").remove()", form)
    form.find_element(By.CSS_SELECTOR, "textarea").send_keys("forged")
    submit(browser, form.find_element(By.CSS_SELECTOR, "button"))
    assert "Refused" in browser.title
    assert "nothing was changed" in browser.page_source
    assert [a["id"] for a in attempts(ledger, permit["id"], "uncertain")] == [attempt["id"]]


def test_signing_out_ends_the_session_for_every_copy_of_its_cookie(ledger, browser):
    sign_in(browser, ledger, "Ana Ops", ledger.admin_token)
    copied = session_cookie(browser)
    assert copied

    def with_copy():
        return httpx.get(ledger.admin_url + "/admin/", cookies={"atmost_session": copied}, timeout=5,
                         verify=ledger.http_verify)

    assert with_copy().status_code == 200
    submit(browser, browser.find_element(By.CSS_SELECTOR, "form[action='/admin/sign-out'] button"))
    assert "Sign in" in browser.title and session_cookie(browser) is None
    # The ledger ended the session itself: the copy taken before sign-out is refused.
    refused = with_copy()
    assert refused.status_code == 401 and "Your session has ended" in refused.text


def test_revoking_every_session_signs_every_browser_out(ledger, browser):
    sign_in(browser, ledger, "Ana Ops", ledger.admin_token)
    browser.get(ledger.admin_url + "/admin/permits")
    assert browser.find_elements(By.CSS_SELECTOR, "form[action='/admin/sign-out']")
    revoked = ledger.cli("inbox", "sessions", "revoke", "--all")
    assert re.fullmatch(r"[1-9]\d* inbox session\(s\) ended; everyone signs in again\n", revoked.stdout), revoked.stdout
    browser.get(ledger.admin_url + "/admin/permits")
    assert "Your session has ended" in browser.page_source
    assert browser.find_elements(By.CSS_SELECTOR, "form[action='/admin/sign-in']")
    assert not browser.find_elements(By.CSS_SELECTOR, "article.permit")
    # `--all` is required: nothing is ended by accident.
    bare = ledger.cli("inbox", "sessions", "revoke", check=False)
    assert bare.returncode == 2 and "--all" in bare.stderr


def _uncertain_via_service_api(ledger: Ledger) -> str:
    """An attempt sent and lost, as a filter would report it (no gateway on this ledger)."""
    permit = ledger.create_permit(label="expiry")
    svc = {"authorization": f"Bearer {ledger.service_token}"}
    d = httpx.post(ledger.url + "/v1/authorize", headers=svc, timeout=10, verify=ledger.http_verify, json={
        "permit_token": permit["token"], "tool": "pay_invoice", "idempotency_key": "k",
        "fingerprint": "f", "arguments": {"amount": 1}, "forwarded_key": "fwd-k"}).json()
    report = {"attempt_id": d["attempt_id"], "round": d["round"], "capability": d["capability"],
              "outcome": "uncertain", "reason": "upstream_reset"}
    assert httpx.post(ledger.url + "/v1/outcomes", headers=svc, timeout=10, verify=ledger.http_verify,
                      json={"reports": [report]}).json()["acks"] == ["applied"]
    return d["attempt_id"]


def test_an_expired_session_is_refused(log_dir, data_root, browser):
    short = Ledger(log_dir, data_root / "ledger-short-sessions", name="ledger-short-sessions",
                   extra_args=["--inbox-session-ttl", "6s"])
    short.start()
    try:
        attempt_id = _uncertain_via_service_api(short)
        sign_in(browser, short, "Ana Ops", short.admin_token)
        item = browser.find_element(By.ID, attempt_id)
        cookie = session_cookie(browser)
        assert cookie
        # Wait, bounded, for the ledger itself to refuse the session, presented by a client
        # that keeps the cookie past its Max-Age (the ledger's clock decides, not the browser).
        expired = wait_until(lambda: (r := httpx.get(short.admin_url + "/admin/", cookies={"atmost_session": cookie},
                                                     timeout=5, verify=short.http_verify)).status_code == 401 and r, 30, "the session to expire")
        assert "Your session has expired" in expired.text
        # The form still open in the browser is refused too: the sign-in page, nothing changed.
        item.find_element(By.CSS_SELECTOR, "textarea[id^='note-x-']").send_keys("too late")
        submit(browser, item.find_element(By.CSS_SELECTOR, "button.executed"))
        assert "Sign in" in browser.title
        assert session_cookie(browser) is None
        shown = short.cli_json("attempts", "show", attempt_id)["attempt"]
        assert shown["state"] == "uncertain"
        assert shown["forwarded_key"] == "fwd-k"
    finally:
        short.stop()
