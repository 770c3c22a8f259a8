"""The reconciler against the example server: a ledger started with a rule file looks uncertain
`pay_invoice` attempts up with the example server's `lookup_payment` (MCP Streamable HTTP) and
resolves them only on a definite answer. Its own ledger and Envoy, so the suites that leave
attempts uncertain on purpose keep them so.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import uuid

import httpx
import pytest

from tests.e2e.conftest import new_key
from tests.e2e.test_permits import attempts, usage
from tests.support.mcp_raw import RawMcp, denial_code, result_text
from tests.support.stack import Envoy, Ledger, wait_until
from tests.support.tcp_proxy import TcpProxy

RULE_NAME = "example-payments"
LOOKUP_TOKEN = "lookup-credential-for-tests"


def write_rules(path, mcp_server, timeout: str = "1s", authoritative: bool | None = True):
    """The example server's rule: `lookup_payment` finds a payment by the Idempotency-Key header its
    `pay_invoice` call carried (the default `lookup.key_carrier`). It sees every such call as soon as
    it ran, so its "not found" is authoritative; `authoritative=None` leaves the field to its default."""
    answer = {"pointer": "/status", "executed": ["executed"], "not_executed": ["not_found"]}
    if authoritative is not None:
        answer["not_found_authoritative"] = authoritative
    path.write_text(json.dumps({
        "delay": "300ms", "interval": "100ms", "timeout": timeout, "backoff_max": "1s", "concurrency": 2,
        "rules": [{
            "name": RULE_NAME,
            "tool": "pay_invoice",
            "server": {"url": mcp_server.url + "/mcp", "credentials": {"env": "EXAMPLE_LOOKUP_TOKEN"}},
            "lookup": {"tool": "lookup_payment", "arguments": {"idempotency_key": "{{forwarded_key}}"}},
            "answer": answer,
        }],
    }))
    return path


@pytest.fixture(scope="module")
def rec_ledger(log_dir, data_root, mcp_server):
    rules = write_rules(data_root / "reconcile-rules.json", mcp_server)
    ledger = Ledger(log_dir, data_root / "ledger-reconciler", name="ledger-reconciler",
                    extra_args=["--reconcile-rules", str(rules)])
    ledger.env["EXAMPLE_LOOKUP_TOKEN"] = LOOKUP_TOKEN
    ledger.start()
    yield ledger
    ledger.stop()


@pytest.fixture(scope="module")
def rec_proxy(mcp_server):
    proxy = TcpProxy(mcp_server.port).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def rec_gateway(log_dir, rec_ledger, rec_proxy):
    envoy = Envoy(log_dir, rec_proxy.port, [rec_ledger.port], name="envoy-reconciler",
                  plugin_overrides={"ledger": {"service_token": rec_ledger.service_token}})
    envoy.start()
    yield envoy
    envoy.stop()


@pytest.fixture
def rec_client(rec_gateway):
    c = RawMcp(rec_gateway.url)
    yield c
    c.close()


def lookups(ledger: Ledger, result: str) -> int:
    m = re.search(rf'^atmost_reconciler_lookups_total\{{result="{result}"\}} (\d+)$', ledger.metrics(), re.M)
    return int(m.group(1)) if m else 0


def uncertain_via_service_api(ledger: Ledger, permit: dict, forwarded_key: str, amount: int,
                              carriers: list[str] | None = None) -> str:
    """Sent and lost, as a filter reports it: authorize with the forwarded key (in the
    Idempotency-Key header unless `carriers` says otherwise), then `uncertain`."""
    svc = {"authorization": f"Bearer {ledger.service_token}"}
    d = httpx.post(ledger.url + "/v1/authorize", headers=svc, timeout=10, verify=ledger.http_verify, json={
        "permit_token": permit["token"], "tool": "pay_invoice", "idempotency_key": new_key(),
        "fingerprint": f"f-{forwarded_key}", "arguments": {"invoice": "INV-NEVER", "amount": amount},
        "forwarded_key": forwarded_key,
        "forwarded_key_carriers": ["header"] if carriers is None else carriers}).json()
    report = {"attempt_id": d["attempt_id"], "round": d["round"], "capability": d["capability"],
              "outcome": "uncertain", "reason": "upstream_reset"}
    assert httpx.post(ledger.url + "/v1/outcomes", headers=svc, timeout=10, verify=ledger.http_verify,
                      json={"reports": [report]}).json()["acks"] == ["applied"]
    return d["attempt_id"]


def lose_a_payment(client, proxy, server, permit: dict, invoice: str, amount: int) -> str:
    """The lost-response path through the real gateway: the tool runs, its answer is cut.
    Returns the Idempotency-Key value the example server received."""
    proxy.mode = "cut_response"
    try:
        lost = client.call("pay_invoice", {"invoice": invoice, "amount": amount}, permit["token"], new_key())
    finally:
        proxy.mode = "pass"
    assert lost.status_code >= 500, lost.text
    [request] = [r for r in server.state()["requests"] if r.get("tool") == "pay_invoice" and r["method"] == "POST"]
    return request["headers"]["idempotency-key"]


def one_attempt(ledger: Ledger, permit_id: str) -> dict:
    [a] = ledger.cli_json("attempts", "list", "--permit", permit_id)["attempts"]
    return a


def wait_resolved(ledger: Ledger, permit_id: str, state: str) -> dict:
    [a] = wait_until(lambda: attempts(ledger, permit_id, state), 20, f"the attempt to become {state}")
    return a


def signed_in_inbox(ledger: Ledger) -> httpx.Client:
    """An HTTP client signed in to the inbox (the form's CSRF token, then the admin token)."""
    http = httpx.Client(base_url=ledger.admin_url, timeout=10, verify=ledger.http_verify)
    page = http.get("/admin/")
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text).group(1)
    signed = http.post("/admin/sign-in", data={"csrf": csrf, "name": "Ana Ops", "token": ledger.admin_token})
    assert signed.status_code in (200, 303), signed.text
    return http


