"""The reconciler resolves nothing from a lookup that could not see the call's key.

Each attempt records where its upstream received the forwarded key (the Idempotency-Key header,
`params._meta`, `params.idempotencyKey`). The example server's `lookup_payment` finds a payment by
the Idempotency-Key header its `pay_invoice` call carried, and its "not found" is authoritative for
calls that carried one. Under `request_hold: body` (the Istio WasmPlugin form) a key sent only in
`params._meta` reaches the upstream only there: the payment runs, and a lookup by that value would
answer "not found". Here such a call is made uncertain on purpose (an answer larger than
`max_receipt_bytes`), and the reconciler must leave it to a person (`no_input`, never looked up),
while the same rule resolves the control, a call whose key went in the header. Then the pair: a
"not found" resolves `not_executed` only under a rule that calls the lookup authoritative.

Real Envoy, the real ledger (its own, with its own rule file) and the example MCP server.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.e2e.conftest import new_key
from tests.e2e.test_permits import usage
from tests.e2e.test_reconciler import (LOOKUP_TOKEN, lookups, signed_in_inbox, uncertain_via_service_api,
                                       wait_resolved, write_rules)
from tests.e2e.test_wasmplugin_mode import derived
from tests.support.mcp_raw import KEY_META, RawMcp
from tests.support.stack import Envoy, Ledger, wait_until
from tests.support.tcp_proxy import TcpProxy

TAG = "x-atmost-test-call"
# Small enough that every answer below overflows it: the call is recorded uncertain.
MAX_RECEIPT = 2048


def start_ledger(log_dir, data_root, mcp_server, name: str, authoritative: bool | None) -> Ledger:
    rules = write_rules(data_root / f"{name}-rules.json", mcp_server, authoritative=authoritative)
    ledger = Ledger(log_dir, data_root / name, name=name, extra_args=["--reconcile-rules", str(rules)])
    ledger.env["EXAMPLE_LOOKUP_TOKEN"] = LOOKUP_TOKEN
    ledger.start()
    return ledger


@pytest.fixture(scope="module")
def trusting_ledger(log_dir, data_root, mcp_server):
    """A header-keyed rule whose "not found" is authoritative: the setting under which a lookup
    by a value the provider never saw in the header would give a slot back after a call that ran."""
    ledger = start_ledger(log_dir, data_root, mcp_server, "ledger-key-location", authoritative=True)
    yield ledger
    ledger.stop()


@pytest.fixture(scope="module")
def cautious_ledger(log_dir, data_root, mcp_server):
    """The same rule with `not_found_authoritative` left to its default."""
    ledger = start_ledger(log_dir, data_root, mcp_server, "ledger-key-location-default", authoritative=None)
    yield ledger
    ledger.stop()


@pytest.fixture(scope="module")
def body_gateway(log_dir, trusting_ledger, mcp_server):
    """Envoy in the WasmPlugin form (`request_hold: body`), with a small receipt cap, in front of a
    proxy that records what reaches the example server."""
    proxy = TcpProxy(mcp_server.port).start()
    envoy = Envoy(log_dir, proxy.port, [trusting_ledger.port], name="envoy-key-location",
                  deployment_form="wasmplugin",
                  plugin_overrides={"ledger": {"service_token": trusting_ledger.service_token},
                                    "max_receipt_bytes": MAX_RECEIPT})
    envoy.start()
    yield envoy, proxy
    envoy.stop()
    proxy.stop()


@pytest.fixture(scope="module")
def header_gateway(log_dir, trusting_ledger, mcp_server):
    """The same in the standalone form (`request_hold: headers`), where a dispatch sets the
    Idempotency-Key header (under `body` no key header goes upstream at all)."""
    proxy = TcpProxy(mcp_server.port).start()
    envoy = Envoy(log_dir, proxy.port, [trusting_ledger.port], name="envoy-key-location-headers",
                  plugin_overrides={"ledger": {"service_token": trusting_ledger.service_token},
                                    "max_receipt_bytes": MAX_RECEIPT})
    envoy.start()
    yield envoy, proxy
    envoy.stop()
    proxy.stop()


def attempt_of(ledger: Ledger, permit_id: str) -> dict:
    [a] = ledger.cli_json("attempts", "list", "--permit", permit_id)["attempts"]
    return ledger.cli_json("attempts", "show", a["id"])["attempt"]


def lost_receipt(client: RawMcp, proxy: TcpProxy, ledger: Ledger, permit: dict, key: str, key_via: str):
    """A `pay_invoice` that runs and answers more than the receipt cap: the client gets the answer,
    the attempt turns uncertain (receipt_too_large). Returns (the attempt, the request as it
    reached the upstream)."""
    tag = uuid.uuid4().hex
    invoice = f"INV-{tag}-" + "x" * (2 * MAX_RECEIPT)
    answered = client.call("pay_invoice", {"invoice": invoice, "amount": 5}, permit["token"], key,
                           key_via=key_via, extra_headers={TAG: tag})
    assert answered.status_code == 200 and "executions=" in answered.text, answered.text[:300]
    [arrived] = proxy.ended_requests_with(TAG, tag)
    wait_until(lambda: attempt_of(ledger, permit["id"])["state"] == "uncertain", 20, "the attempt uncertain")
    attempt = attempt_of(ledger, permit["id"])
    assert attempt["reason"].startswith("receipt_too_large"), attempt
    return attempt, arrived


def test_a_key_that_reached_the_upstream_only_in_meta_is_never_looked_up_by_the_header(
        body_gateway, header_gateway, trusting_ledger, server):
    envoy, proxy = body_gateway
    client = RawMcp(envoy.url)
    try:
        permit = trusting_ledger.create_permit("--max-calls", "pay_invoice=2", label="key-in-meta")
        before = lookups(trusting_ledger, "no_input")
        key = new_key()
        attempt, arrived = lost_receipt(client, proxy, trusting_ledger, permit, key, key_via="meta")
        assert server.executions("pay_invoice") == 1

        # The upstream got the forwarded value in `params._meta` and no Idempotency-Key header;
        # the attempt says exactly that.
        assert "idempotency-key" not in arrived.headers
        assert json.loads(arrived.body)["params"]["_meta"][KEY_META] == derived(permit["id"], key)
        assert attempt["forwarded_key"] == derived(permit["id"], key)
        assert attempt["forwarded_key_carriers"] == ["params._meta"]
        shown = trusting_ledger.cli("attempts", "show", attempt["id"]).stdout
        assert "key went   params._meta" in shown, shown

        # The rule looks payments up by the header, and its "not found" would be authoritative:
        # the reconciler counts the attempt no_input, asks the provider nothing, and leaves it
        # uncertain with its slot held.
        wait_until(lambda: lookups(trusting_ledger, "no_input") >= before + 2, 20, "two passes counted no_input")
        assert server.executions("lookup_payment") == 0
        again = attempt_of(trusting_ledger, permit["id"])
        assert again["state"] == "uncertain" and again.get("resolution") is None, again
        assert usage(trusting_ledger, permit["id"], "pay_invoice")["calls_made"] == 1

        # A person sees where the key went, and the warning, before choosing "not executed".
        http = signed_in_inbox(trusting_ledger)
        try:
            page = http.get("/admin/").text
            start = page.index(f'id="{attempt["id"]}"')
            card = page[start:page.index("</article>", start)]
            assert '<dd class="key-went">params._meta</dd>' in card, card
            assert "not in the Idempotency-Key header (where this tool&#39;s reconcile rule looks it up)" in card, card
        finally:
            http.close()

        # The control: the same rule, a call whose key went in the header (through the standalone
        # form: under `request_hold: body` no key header goes upstream). It is looked up and
        # resolved as executed (the provider has it under that header).
        control_permit = trusting_ledger.create_permit("--max-calls", "pay_invoice=1", label="key-in-header")
        control_key = new_key()
        header_envoy, header_proxy = header_gateway
        header_client = RawMcp(header_envoy.url)
        try:
            control, arrived = lost_receipt(header_client, header_proxy, trusting_ledger, control_permit,
                                            control_key, key_via="header")
        finally:
            header_client.close()
        assert arrived.headers["idempotency-key"] == derived(control_permit["id"], control_key)
        assert control["forwarded_key"] == derived(control_permit["id"], control_key)
        assert control["forwarded_key_carriers"] == ["header"]
        done = wait_resolved(trusting_ledger, control_permit["id"], "resolved_executed")
        assert done["resolution"]["source"] == "reconciler"
        assert server.executions("lookup_payment") >= 1

        # The call in `_meta` is still waiting for a person.
        assert attempt_of(trusting_ledger, permit["id"])["state"] == "uncertain"
    finally:
        client.close()


def test_not_found_gives_the_slot_back_only_where_the_rule_calls_the_lookup_authoritative(
        trusting_ledger, cautious_ledger, server):
    """The same lost call (its key in the header, never seen by the provider) under two rules:
    with `not_found_authoritative: true` the provider's "not found" resolves it not executed;
    with the default it stays uncertain, counted not_found_unconfirmed, its slot held."""
    results = {}
    for ledger in (trusting_ledger, cautious_ledger):
        permit = ledger.create_permit("--max-calls", "pay_invoice=1", label=f"nf-{uuid.uuid4().hex[:6]}")
        uncertain_via_service_api(ledger, permit, f"never-sent-{uuid.uuid4().hex}", 1)
        results[ledger.name] = permit

    done = wait_resolved(trusting_ledger, results[trusting_ledger.name]["id"], "resolved_not_executed")
    assert done["resolution"]["source"] == "reconciler"
    assert usage(trusting_ledger, results[trusting_ledger.name]["id"], "pay_invoice")["calls_made"] == 0

    cautious = results[cautious_ledger.name]
    wait_until(lambda: lookups(cautious_ledger, "not_found_unconfirmed") >= 2, 20,
               "two lookups answered not_found without the rule's promise")
    left = attempt_of(cautious_ledger, cautious["id"])
    assert left["state"] == "uncertain" and left.get("resolution") is None, left
    assert usage(cautious_ledger, cautious["id"], "pay_invoice")["calls_made"] == 1
    assert lookups(cautious_ledger, "not_executed") == 0
