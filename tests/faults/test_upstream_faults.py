"""Faults after dispatch: the upstream resets or times out, the client leaves, Envoy dies.

In every case the call was (or may have been) sent: the attempt must end `uncertain` —
slot and budget kept, never re-sent for the same key, never `released`. Where the filter
lived to see the fault, the attempt carries the filter's own report: the Envoy response
flag that says the outcome is unknown (UC, UR, UT, DC), not a lease that ran out.

No fault here depends on the machine's speed: the upstream holds its answer (`hold`) until
the fault has happened, the client hangs up when the call has reached the upstream, and
the ledger's answer is held back until Envoy has seen the client go.
"""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest
import yaml

from tests.faults.fault_stack import UPSTREAM_SECRET, new_key
from tests.support.history import CallRecord, upstream_key
from tests.faults.test_ledger_faults import LOAD_CODES, first_ok
from tests.support.mcp_raw import OpenCall
from tests.support.stack import H2Upstream, wait_until

REPORTED = re.compile(
    r"^sent_outcome_unknown: upstream\.request_attempt_count=1 response_flags=0x[0-9a-f]+\(([A-Z,]+)\)$")


def reported_flags(row: dict) -> set[str]:
    """The Envoy response flags of the filter's report that made the attempt `uncertain`."""
    m = REPORTED.match(row["reason"] or "")
    assert m, f"the attempt is not uncertain by the filter's report of a sent call: {row}"
    return set(m.group(1).split(","))


def executions_of(s, permit, key) -> list[dict]:
    """What the upstream ran for this call, found by the key it received."""
    forwarded = upstream_key(UPSTREAM_SECRET, permit.id, key)
    return [e for e in s.upstream.snapshot() if e["upstream_key"] == forwarded]


def uncertain_after_send(s, p, key, args, expect_executions: int | None = 1):
    [row] = wait_until(lambda: s.attempts_of(p, "uncertain"), 10, "the attempt to turn uncertain")
    if expect_executions is not None:
        assert s.upstream.count("pay") == expect_executions
        assert [e["arguments"] for e in executions_of(s, p, key)] == [args] * expect_executions
    executed = s.upstream.count("pay")
    again = first_ok(s, p, "pay", args, key=key, phase="probe")
    assert (again.outcome, again.code) == ("denied", "delivery_uncertain"), again
    fresh = first_ok(s, p, "pay", {"invoice": "next", "amount": 1})
    assert (fresh.outcome, fresh.code) == ("denied", "permit_max_calls_exceeded"), fresh
    assert s.upstream.count("pay") == executed
    return row


class HangingUpClient:
    """A tools/call whose client leaves when the test says; recorded as an unknown outcome."""

    def __init__(self, s, permit, tool: str, args: dict, key: str):
        self.s, self.permit, self.tool, self.args, self.key = s, permit, tool, args, key
        self.started = time.monotonic()
        self.rpc_id = f"call-{uuid.uuid4().hex}"  # the upstream's record of it names this call
        self.call = OpenCall(s.url, tool, args, permit.token, key, request_id=self.rpc_id)

    def hang_up(self) -> None:
        self.call.hang_up()
        self.s.history.add(CallRecord(
            permit_id=self.permit.id, key=self.key, tool=self.tool, arguments=self.args, phase="load",
            outcome="unknown", error="the client hung up", started=self.started, ended=time.monotonic(),
            rpc_id=self.rpc_id))


def wait_request_gone(s) -> None:
    """Envoy has ended every request from clients, and every callout to the ledger."""
    wait_until(lambda: s.envoy.stat("http.mcp.downstream_rq_active") == 0
               and s.envoy.stat("cluster.atmost_ledger.upstream_rq_active") == 0, 10,
               "Envoy to end the request the client left")


@pytest.mark.parametrize("where", ["proxy-reset-after-request", "server-reset-after-executing", "server-close"])
def test_upstream_reset_after_receiving_the_request_is_uncertain_uc(fault_stack, where):
    """Over HTTP/1 the connection is cut after the request reached the upstream: 503, UC."""
    s = fault_stack()
    p = s.permit({"pay": 1})
    if where == "proxy-reset-after-request":
        s.upstream.behave("pay", action="hold")  # still working when the reset comes
        s.upstream_proxy.set_mode("reset_after_request")  # pooled connections obey it too
    elif where == "server-reset-after-executing":
        s.upstream.behave("pay", action="reset")
    else:
        s.upstream.behave("pay", action="close")
    key, args = new_key(), {"invoice": "reset", "amount": 3}
    r = s.call(p, "pay", args, key)
    assert (r.outcome, r.status) == ("unknown", 503), r
    wait_until(lambda: s.upstream.count("pay") == 1, 5, "the upstream to have executed the call")
    s.upstream_proxy.set_mode("pass", cut=True)
    s.upstream.reset_behaviour()
    row = uncertain_after_send(s, p, key, args)
    assert "UC" in reported_flags(row), row
    s.verify(allowed_codes=LOAD_CODES)


def envoy_to_h2_upstream(s, port: int):
    """A new Envoy for the stack whose MCP upstream is `port`, spoken to over HTTP/2 (h2c)."""
    envoy = s.new_envoy(f"envoy-{s.name}-h2")
    config = yaml.safe_load(envoy.config_path.read_text())
    [cluster] = [c for c in config["static_resources"]["clusters"] if c["name"] == "mcp_upstream"]
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"] = port
    cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    envoy.config_path.write_text(yaml.safe_dump(config))
    return envoy