def test_a_lost_payment_resolves_itself_as_executed_and_keeps_its_slot_and_budget(
        rec_gateway, rec_ledger, rec_proxy, rec_client, server):
    permit = rec_ledger.create_permit("--max-calls", "pay_invoice=1", "--budget", "1000",
                                      "--cost", "pay_invoice=/amount", label=f"rec-{uuid.uuid4().hex[:6]}")
    forwarded = lose_a_payment(rec_client, rec_proxy, server, permit, "INV-REC-1", 250)
    assert server.executions("pay_invoice") == 1

    done = wait_resolved(rec_ledger, permit["id"], "resolved_executed")
    resolution = done["resolution"]
    assert (resolution["source"], resolution["by"]) == ("reconciler", RULE_NAME)
    answer = json.loads(resolution["provider_answer"])
    assert answer == {"idempotency_key": forwarded, "status": "executed"}
    assert resolution["note"] == 'lookup_payment answered /status = "executed"'

    # Executed: the slot and the budget stay spent; a new key is over the cap, nothing runs.
    assert usage(rec_ledger, permit["id"], "pay_invoice")["calls_made"] == 1
    assert rec_ledger.cli_json("permit", "show", permit["id"])["budget"]["spent"] == 250
    again = rec_client.call("pay_invoice", {"invoice": "INV-REC-2", "amount": 5}, permit["token"], new_key())
    assert denial_code(again) == "permit_max_calls_exceeded"
    assert server.executions("pay_invoice") == 1

    # The lookup went to the provider with the rule's credential, from the environment.
    looked = [r for r in server.state()["requests"] if r.get("tool") == "lookup_payment"]
    assert looked and all(r["headers"].get("authorization") == f"Bearer {LOOKUP_TOKEN}" for r in looked)

    # The inbox's history shows the automatic resolution with the provider's answer.
    http = signed_in_inbox(rec_ledger)
    try:
        history = http.get("/admin/history")
        assert history.status_code == 200
        card = re.search(rf'<article class="card resolved" id="{done["id"]}">(.*?)</article>', history.text, re.S)
        assert card, history.text
        assert f"{RULE_NAME} <small>(reconciler)</small>" in card.group(1)
        shown = re.search(r"<dt>Provider answered</dt><dd><pre[^>]*>(.*?)</pre>", card.group(1), re.S)
        assert shown, card.group(1)
        assert json.loads(html.unescape(shown.group(1))) == answer
        assert forwarded in card.group(1)
    finally:
        http.close()


