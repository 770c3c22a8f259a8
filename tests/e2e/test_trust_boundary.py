"""Ways around the ledger, each walked through with real Envoy and the real ledger.

- A continuation (MCP input_required round) that never reached the upstream must not free
  the key or the slot: round 1 was sent.
- A late report of an earlier round must not move an attempt whose next round is in flight.
- An agent that read the service token from the sidecar's configuration can talk to the
  ledger itself. Whatever it does with that, the gateway sends no call the ledger does not
  count, and a report without the round's capability is refused and counted.
"""

from __future__ import annotations

from hashlib import sha256

import httpx
import pytest

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import PROTOCOL_VERSION, RawMcp, denial_code, result_text
from tests.support.stack import Envoy, ExampleServer, wait_until

TOOL = "approve_payment"
ARGS = {"invoice": "INV-77", "amount": 40}
APPROVAL = {"approval": {"action": "accept", "content": {"approve": True}}}


@pytest.fixture(scope="module")
def mrtr_server(log_dir):
    """An example server of this module's own, so it can be stopped and started again."""
    server = ExampleServer(log_dir, name="mcp-server-trust")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mrtr_gateway(log_dir, ledger, mrtr_server):
    envoy = Envoy(log_dir, mrtr_server.port, [ledger.port], name="envoy-trust",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    envoy.start()
    yield envoy
    envoy.stop()


@pytest.fixture
def mcp(mrtr_gateway, mrtr_server):
    mrtr_server.reset()
    client = RawMcp(mrtr_gateway.url)
    yield client
    client.close()


def continuation(ask: dict, request_id: str) -> dict:
    """The MCP 2026-07-28 retry of a call that answered input_required."""
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {
        "name": TOOL, "arguments": ARGS, "inputResponses": APPROVAL,
        "requestState": ask["result"]["requestState"],
        "_meta": {"io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
                  "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}}}}}


def send_continuation(mcp: RawMcp, ask: dict, token: str, key: str, request_id: str) -> httpx.Response:
    return mcp.post(continuation(ask, request_id), {"atmost-permit": token, "idempotency-key": f'"{key}"',
                                                    "mcp-method": "tools/call", "mcp-name": TOOL})


def attempts(ledger, permit_id: str) -> list[dict]:
    return ledger.cli_json("attempts", "list", "--permit", permit_id)["attempts"]


def settled_attempt(ledger, permit_id: str) -> dict:
    """The permit's one attempt once it is no longer in flight."""
    return wait_until(lambda: next((a for a in attempts(ledger, permit_id) if a["state"] != "in_flight"), None),
                      15, "the attempt to leave in_flight")


def calls_made(ledger, permit_id: str) -> int:
    usage = ledger.cli_json("permit", "show", permit_id)["usage"]
    return usage.get(TOOL, {}).get("calls_made", 0)


class AgentWithServiceToken:
    """What an agent can do after reading the sidecar's /config_dump: call the ledger's filter
    API itself, under its own permit."""

    def __init__(self, ledger):
        self.http = httpx.Client(base_url=ledger.url, timeout=10, verify=ledger.http_verify,
                                 headers={"authorization": f"Bearer {ledger.service_token}"})

    def close(self) -> None:
        self.http.close()

    def authorize(self, token: str, key: str, continuation: bool) -> dict:
        # The fingerprint the filter sends for this tool and these arguments (RFC 8785 form).
        canonical = '{"arguments":{"amount":40,"invoice":"INV-77"},"tool":"approve_payment"}'
        body = {"permit_token": token, "tool": TOOL, "idempotency_key": key,
                "fingerprint": sha256(canonical.encode()).hexdigest(), "arguments": ARGS,
                "continuation": continuation}
        r = self.http.post("/v1/authorize", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def report(self, attempt_id: str, round_: int, capability: str, outcome: dict) -> str:
        r = self.http.post("/v1/outcomes", json={"reports": [
            {"attempt_id": attempt_id, "round": round_, "capability": capability, **outcome}]})
        assert r.status_code == 200, r.text
        [ack] = r.json()["acks"]
        return ack


RELEASED = {"outcome": "released", "reason": "never_sent: upstream.request_attempt_count=0"}


def test_a_continuation_that_never_reached_the_upstream_frees_neither_key_nor_slot(log_dir, ledger, mrtr_gateway,
                                                                                  mrtr_server, mcp):
    permit = ledger.create_permit("--max-calls", f"{TOOL}=1")
    token, key = permit["token"], new_key()
    ask = mcp.call(TOOL, ARGS, token, key).json()
    assert ask["result"]["resultType"] == "input_required", ask
    assert mrtr_server.executions("approve_payment_asked") == 1
    assert settled_attempt(ledger, permit["id"])["state"] == "awaiting_input"

    # The server is down when the continuation is sent: Envoy cannot connect (UF).
    mrtr_server.stop()
    lost = send_continuation(mcp, ask, token, key, "round-2")
    assert lost.status_code == 503, lost.text
    attempt = settled_attempt(ledger, permit["id"])
    assert attempt["state"] == "awaiting_input", attempt
    assert calls_made(ledger, permit["id"]) == 1

    restarted = ExampleServer(log_dir, port=mrtr_server.port, name="mcp-server-trust-restarted")
    restarted.start()
    try:
        # The first request again under the same key: round 1 was sent, so it is not sent again.
        again = mcp.call(TOOL, ARGS, token, key)
        assert denial_code(again) == "idempotency_in_progress", again.text
        # A new key is past the cap.
        assert denial_code(mcp.call(TOOL, ARGS, token, new_key())) == "permit_max_calls_exceeded"
        assert restarted.executions("approve_payment_asked") == 0
        assert restarted.executions("approve_payment") == 0
        assert settled_attempt(ledger, permit["id"])["state"] == "awaiting_input"
        assert calls_made(ledger, permit["id"]) == 1
    finally:
        restarted.stop()
        # The module's fixture owns the port again for the tests after this one.
        mrtr_server.start()


def test_a_late_report_of_an_earlier_round_does_not_reopen_the_attempt(ledger):
    permit = ledger.create_permit("--max-calls", f"{TOOL}=1")
    agent = AgentWithServiceToken(ledger)
    key = new_key()
    try:
        first = agent.authorize(permit["token"], key, continuation=False)
        assert (first["decision"], first["round"]) == ("dispatch", 1), first
        asked = {"outcome": "input_required", "receipt": '{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required"}}'}
        assert agent.report(first["attempt_id"], 1, first["capability"], asked) == "applied"
        second = agent.authorize(permit["token"], key, continuation=True)
        assert (second["decision"], second["attempt_id"], second["round"]) == ("dispatch", first["attempt_id"], 2)
        # Round 1's report arrives again (retried from a queue) while round 2 is in flight.
        assert agent.report(first["attempt_id"], 1, first["capability"], asked) == "stale_round"
        [attempt] = attempts(ledger, permit["id"])
        assert attempt["state"] == "in_flight"
        # So no second continuation is dispatched beside the first.
        third = agent.authorize(permit["token"], key, continuation=True)
        assert third.get("code") == "idempotency_in_progress", third
    finally:
        agent.close()


def test_an_agent_holding_the_service_token_cannot_buy_back_a_slot(ledger, mrtr_gateway, mrtr_server, mcp):
    permit = ledger.create_permit("--max-calls", f"{TOOL}=1")
    token, key = permit["token"], new_key()
    refused_before = _refused_count(ledger)
    agent = AgentWithServiceToken(ledger)
    try:
        # Round 1 goes through the gateway and is sent.
        ask = mcp.call(TOOL, ARGS, token, key).json()
        assert ask["result"]["resultType"] == "input_required", ask
        assert settled_attempt(ledger, permit["id"])["state"] == "awaiting_input"

        # The agent asks the ledger itself for the continuation: it learns the attempt id and
        # gets round 2's capability, because it created that round itself.
        own = agent.authorize(token, key, continuation=True)
        assert (own["decision"], own["round"]) == ("dispatch", 2), own
        attempt_id = own["attempt_id"]
        # Speaking for round 1, which the gateway sent: refused, whatever the capability.
        for guess in ("", "0" * 64, own["capability"]):
            assert agent.report(attempt_id, 1, guess, RELEASED) in ("refused", "stale_round")
        assert agent.report(attempt_id, 2, "f" * 64, RELEASED) == "refused"
        # Its own round 2 truly never went anywhere: the attempt waits for input again, and
        # the slot stays taken because round 1 was sent.
        assert agent.report(attempt_id, 2, own["capability"], RELEASED) == "applied"
        assert settled_attempt(ledger, permit["id"])["state"] == "awaiting_input"
        assert calls_made(ledger, permit["id"]) == 1

        # Through the gateway: no second first round, under the old key or a new one.
        assert denial_code(mcp.call(TOOL, ARGS, token, key)) == "idempotency_in_progress"
        assert denial_code(mcp.call(TOOL, ARGS, token, new_key())) == "permit_max_calls_exceeded"
        # The continuation through the gateway is the same call, finished once.
        done = send_continuation(mcp, ask, token, key, "round-3")
        assert "approved executions=1" in result_text(done), done.text
        # Now the agent replays its round-2 capability against the finished attempt: nothing.
        assert agent.report(attempt_id, 2, own["capability"], RELEASED) == "stale_round"
        assert settled_attempt(ledger, permit["id"])["state"] == "completed"
    finally:
        agent.close()
    assert mrtr_server.executions("approve_payment_asked") == 1
    assert mrtr_server.executions("approve_payment") == 1
    assert calls_made(ledger, permit["id"]) == 1
    assert _refused_count(ledger) >= refused_before + 1


def _refused_count(ledger) -> int:
    total = 0
    for line in ledger.metrics().splitlines():
        if line.startswith("atmost_outcome_reports_refused_total{"):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total