def test_upstream_stream_reset_after_executing_is_uncertain_ur(fault_stack):
    """Over HTTP/2 the upstream runs the tool, then resets the call's stream: 503, UR."""
    s = fault_stack()
    h2 = H2Upstream(s.log_dir, reset=("pay",), name=f"h2-upstream-{s.name}")
    h2.start()
    merged = 0

    def merge() -> None:
        """Hands what the HTTP/2 upstream ran to the stack's record, which the checker reads."""
        nonlocal merged
        ran = h2.executions()
        s.upstream.add_executions(ran[merged:])
        merged = len(ran)

    try:
        s.envoy.stop()
        s.envoy = envoy_to_h2_upstream(s, h2.port)
        s.envoy.start()
        s.warm()
        merge()
        p = s.permit({"pay": 1})
        key, args = new_key(), {"invoice": "stream-reset", "amount": 3}
        r = s.call(p, "pay", args, key)
        assert (r.outcome, r.status) == ("unknown", 503), r
        wait_until(lambda: [e for e in h2.executions() if e["tool"] == "pay"], 5, "the upstream to run the call")
        merge()
        row = uncertain_after_send(s, p, key, args)
        assert "UR" in reported_flags(row), row
        merge()
        s.verify(allowed_codes=LOAD_CODES)
    finally:
        h2.stop()


def test_upstream_timeout_is_uncertain(fault_stack):
    """The route times out (1 s, inside the 2 s lease) while the tool still runs: 504, UT, `uncertain`."""
    s = fault_stack(route_timeout="1s")
    p = s.permit({"pay": 1})
    s.upstream.behave("pay", action="hold")
    key, args = new_key(), {"invoice": "slow-tool", "amount": 3}
    r = s.call(p, "pay", args, key)
    assert (r.outcome, r.status) == ("unknown", 504), r
    s.upstream.reset_behaviour()  # the tool finishes; its answer has nowhere to go
    row = uncertain_after_send(s, p, key, args)
    assert "UT" in reported_flags(row), row
    s.verify(allowed_codes=LOAD_CODES)


def test_client_disconnect_mid_call_is_uncertain(fault_stack):
    """The client hangs up while the tool runs: the report comes from the root context (DC)."""
    s = fault_stack()
    p = s.permit({"pay": 1})
    s.upstream.behave("pay", action="hold")
    key, args = new_key(), {"invoice": "impatient", "amount": 3}
    client = HangingUpClient(s, p, "pay", args, key)
    wait_until(lambda: s.upstream.count("pay") == 1, 10, "the call to reach the upstream")
    client.hang_up()
    wait_until(lambda: s.envoy.stat("http.mcp.downstream_rq_active") == 0, 10, "Envoy to see the client gone")
    s.upstream.reset_behaviour()
    row = uncertain_after_send(s, p, key, args)
    assert "DC" in reported_flags(row), row
    s.verify(allowed_codes=LOAD_CODES)


def test_client_disconnect_while_the_ledger_is_deciding_never_dispatches(fault_stack):
    """The client hangs up while the authorize is pending: nothing is sent; the reservation
    the ledger committed expires to `uncertain` (the filter cannot prove it unsent in time)."""
    s = fault_stack()
    p = s.permit({"pay": 1})
    assert s.call(s.permit(), "ship").outcome == "ok"
    requests_before = len(s.upstream.requests)
    # The ledger decides (and commits); its answer is held back from Envoy.
    s.ledger_proxy.set_mode("hold_reply")
    key, args = new_key(), {"invoice": "gone-early", "amount": 3}
    client = HangingUpClient(s, p, "pay", args, key)
    [reserved] = wait_until(lambda: s.attempts_of(p), 10, "the ledger to commit the reservation")
    assert reserved["state"] == "in_flight", reserved
    assert s.envoy.stat("cluster.atmost_ledger.upstream_rq_active") >= 1
    client.hang_up()
    # Envoy ended the request and cancelled its callout: nothing of this call can be sent now.
    wait_request_gone(s)
    s.ledger_proxy.set_mode("pass")
    [row] = wait_until(lambda: s.attempts_of(p, "uncertain"), 8, "the orphan to turn uncertain")
    assert row["reason"] == "lease_expired", row
    assert s.upstream.count("pay") == 0
    assert s.upstream.requests[requests_before:] == [], s.upstream.requests[requests_before:]
    assert not s.attempts_of(p, "released")
    s.verify(allowed_codes=LOAD_CODES)


def test_envoy_killed_mid_call_leaves_an_attempt_the_sweeper_makes_uncertain(fault_stack):
    """kill -9 Envoy while the tool runs: no report ever comes; the lease (2 s) runs out."""
    s = fault_stack()
    p = s.permit({"pay": 1})
    s.upstream.behave("pay", action="hold")
    key, args = new_key(), {"invoice": "envoy-dies", "amount": 3}
    t = threading.Thread(target=s.call, args=(p, "pay", args, key), kwargs={"timeout": 5}, daemon=True)
    t.start()
    wait_until(lambda: s.upstream.count("pay") == 1, 5, "the call to reach the upstream")
    s.envoy.kill9()
    t.join(10)
    assert s.history.calls[-1].outcome == "unknown"
    [row] = wait_until(lambda: s.attempts_of(p, "uncertain"), 8, "the lease to expire")
    assert row["reason"] == "lease_expired", row
    s.envoy = s.new_envoy("envoy-envoy-killed-2")
    s.envoy.start()
    s.warm()
    s.upstream.reset_behaviour()
    uncertain_after_send(s, p, key, args)
    s.verify(allowed_codes=LOAD_CODES)
