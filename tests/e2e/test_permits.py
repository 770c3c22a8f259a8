"""Permits bound what an agent can spend: caps, budgets, expiry, scope, and the uncertain path."""

import pytest

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import (OpenCall, RawMcp, denial, denial_code, race_new_keys, result_text,
                                   worker_connections)
from tests.support.stack import BODY_HOLD_FORMS, Envoy, free_port, wait_until
from tests.support.tcp_proxy import TcpProxy


def usage(ledger, permit_id: str, tool: str) -> dict:
    """`atmost permit show` as JSON: the tool's usage row."""
    shown = ledger.cli_json("permit", "show", permit_id)
    return shown["usage"].get(tool, {"calls_made": 0})


def attempts(ledger, permit_id: str, state: str) -> list[dict]:
    return ledger.cli_json("attempts", "list", "--permit", permit_id, "--state", state)["attempts"]


def wait_for_state(ledger, permit_id: str, state: str, count: int = 1) -> list[dict]:
    return wait_until(lambda: (a := attempts(ledger, permit_id, state)) and len(a) >= count and a, 15,
                      f"{count} attempt(s) {state}")


def test_cap_of_one_under_32_concurrent_new_keys_on_both_workers(gateway, server, ledger):
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    before = worker_connections(gateway)
    answers = race_new_keys(gateway.url, permit["token"], "pay_invoice", 32, "race", new_key)
    codes = [denial_code(a) for a in answers]
    assert codes.count(None) == 1, [a.text for a in answers if denial_code(a) not in (None, "permit_max_calls_exceeded")]
    assert codes.count("permit_max_calls_exceeded") == 31
    refused = denial(answers[codes.index("permit_max_calls_exceeded")])
    assert (refused["tool"], refused["limit"], refused["calls_made"]) == ("pay_invoice", 1, 1)
    assert server.executions("pay_invoice") == 1
    after = worker_connections(gateway)
    assert all(a > b for a, b in zip(after, before)), f"both Envoy workers must take calls: {before} -> {after}"


def test_lost_response_then_new_key_is_denied_and_same_key_is_uncertain(gateway, server, ledger, upstream_proxy, client):
    """The seed's dangerous path: the tool ran, the answer was lost, the agent retries."""
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    args = {"invoice": "INV-4417", "amount": 250}
    upstream_proxy.mode = "cut_response"
    lost = client.call("pay_invoice", args, permit["token"], "task-4417-pay")
    upstream_proxy.mode = "pass"
    assert lost.status_code >= 500, lost.text
    assert server.executions("pay_invoice") == 1
    [attempt] = wait_for_state(ledger, permit["id"], "uncertain")

    retry_new_key = client.call("pay_invoice", args, permit["token"], "task-4417-pay-retry-2")
    assert denial_code(retry_new_key) == "permit_max_calls_exceeded"

    retry_same_key = client.call("pay_invoice", args, permit["token"], "task-4417-pay")
    error = denial(retry_same_key)
    assert error["code"] == "delivery_uncertain"
    assert error["attempt_id"] == attempt["id"]
    assert server.executions("pay_invoice") == 1
    assert usage(ledger, permit["id"], "pay_invoice")["calls_made"] == 1


def test_connection_refused_releases_the_slot(log_dir, ledger, mcp_server):
    mcp_server.reset()
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    dead_port = free_port()  # nothing listens here yet
    envoy = Envoy(log_dir, dead_port, [ledger.port], name="envoy-refused",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    envoy.start()
    client = RawMcp(envoy.url)
    proxy = None
    try:
        refused = client.call("pay_invoice", {"invoice": "r", "amount": 1}, permit["token"], new_key())
        assert refused.status_code == 503
        if envoy.deployment_form in BODY_HOLD_FORMS:
            # The headers left first: the connection failed either before the ledger was asked
            # (nothing reserved) or while it decided (the answer was held until then and the
            # dispatch released). Either way nothing stays in flight.
            everything = lambda: ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]  # noqa: E731
            wait_until(lambda: all(a["state"] == "released" for a in everything()), 15, "nothing in flight")
        else:
            wait_for_state(ledger, permit["id"], "released")
        assert usage(ledger, permit["id"], "pay_invoice")["calls_made"] == 0
        proxy = TcpProxy(mcp_server.port, listen_port=dead_port).start()
        ok = client.call("pay_invoice", {"invoice": "r", "amount": 1}, permit["token"], new_key())
        assert "executions=1" in result_text(ok)
        assert mcp_server.executions("pay_invoice") == 1
    finally:
        client.close()
        envoy.stop()
        if proxy:
            proxy.stop()


def test_budget_exhausted_partway_is_denied_without_execution(client, server, ledger):
    permit = ledger.create_permit("--budget", "100", "--cost", "pay_invoice=/amount")
    assert "executions=1" in result_text(client.call("pay_invoice", {"invoice": "b1", "amount": 60}, permit["token"], new_key()))
    assert "executions=2" in result_text(client.call("pay_invoice", {"invoice": "b2", "amount": 30}, permit["token"], new_key()))
    over = client.call("pay_invoice", {"invoice": "b3", "amount": 20}, permit["token"], new_key())
    error = denial(over)
    assert error["code"] == "permit_budget_exceeded"
    assert (error["budget"], error["spent"], error["reserved"], error["cost"]) == (100, 90, 0, 20)
    assert server.executions("pay_invoice") == 2


