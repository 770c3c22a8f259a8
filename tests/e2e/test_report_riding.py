"""`report_ride_ms` end to end: real Envoy, the real ledger (embedded SQLite and PostgreSQL)
and the example MCP server, with `answer_release: "at_once"`.

A released call's report waits in its worker for the next call and rides on that call's
authorize: the ledger applies it beside the decision and acknowledges it in the answer, so a
steady run of calls costs one callout each. The last call's report leaves on its own once it
has waited `report_ride_ms`. Until its report lands an attempt stays `in_flight`: a same-key
retry gets `idempotency_in_progress`, and an Envoy killed with the report waiting leaves the
attempt to its lease (docs/design.md#reports-riding-on-the-next-authorize).

The PostgreSQL stack needs DATABASE_URL (`make test` provides it, see scripts/with-postgres);
without it that stack fails, it never skips.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.e2e.conftest import new_key
from tests.e2e.test_answer_release import ReleaseFirstStack, left_to_its_lease, started
from tests.e2e.test_open_doors import metric
from tests.support.mcp_raw import RawMcp, denial, result_text
from tests.support.stack import wait_until

# The longest wait there is: the last call's report is still waiting while the test looks.
RIDE_MS = 5000


class RidingStack(ReleaseFirstStack):
    """ReleaseFirstStack, its filter's reports riding on the next authorize."""

    NAME = "ride"
    PLUGIN = {"report_ride_ms": RIDE_MS}

    def state_of(self, attempt_id: str) -> str:
        return self.shown(attempt_id)["state"]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request, log_dir, data_root, mcp_server):
    yield from started(RidingStack, request, log_dir, data_root, mcp_server)


@pytest.fixture
def riding_server(mcp_server, stack):
    """The example server, counters zeroed, both proxies passing traffic, and every report
    of the warm-up calls landed (they ride too, or leave after their wait)."""
    mcp_server.reset()
    stack.ledger_proxy.set_mode("pass")
    stack.upstream_proxy.set_mode("pass")
    wait_until(lambda: all(a["state"] != "in_flight" for a in
                           stack.ledger.cli_json("attempts", "list")["attempts"]),
               RIDE_MS / 1000 + 15, "the warm-up calls' reports to land")
    return mcp_server


def rode(stack: RidingStack) -> float:
    return metric(stack.ledger, "atmost_outcome_reports_ridden_total", '{result="taken"}')


def test_each_report_rides_on_the_next_call_and_the_last_leaves_after_its_wait(stack, riding_server):
    server = riding_server
    permit = stack.ledger.create_permit(label=f"ride-{uuid.uuid4().hex[:6]}")
    rode_before = rode(stack)
    stats_before = stack.envoy.stats()
    client = RawMcp(stack.envoy.url)  # one connection: one worker, whose next call takes the report
    try:
        for n in range(1, 6):
            answer = client.call("pay_invoice", {"invoice": f"inv-ride-{n}", "amount": n},
                                 permit["token"], new_key())
            assert answer.status_code == 200 and denial(answer) is None, answer.text
            assert f"executions={n}" in result_text(answer)
        released = time.monotonic()
        rows = sorted(stack.attempts(permit), key=lambda a: a["created_at"])
    finally:
        client.close()
    # Call n's answer came after its authorize, which carried call n-1's report: the ledger
    # applied it before answering. The last one's waits for a call that does not come.
    assert [a["state"] for a in rows] == ["completed"] * 4 + ["in_flight"], rows
    assert rode(stack) - rode_before == 4
    stats = stack.envoy.stats()

    def delta(name: str) -> int:
        return stats.get(f"wasmcustom.{name}", 0) - stats_before.get(f"wasmcustom.{name}", 0)

    assert delta("atmost_report_rode") == 4
    assert delta("atmost_report_ride_missed") == 0
    # Five calls, five authorize callouts, and not one batch of reports beside them.
    assert delta("atmost_report_batch_sent") == 0 and delta("atmost_report_batch_failed") == 0

    # Once it has waited report_ride_ms, the last report leaves in a batch of its own.
    wait_until(lambda: stack.state_of(rows[4]["id"]) == "completed", RIDE_MS / 1000 + 15,
               "the last report to leave after its wait")
    waited = time.monotonic() - released
    assert waited >= RIDE_MS / 1000 - 0.5, f"the report left after {waited:.1f} s"
    stats = stack.envoy.stats()
    assert delta("atmost_report_batch_sent") == 1
    assert rode(stack) - rode_before == 4
    assert server.executions("pay_invoice") == 5


def test_envoy_killed_with_a_report_waiting_leaves_the_attempt_to_its_lease(stack, riding_server):
    server = riding_server
    permit = stack.ledger.create_permit(label=f"ride-kill-{uuid.uuid4().hex[:6]}")
    key = new_key()
    args = {"invoice": "inv-ride-killed", "amount": 4}
    client = RawMcp(stack.envoy.url)
    try:
        answer = client.call("pay_invoice", args, permit["token"], key)
    finally:
        client.close()
    assert answer.status_code == 200 and "executions=1" in result_text(answer), answer.text
    # The client has its answer; the report waits in the worker for a call.
    [attempt] = stack.attempts(permit)
    assert attempt["state"] == "in_flight", attempt

    # Envoy dies with it: nothing delivers it, and the lease decides.
    stack.envoy.kill9()
    left_to_its_lease(stack, server, permit, attempt["id"], args, key)
