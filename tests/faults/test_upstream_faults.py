"""Faults after dispatch: the upstream resets or times out, the client leaves, Envoy dies.

In every case the call was (or may have been) sent: the attempt must end `uncertain` —
slot and budget kept, never re-sent for the same key, never `released`.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.faults.fault_stack import new_key
from tests.faults.test_ledger_faults import LOAD_CODES, first_ok
from tests.support.stack import wait_until


def uncertain_after_send(s, p, key, args, expect_executions: int | None = 1):
    [row] = wait_until(lambda: s.attempts_of(p, "uncertain"), 10, "the attempt to turn uncertain")
    if expect_executions is not None:
        assert s.upstream.count("pay") == expect_executions
    again = first_ok(s, p, "pay", args, key=key, phase="probe")
    assert (again.outcome, again.code) == ("denied", "delivery_uncertain"), again
    fresh = first_ok(s, p, "pay", {"invoice": "next", "amount": 1})
    assert (fresh.outcome, fresh.code) == ("denied", "permit_max_calls_exceeded"), fresh
    assert s.upstream.count("pay") == (expect_executions if expect_executions is not None else s.upstream.count("pay"))
    return row


@pytest.mark.parametrize("where", ["proxy-reset-after-request", "server-reset-after-executing", "server-close"])
def test_upstream_reset_after_receiving_the_request_is_uncertain(fault_stack, where):
    s = fault_stack()
    p = s.permit({"pay": 1})
    if where == "proxy-reset-after-request":
        s.upstream.behave("pay", delay=0.6)  # still working when the reset comes
        s.upstream_proxy.set_mode("reset_after_request")  # pooled connections obey it too
    elif where == "server-reset-after-executing":
        s.upstream.behave("pay", delay=0.05, action="reset")
    else:
        s.upstream.behave("pay", delay=0.05, action="close")
    key, args = new_key(), {"invoice": "reset", "amount": 3}
    r = s.call(p, "pay", args, key)
    assert r.outcome == "unknown" and r.status and r.status >= 500, r
    wait_until(lambda: s.upstream.count("pay") == 1, 5, "the upstream to have executed the call")
    s.upstream_proxy.set_mode("pass", cut=True)
    s.upstream.reset_behaviour()
    row = uncertain_after_send(s, p, key, args)
    assert "sent_outcome_unknown" in (row["reason"] or "") or row["reason"] == "lease_expired", row
    s.verify(allowed_codes=LOAD_CODES)


def test_upstream_timeout_is_uncertain(fault_stack):
    """The route times out (1 s, inside the 2 s lease) while the tool still runs: 504, UT, `uncertain`."""
    s = fault_stack(route_timeout="1s")
    p = s.permit({"pay": 1})
    s.upstream.behave("pay", delay=2.5)
    key, args = new_key(), {"invoice": "slow-tool", "amount": 3}
    r = s.call(p, "pay", args, key)
    assert (r.outcome, r.status) == ("unknown", 504), r
    row = uncertain_after_send(s, p, key, args)
    assert "UT" in (row["reason"] or ""), row
    s.verify(allowed_codes=LOAD_CODES)


def test_client_disconnect_mid_call_is_uncertain(fault_stack):
    """The client hangs up while the tool runs: the report comes from the root context (DC)."""
    s = fault_stack()
    p = s.permit({"pay": 1})
    s.upstream.behave("pay", delay=1.0)
    key, args = new_key(), {"invoice": "impatient", "amount": 3}
    r = s.call(p, "pay", args, key, timeout=0.3)
    assert r.outcome == "unknown", r
    row = uncertain_after_send(s, p, key, args)
    assert "DC" in (row["reason"] or "") or row["reason"] == "lease_expired", row
    s.verify(allowed_codes=LOAD_CODES)


def test_client_disconnect_while_the_ledger_is_deciding_never_dispatches(fault_stack):
    """The client hangs up while the authorize is pending: nothing is sent; a reservation the
    ledger committed anyway expires to `uncertain` (the filter cannot prove it unsent in time)."""
    s = fault_stack()
    p = s.permit({"pay": 1})
    assert s.call(s.permit(), "ship").outcome == "ok"
    s.ledger_proxy.set_mode("delay", delay=1.0)
    key, args = new_key(), {"invoice": "gone-early", "amount": 3}
    r = s.call(p, "pay", args, key, timeout=0.2)
    assert r.outcome == "unknown", r
    wait_until(lambda: s.attempts_of(p), 5, "the late reservation")
    s.ledger_proxy.set_mode("pass")
    wait_until(lambda: s.attempts_of(p, "uncertain"), 8, "the orphan to turn uncertain")
    time.sleep(0.3)
    assert s.upstream.count("pay") == 0
    assert not s.attempts_of(p, "released")
    s.verify(allowed_codes=LOAD_CODES)


def test_envoy_killed_mid_call_leaves_an_attempt_the_sweeper_makes_uncertain(fault_stack):
    """kill -9 Envoy while the tool runs: no report ever comes; the lease (2 s) runs out."""
    s = fault_stack()
    p = s.permit({"pay": 1})
    s.upstream.behave("pay", delay=1.5)
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
