"""Approvals end to end (docs/approvals.md), through real Envoy and the real ledger, on both
stores: a call the permit asks a person to approve holds its slot and sends nothing; a
person approves (the CLI) or rejects (the admin API); the agent's retry with the same key is
sent once, however many race; a rejection or a lapse gives the slot back and the key keeps
answering it; the decision names who made it, an authenticating proxy's person included."""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import re
import time
import urllib.error
import urllib.request
import uuid

import pytest

from tests.e2e.conftest import new_key
from tests.e2e.test_replicas import database_url, drop_schema  # noqa: F401 (fixture)
from tests.support.mcp_raw import RawMcp, denial, denial_code, result_text
from tests.support.stack import Envoy, Ledger, wait_until
from tests.support.webhook_receiver import WebhookReceiver

PROXY_TOKEN = "sso-proxy-token-of-32-bytes-or-more-0123"
WEBHOOK_SECRET = b"approval-webhook-secret-of-32-bytes-or-more"
HOLD_MS = 8000
ASKS_FIRST = ("--tools", "pay_invoice,echo", "--max-calls", "pay_invoice=1", "--budget", "1000",
              "--cost", "pay_invoice=/amount", "--approval", "pay_invoice=always")


def _stack(log_dir, data_root, url, store, tag, extra):
    schema = f"atmost_appr_{uuid.uuid4().hex[:10]}" if store == "postgres" else None
    ledger = Ledger(log_dir, data_root / f"ledger-approvals-{tag}", name=f"ledger-approvals-{tag}",
                    extra_args=[*extra, *(["--pg-schema", schema] if schema else [])])
    if schema:
        ledger.env["ATMOST_STORE"] = url  # the URL stays out of argv
    return ledger, schema


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stacks(request, log_dir, data_root, mcp_server, database_url):  # noqa: F811 (fixture)
    """store → {"main": (ledger, envoy), "quick": (ledger, envoy)}: the main ledger waits
    a minute for a decision and trusts an authenticating proxy's header; the quick one lets a
    request and an approval lapse after two seconds."""
    store = request.param
    tokens = data_root / f"approval-admins-{store}"
    tokens.write_text(f"sso-proxy {hashlib.sha256(PROXY_TOKEN.encode()).hexdigest()}\n")
    secret_file = data_root / f"approval-webhook-secret-{store}"
    secret_file.write_bytes(WEBHOOK_SECRET + b"\n")
    receiver = WebhookReceiver(WEBHOOK_SECRET).start()
    configs = {
        "main": ["--admin-tokens-file", str(tokens), "--admin-identity-header", "X-Forwarded-Email",
                 "--admin-identity-from", "sso-proxy", "--approval-wait", "60s", "--approval-use-within", "60s",
                 "--approval-webhook", receiver.url, "--approval-webhook-secret-file", str(secret_file)],
        "quick": ["--approval-wait", "2s", "--approval-use-within", "2s", "--sweep-interval", "200ms"],
    }
    out, started, schemas = {}, [], []
    try:
        for name, extra in configs.items():
            tag = f"{store}-{name}-{uuid.uuid4().hex[:6]}"
            ledger, schema = _stack(log_dir, data_root, database_url, store, tag, extra)
            if schema:
                schemas.append(schema)
            ledger.start()
            started.append(ledger)
            envoy = Envoy(log_dir, mcp_server.port, [ledger.port], name=f"envoy-approvals-{tag}",
                          plugin_overrides={"ledger": {"service_token": ledger.service_token}})
            envoy.start()
            started.append(envoy)
            out[name] = (ledger, envoy)
            if name == "main":
                # A gateway that holds a call open while a person decides (up to 8 s).
                holding = Envoy(log_dir, mcp_server.port, [ledger.port], name=f"envoy-approvals-hold-{tag}",
                                plugin_overrides={"ledger": {"service_token": ledger.service_token},
                                                  "approval_hold_ms": HOLD_MS, "report_interval_ms": 200})
                holding.start()
                started.append(holding)
                out["holding"] = holding
        out["webhook"] = receiver
        yield out
    finally:
        for p in reversed(started):
            p.stop()
        receiver.stop()
        for schema in schemas:
            drop_schema(database_url, schema)


