"""The inbox's Approvals page in a real browser (headless Chromium, Debian's, driven by
Selenium), against the real ledger and the real gateway (docs/approvals.md#deciding): a call
the permit asks a person to approve is listed with what the person judges it by; Approve in
the page lets the agent's retry with the same key through once, and a further retry is a
replay. A form without the session's CSRF token decides nothing. Screenshots at phone width
go to target/test-artifacts/inbox/.
"""

from __future__ import annotations

import uuid

import pytest
from selenium.webdriver.common.by import By

from tests.e2e.conftest import new_key
from tests.e2e.test_inbox import fits_the_phone, screenshot, sign_in, submit
from tests.support.browser import headless_chromium
from tests.support.mcp_raw import denial, result_text
from tests.support.stack import Ledger, default_ledger_tls, spki_sha256

ASKS_FIRST = ("--tools", "pay_invoice,echo", "--max-calls", "pay_invoice=2", "--budget", "1000",
              "--cost", "pay_invoice=/amount", "--approval", "pay_invoice=always")


@pytest.fixture
def browser(log_dir):
    # The suites' ledgers serve TLS with one certificate of a CA the browser does not know.
    driver = headless_chromium(log_dir, trusted_spki=(spki_sha256(default_ledger_tls().cert),))
    yield driver
    driver.quit()


def _waiting(client, ledger: Ledger, label: str, invoice: str) -> tuple[dict, str, dict]:
    """A permit that asks a person before each pay_invoice, and one call waiting under it:
    (permit, idempotency key, the agent's denial)."""
    permit = ledger.create_permit(*ASKS_FIRST, label=label)
    key = new_key()
    asked = denial(client.call("pay_invoice", {"invoice": invoice, "amount": 120}, permit["token"], key))
    assert asked["code"] == "approval_required", asked
    return permit, key, asked


def _approval_state(ledger: Ledger, approval_id: str) -> dict:
    return ledger.cli_json("attempts", "show", approval_id)["attempt"]


def test_a_person_approves_in_the_inbox_and_the_agents_retry_is_sent_once(
        gateway, server, ledger, client, browser):
    label = f"approver-{uuid.uuid4().hex[:6]}"
    permit, key, asked = _waiting(client, ledger, label, "INV-APPROVE-1")
    approval_id = asked["approval_id"]
    assert server.executions("pay_invoice") == 0

    sign_in(browser, ledger, "Ana Ops", ledger.admin_token)
    # The navigation says calls wait, on every page.
    link = browser.find_element(By.CSS_SELECTOR, "a[href='/admin/approvals']")
    assert int(link.find_element(By.CSS_SELECTOR, ".nav-count").text) >= 1
    submit(browser, link)
    assert browser.current_url == ledger.admin_url + "/admin/approvals"

    item = browser.find_element(By.ID, approval_id)
    text = item.text
    for shown in ("pay_invoice", label, permit["id"], "INV-APPROVE-1", "120"):
        assert shown in text, f"{shown!r} not in the approval entry:\n{text}"
    # The cap of 2 with this call's slot held; the budget less its reserved cost.
    assert item.find_element(By.CSS_SELECTOR, ".calls-left").text.startswith("1 for pay_invoice")
    assert item.find_element(By.CSS_SELECTOR, ".budget-left").text.startswith("880")
    assert item.find_element(By.CSS_SELECTOR, ".lapses time").get_attribute("datetime") == \
        asked["approval_expires_at"]
    assert fits_the_phone(browser)
    screenshot(browser, "approvals-waiting")

    item.find_element(By.CSS_SELECTOR, "textarea[name='note']").send_keys("invoice matches the order")
    submit(browser, item.find_element(By.CSS_SELECTOR, "button.approve"))
    assert browser.current_url.endswith(f"/admin/approvals?approved={approval_id}")
    assert f"Approved {approval_id}" in browser.find_element(By.CSS_SELECTOR, ".notice").text
    assert not browser.find_elements(By.ID, approval_id)
    screenshot(browser, "approvals-approved")

    decided = _approval_state(ledger, approval_id)
    assert decided["state"] == "approved"
    assert decided["approval"]["decided_by"] == "Ana Ops"
    assert decided["approval"]["note"] == "invoice matches the order"

    # The agent's retry with the same key is sent, once; a further retry is a replay.
    sent = client.call("pay_invoice", {"invoice": "INV-APPROVE-1", "amount": 120}, permit["token"], key)
    assert "executions=1" in result_text(sent), sent.text
    assert server.executions("pay_invoice") == 1
    replayed = client.call("pay_invoice", {"invoice": "INV-APPROVE-1", "amount": 120}, permit["token"], key)
    assert replayed.headers.get("idempotent-replayed") == "true", replayed.text
    assert server.executions("pay_invoice") == 1
    assert _approval_state(ledger, approval_id)["state"] == "completed"


def test_a_decision_without_the_csrf_token_is_refused_and_decides_nothing(
        gateway, server, ledger, client, browser):
    permit, key, asked = _waiting(client, ledger, f"csrf-appr-{uuid.uuid4().hex[:6]}", "INV-APPROVE-2")
    approval_id = asked["approval_id"]
    sign_in(browser, ledger, "Ana Ops", ledger.admin_token)
    browser.get(ledger.admin_url + "/admin/approvals")
    form = browser.find_element(By.ID, approval_id).find_element(By.CSS_SELECTOR, "form.decide")
    browser.execute_script("arguments[0].querySelector(\"input[name='csrf']\").remove()", form)
    submit(browser, form.find_element(By.CSS_SELECTOR, "button.approve"))
    assert "nothing was changed" in browser.find_element(By.TAG_NAME, "main").text
    assert _approval_state(ledger, approval_id)["state"] == "awaiting_approval"
    # The agent is still asked to wait, and nothing was sent.
    again = denial(client.call("pay_invoice", {"invoice": "INV-APPROVE-2", "amount": 120}, permit["token"], key))
    assert again["code"] == "approval_required", again
    assert server.executions("pay_invoice") == 0