def test_expired_revoked_and_out_of_scope_permits_are_denied(client, server, ledger):
    expired = ledger.cli_json("permit", "create", "--label", "short", "--expires", "1s")
    scoped = ledger.create_permit("--tools", "echo")
    revoked = ledger.create_permit()
    key = new_key()
    assert "executions=1" in result_text(client.call("pay_invoice", {"invoice": "v", "amount": 1}, revoked["token"], key))
    ledger.cli("permit", "revoke", revoked["id"])
    wait_until(lambda: ledger.cli_json("permit", "show", expired["id"])["permit"]["status"] == "expired", 10,
               "the one-second permit to expire")
    assert denial_code(client.call("pay_invoice", {"invoice": "e", "amount": 1}, expired["token"], new_key())) == "permit_expired"
    assert denial_code(client.call("pay_invoice", {"invoice": "s", "amount": 1}, scoped["token"], new_key())) == "permit_tool_not_allowed"
    assert denial_code(client.call("pay_invoice", {"invoice": "v", "amount": 1}, revoked["token"], new_key())) == "permit_invalid"
    # Revocation also ends replays: authentication comes before everything else.
    assert denial_code(client.call("pay_invoice", {"invoice": "v", "amount": 1}, revoked["token"], key)) == "permit_invalid"
    assert result_text(client.call("echo", {"text": "in scope"}, scoped["token"], new_key())) == "in scope"
    assert server.executions("pay_invoice") == 1


@pytest.mark.parametrize("executed", [True, False], ids=["executed", "not-executed"])
def test_resolving_an_uncertain_attempt_changes_usage_as_specified(gateway, server, ledger, upstream_proxy, client, executed):
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    upstream_proxy.mode = "cut_response"
    client.call("pay_invoice", {"invoice": "R", "amount": 5}, permit["token"], "resolve-me")
    upstream_proxy.mode = "pass"
    [attempt] = wait_for_state(ledger, permit["id"], "uncertain")
    flag = "--executed" if executed else "--not-executed"
    ledger.cli("attempts", "resolve", attempt["id"], flag, "--note", "checked with the provider", "--by", "ops@example")
    state = "resolved_executed" if executed else "resolved_not_executed"
    [resolved] = attempts(ledger, permit["id"], state)
    assert resolved["resolution"]["by"] == "ops@example"
    assert resolved["resolution"]["note"] == "checked with the provider"
    assert resolved["resolution"]["at"]
    next_call = client.call("pay_invoice", {"invoice": "R2", "amount": 5}, permit["token"], new_key())
    if executed:
        assert usage(ledger, permit["id"], "pay_invoice")["calls_made"] == 1
        assert denial_code(next_call) == "permit_max_calls_exceeded"
        assert server.executions("pay_invoice") == 1
    else:
        assert "executions=2" in result_text(next_call)
        assert server.executions("pay_invoice") == 2


def test_client_hanging_up_mid_call_still_gets_its_attempt_recorded_uncertain(gateway, server, ledger):
    """The report is sent from the root context after the request's own context is gone."""
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    server.configure(pay_delay_ms=10000)  # still running when the client leaves
    impatient = OpenCall(gateway.url, "pay_invoice", {"invoice": "gone", "amount": 1}, permit["token"],
                         "hang-up-key")
    try:
        wait_until(lambda: server.executions("pay_invoice") == 1, 10, "the call to be running at the server")
    finally:
        impatient.hang_up()
    [attempt] = wait_for_state(ledger, permit["id"], "uncertain")
    # The lease here is the default 300 s: this came from the filter's report, not from the sweeper.
    assert attempt["reason"].startswith("sent_outcome_unknown:") and "response_flags=0x4000(DC)" in attempt["reason"], \
        attempt
    assert server.executions("pay_invoice") == 1


def test_gateway_and_ledger_count_what_they_decided(gateway, server, ledger, client, upstream_proxy):
    stats_before = gateway.stats()
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    key = new_key()
    client.call("pay_invoice", {"invoice": "m", "amount": 1}, permit["token"], key)            # dispatched
    client.call("pay_invoice", {"invoice": "m", "amount": 1}, permit["token"], key)            # replayed
    client.call("pay_invoice", {"invoice": "m", "amount": 1}, permit["token"], new_key())      # denied: cap
    upstream_proxy.mode = "cut_response"
    client.call("echo", {"text": "lost"}, permit["token"], new_key())                          # uncertain
    upstream_proxy.mode = "pass"
    wait_for_state(ledger, permit["id"], "uncertain")

    def grew(name: str) -> int:
        return gateway.stat(f"wasmcustom.{name}") - stats_before.get(f"wasmcustom.{name}", 0)

    wait_until(lambda: grew("atmost_uncertain") >= 1, 10, "the uncertain stat")
    assert grew("atmost_dispatched") == 2
    assert grew("atmost_replayed") == 1
    assert grew("atmost_denied_permit_max_calls_exceeded") == 1
    assert grew("atmost_completed") == 1
    metrics = ledger.metrics()
    assert 'atmost_authorize_total{code="permit_max_calls_exceeded",decision="deny"}' in metrics
    assert "atmost_outcomes_total" in metrics
    # The promise is at most N dispatches; no metric may claim more.
    assert "exactly" + " once" not in metrics.lower() and "exactly_once" not in metrics.lower()