def test_a_payment_the_provider_never_saw_resolves_as_not_executed_and_gives_back_slot_and_budget(
        rec_gateway, rec_ledger, rec_client, server):
    """Sent and lost before the provider had it, as a filter reports it: the provider's lookup
    finds no payment under the forwarded key, so the slot and the budget come back."""
    permit = rec_ledger.create_permit("--max-calls", "pay_invoice=1", "--budget", "100",
                                      "--cost", "pay_invoice=/amount", label=f"rec-{uuid.uuid4().hex[:6]}")
    uncertain_via_service_api(rec_ledger, permit, f"never-sent-{uuid.uuid4().hex}", 60)
    assert usage(rec_ledger, permit["id"], "pay_invoice")["calls_made"] == 1

    done = wait_resolved(rec_ledger, permit["id"], "resolved_not_executed")
    assert done["resolution"]["source"] == "reconciler"
    assert json.loads(done["resolution"]["provider_answer"])["status"] == "not_found"
    assert usage(rec_ledger, permit["id"], "pay_invoice")["calls_made"] == 0
    assert rec_ledger.cli_json("permit", "show", permit["id"])["budget"]["spent"] == 0
    # The slot is back: a call through the gateway runs.
    ok = rec_client.call("pay_invoice", {"invoice": "INV-NEXT", "amount": 60}, permit["token"], new_key())
    assert "executions=1" in result_text(ok)


@pytest.mark.parametrize("mode,result", [
    ("error", "error"), ("slow", "timeout"), ("unknown", "unknown_value"), ("missing", "missing_field"),
])
def test_a_lookup_that_settles_nothing_leaves_the_attempt_uncertain(
        rec_gateway, rec_ledger, rec_proxy, rec_client, server, mode, result):
    wait_until(lambda: not rec_ledger.cli_json("attempts", "list", "--state", "uncertain")["attempts"], 20,
               "no attempt left uncertain by an earlier test")
    permit = rec_ledger.create_permit("--max-calls", "pay_invoice=1", label=f"rec-{mode}")
    server.configure(lookup_mode=mode)
    before = lookups(rec_ledger, result)
    lose_a_payment(rec_client, rec_proxy, server, permit, f"INV-{mode}", 7)
    # The reconciler asked (the answer was counted as `result`) and did not resolve.
    wait_until(lambda: lookups(rec_ledger, result) >= before + 2, 20, f"two lookups answered {result}")
    attempt = one_attempt(rec_ledger, permit["id"])
    assert attempt["state"] == "uncertain", attempt
    assert attempt.get("resolution") is None
    assert usage(rec_ledger, permit["id"], "pay_invoice")["calls_made"] == 1
    # Once the provider answers, the backoff brings the lookup back and it resolves.
    server.configure(lookup_mode="answer")
    wait_resolved(rec_ledger, permit["id"], "resolved_executed")


def test_two_replicas_on_postgresql_both_look_up_one_attempt_and_only_one_resolves_it(
        log_dir, data_root, mcp_server, server):
    url = os.environ.get("DATABASE_URL", "").strip()
    assert url, "DATABASE_URL is not set: `make test` provides it (scripts/with-postgres)"
    schema = f"atmost_rec_{uuid.uuid4().hex[:10]}"
    rules = write_rules(data_root / "reconcile-rules-pg.json", mcp_server, timeout="30s")
    replicas = []
    try:
        for i in (1, 2):
            name = f"ledger-pg-reconciler-{i}"
            r = Ledger(log_dir, data_root / name, name=name,
                       extra_args=["--pg-schema", schema, "--reconcile-rules", str(rules)])
            r.env["ATMOST_STORE"] = url
            r.env["EXAMPLE_LOOKUP_TOKEN"] = LOOKUP_TOKEN
            r.start()
            replicas.append(r)
        first, second = replicas
        permit = first.create_permit("--max-calls", "pay_invoice=1", label="rec-replicas")
        # Every lookup waits until both replicas have one running, then all are answered.
        server.configure(lookup_mode="hold")
        uncertain_via_service_api(first, permit, f"never-sent-{uuid.uuid4().hex}", 1)
        wait_until(lambda: server.executions("lookup_payment") >= 2, 20, "a lookup from each replica")
        server.configure(lookup_mode="answer")
        wait_resolved(second, permit["id"], "resolved_not_executed")
        # Both asked and got a definite answer; the store applied one resolution, refused the other.
        wait_until(lambda: sum(lookups(r, "not_executed") + lookups(r, "already_resolved") for r in replicas) == 2,
                   20, "both replicas' lookups counted")
        assert sum(lookups(r, "not_executed") for r in replicas) == 1
        assert sum(lookups(r, "already_resolved") for r in replicas) == 1
        assert usage(first, permit["id"], "pay_invoice")["calls_made"] == 0
    finally:
        for r in replicas:
            r.stop()
        if shutil.which("psql"):
            subprocess.run(["psql", url, "-qc", f"DROP SCHEMA IF EXISTS {schema} CASCADE"], capture_output=True,
                           timeout=30)