def _pay(client: RawMcp, permit: dict, key: str, amount: int = 120, invoice: str = "inv-appr"):
    return client.call("pay_invoice", {"invoice": invoice, "amount": amount}, permit["token"], key)


def _admin(ledger: Ledger, path: str, body: dict | None = None, token: str | None = None,
           headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        ledger.admin_url + path, data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers={"authorization": f"Bearer {token or ledger.admin_token}",
                 "content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ledger.ssl_context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _usage(ledger: Ledger, permit: dict) -> tuple[int, int]:
    """(calls made of pay_invoice, budget reserved)."""
    shown = ledger.cli_json("permit", "show", permit["id"])
    return shown["usage"]["pay_invoice"]["calls_made"], shown["budget"]["reserved"]


def test_a_call_waits_for_a_person_and_its_retry_is_sent_once(stacks, server):
    ledger, envoy = stacks["main"]
    permit = ledger.create_permit(*ASKS_FIRST)
    client = RawMcp(envoy.url)
    key = new_key()
    asked = denial(_pay(client, permit, key))
    assert asked["code"] == "approval_required", asked
    approval_id = asked["approval_id"]
    assert 1 <= asked["retry_after"] <= 5 and asked["approval_expires_at"]
    # What the permit still allows counts the slot and cost the request holds.
    first_answer = _pay(client, permit, key)
    assert first_answer.json()["result"]["_meta"]["dev.atmost/permit"]["calls_left"] == 0, first_answer.text
    assert server.executions("pay_invoice") == 0
    # The slot and cost are held while a person decides; the same key asks nothing new.
    assert _usage(ledger, permit) == (1, 120)
    assert denial(_pay(client, permit, key))["approval_id"] == approval_id
    assert denial_code(_pay(client, permit, new_key(), invoice="other")) == "permit_max_calls_exceeded"
    # Other arguments under the key: a conflict, as always.
    assert denial_code(_pay(client, permit, key, amount=121)) == "idempotency_key_conflict"

    listed = ledger.cli_json("approval", "list", "--permit", permit["id"])["approvals"]
    assert [a["id"] for a in listed] == [approval_id]
    assert listed[0]["state"] == "awaiting_approval" and listed[0]["arguments"]["amount"] == 120
    decided = ledger.cli_json("approval", "approve", approval_id, "--note", "refund checked")["attempt"]
    assert decided["state"] == "approved"
    assert decided["approval"]["decided_by"] == "admin" and decided["approval"]["note"] == "refund checked"
    again = ledger.cli("approval", "approve", approval_id, check=False)
    assert again.returncode != 0 and "not_awaiting_approval" in again.stderr

    sent = _pay(client, permit, key)
    assert "executions=1" in result_text(sent), sent.text
    assert server.executions("pay_invoice") == 1
    replayed = _pay(client, permit, key)
    assert replayed.headers.get("idempotent-replayed") == "true"
    assert server.executions("pay_invoice") == 1
    assert _usage(ledger, permit) == (1, 0)

    # The attempt and its signed receipt name the approval and who gave it.
    shown = ledger.cli_json("attempts", "show", approval_id)["attempt"]
    assert shown["state"] == "completed" and shown["approval"]["decision"] == "approved"
    [jws] = ledger.cli("attempts", "export", "--permit", permit["id"]).stdout.split()
    payload = jws.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["attempt_id"] == approval_id
    assert claims["approval"]["decided_by"] == "admin" and claims["approval"]["decision"] == "approved"
    client.close()


def test_racing_retries_of_an_approved_key_are_sent_once(stacks, server):
    ledger, envoy = stacks["main"]
    permit = ledger.create_permit(*ASKS_FIRST)
    key = new_key()
    c = RawMcp(envoy.url)
    approval_id = denial(_pay(c, permit, key))["approval_id"]
    c.close()
    assert _admin(ledger, f"/admin/v1/approvals/{approval_id}/approve", {})[0] == 200

    def retry(_):
        one = RawMcp(envoy.url)
        try:
            return _pay(one, permit, key)
        finally:
            one.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(retry, range(12)))
    sent = [a for a in answers if denial(a) is None and a.headers.get("idempotent-replayed") is None]
    others = {denial_code(a) or "replay" for a in answers if a not in sent}
    assert len(sent) == 1, [a.text for a in answers]
    assert others <= {"idempotency_in_progress", "replay"}, others
    assert server.executions("pay_invoice") == 1


def test_a_rejection_gives_the_slot_back_and_the_key_keeps_it(stacks, server):
    ledger, envoy = stacks["main"]
    permit = ledger.create_permit(*ASKS_FIRST)
    client = RawMcp(envoy.url)
    key = new_key()
    approval_id = denial(_pay(client, permit, key))["approval_id"]
    status, body = _admin(ledger, f"/admin/v1/approvals/{approval_id}/reject", {"note": "not this one"})
    assert status == 200 and body["attempt"]["state"] == "approval_rejected", body
    assert _usage(ledger, permit) == (0, 0)
    rejected = denial(_pay(client, permit, key))
    assert rejected["code"] == "approval_rejected" and rejected["decided_by"] == "admin"
    # The slot is free again: a new key asks anew.
    assert denial_code(_pay(client, permit, new_key(), invoice="inv-2")) == "approval_required"
    assert server.executions("pay_invoice") == 0
    # An unknown id, and a decision on a rejected one.
    assert _admin(ledger, "/admin/v1/approvals/att_nope/approve", {})[0] == 404
    status, body = _admin(ledger, f"/admin/v1/approvals/{approval_id}/approve", {})
    assert (status, body["error"]) == (409, "not_awaiting_approval")
    client.close()


def test_only_the_proxys_credential_names_a_person(stacks, server):
    ledger, envoy = stacks["main"]
    permit = ledger.create_permit(*ASKS_FIRST)
    client = RawMcp(envoy.url)
    first = denial(_pay(client, permit, new_key()))["approval_id"]
    # The proxy's credential without the header: refused, nothing decided.
    status, body = _admin(ledger, f"/admin/v1/approvals/{first}/approve", {}, token=PROXY_TOKEN)
    assert status == 400 and "x-forwarded-email" in body["message"].lower(), body
    # Another admin's header is not believed: the decision is its own name.
    status, body = _admin(ledger, f"/admin/v1/approvals/{first}/reject", {},
                          headers={"X-Forwarded-Email": "mallory@example.org"})
    assert status == 200 and body["attempt"]["approval"]["decided_by"] == "admin"
    # Through the proxy, the person it names.
    second = denial(_pay(client, permit, new_key(), invoice="inv-b"))["approval_id"]
    status, body = _admin(ledger, f"/admin/v1/approvals/{second}/approve", {}, token=PROXY_TOKEN,
                          headers={"X-Forwarded-Email": "ana@example.org"})
    assert status == 200, body
    assert body["attempt"]["approval"]["decided_by"] == "sso-proxy:ana@example.org"
    client.close()


def test_nobody_deciding_or_an_unused_approval_lapses_and_gives_the_slot_back(stacks, server):
    ledger, envoy = stacks["quick"]
    permit = ledger.create_permit(*ASKS_FIRST)
    client = RawMcp(envoy.url)
    undecided = new_key()
    approval_id = denial(_pay(client, permit, undecided))["approval_id"]
    wait_until(lambda: ledger.cli_json("attempts", "show", approval_id)["attempt"]["state"] == "approval_expired",
               15, "the undecided request lapsed")
    assert _usage(ledger, permit) == (0, 0)
    assert denial_code(_pay(client, permit, undecided)) == "approval_expired"

    unused = new_key()
    approval_id = denial(_pay(client, permit, unused, invoice="inv-u"))["approval_id"]
    assert _admin(ledger, f"/admin/v1/approvals/{approval_id}/approve", {})[0] == 200
    lapsed = wait_until(lambda: (a := ledger.cli_json("attempts", "show", approval_id)["attempt"])["state"]
                        == "approval_expired" and a, 15, "the unused approval lapsed")
    assert lapsed["reason"] == "approval_unused"
    assert denial_code(_pay(client, permit, unused, invoice="inv-u")) == "approval_expired"
    assert _usage(ledger, permit) == (0, 0)
    assert server.executions("pay_invoice") == 0
    assert "atmost_approvals_expired_total 2" in ledger.metrics()
    client.close()


def test_people_are_asked_where_they_are_by_a_signed_webhook(stacks, server):
    """Each request and each decision is posted, signed (checked here by the receiver's own
    HMAC code, not the ledger's), and a receiver that fails twice still gets the event once."""
    ledger, envoy = stacks["main"]
    receiver = stacks["webhook"]
    permit = ledger.create_permit(*ASKS_FIRST, label="billing agent")
    client = RawMcp(envoy.url)
    receiver.answer_with(500, 503)
    approval_id = denial(_pay(client, permit, new_key()))["approval_id"]
    asked = receiver.wait_for("approval.requested", timeout=20, approval_id=approval_id)
    assert asked["permit_label"] == "billing agent" and asked["tool"] == "pay_invoice"
    assert asked["cost"] == 120 and asked["arguments"]["amount"] == 120 and asked["expires_at"]
    tries = [r for r in receiver.requests() if approval_id.encode() in r.body]
    assert [r.status for r in tries] == [500, 503, 200], tries
    assert all(r.refused is None for r in tries)
    status, _ = _admin(ledger, f"/admin/v1/approvals/{approval_id}/approve", {"note": "ok"})
    assert status == 200
    approved = receiver.wait_for("approval.approved", timeout=20, approval_id=approval_id)
    assert approved["decided_by"] == "admin" and approved["note"] == "ok" and approved["use_by"]
    delivered = re.search(r'^atmost_approval_webhook_deliveries_total\{result="delivered"\} (\d+)$',
                          ledger.metrics(), re.M)
    assert delivered and int(delivered.group(1)) >= 2, "the request and the decision at least"
    client.close()


def test_a_held_call_is_sent_once_a_person_approves_without_a_retry(stacks, server):
    """`approval_hold_ms`: the agent's one request stays open while a person decides, and its
    answer is the tool's, sent once; the gateway asked the ledger again on its own."""
    ledger, _ = stacks["main"]
    holding = stacks["holding"]
    receiver = stacks["webhook"]
    permit = ledger.create_permit(*ASKS_FIRST)
    held_before = holding.stat("wasmcustom.atmost_approval_held")
    dispatched_before = holding.stat("wasmcustom.atmost_approval_hold_dispatched")
    invoice = f"inv-held-{uuid.uuid4().hex[:6]}"

    def agent():
        c = RawMcp(holding.url)
        try:
            return _pay(c, permit, new_key(), invoice=invoice)
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        answer = pool.submit(agent)
        # The request shows up as a waiting approval (the webhook says so); the agent waits.
        asked = wait_until(lambda: next((e for e in receiver.events() if e["type"] == "approval.requested"
                                         and e["arguments"].get("invoice") == invoice), None),
                           20, "the held call's approval request")
        assert not answer.done()
        assert _admin(ledger, f"/admin/v1/approvals/{asked['approval_id']}/approve", {})[0] == 200
        sent = answer.result(timeout=30)
    assert denial(sent) is None and "executions=" in result_text(sent), sent.text
    assert server.executions("pay_invoice") == 1
    assert holding.stat("wasmcustom.atmost_approval_held") == held_before + 1
    assert holding.stat("wasmcustom.atmost_approval_hold_dispatched") == dispatched_before + 1


def test_a_held_call_nobody_decides_is_answered_approval_required_at_the_bound(stacks, server):
    ledger, _ = stacks["main"]
    holding = stacks["holding"]
    permit = ledger.create_permit(*ASKS_FIRST)
    timed_out_before = holding.stat("wasmcustom.atmost_approval_hold_timed_out")
    c = RawMcp(holding.url)
    try:
        started = time.monotonic()
        answer = _pay(c, permit, new_key())
        waited = time.monotonic() - started
    finally:
        c.close()
    assert denial_code(answer) == "approval_required", answer.text
    assert HOLD_MS / 1000 - 0.5 <= waited < HOLD_MS / 1000 + 10, waited
    assert holding.stat("wasmcustom.atmost_approval_hold_timed_out") == timed_out_before + 1
    assert server.executions("pay_invoice") == 0
