"""PostgreSQL fails over under load (the PostgreSQL store on a primary and a streaming standby).

The test starts its own pair of servers (tests/support/pg_pair.py: `initdb`, `pg_basebackup`,
streaming replication, `synchronous_standby_names` naming the standby) and gives the ledger
both in one URL, `postgres://…@127.0.0.1:A,127.0.0.1:B/atmost?target_session_attrs=read-write`,
so it connects to whichever accepts writes. While governed calls stream through Envoy, the
primary is killed (`kill -9` of every server process), the standby promoted
(`pg_ctl promote`) and its inherited `synchronous_standby_names` cleared, as an operator
does; later the old primary is rebuilt as the new standby and the pair fails back the same
way. The per-call history checker then finds no acknowledged decision lost, no second
dispatch, the cap kept; the counters equal a recount; every call during a switch is denied
`gateway_unavailable` and nothing else; service resumes within FAILOVER_BOUND.

The control shows what the synchronous setting buys: with the replication stream cut, a
primary on `synchronous_commit = local` acknowledges decisions the standby never gets, and
after the failover the same keys are dispatched a second time and the cap is exceeded; on
`synchronous_commit = on` the same commits wait, every call is denied `gateway_unavailable`,
and the failover loses nothing.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.faults.fault_stack import UPSTREAM_SECRET
from tests.faults.test_ledger_faults import LOAD_CODES, first_ok, join_all, run_load
from tests.support.history import (acked_completions, check, key_hash, pg_rows, recount_mismatches,
                                   wait_settled)
from tests.support.pg_pair import PgPair
from tests.support.stack import wait_until

# From the start of the standby's promotion to the first call answered again (docs/postgresql.md,
# "Failover", repeats it).
FAILOVER_BOUND = 15.0

SCHEMA = "atmost_failover"


def measured(log_dir, name: str, **numbers) -> None:
    """Appends what a run measured to the suite's log directory (failover.jsonl)."""
    with open(log_dir / "failover.jsonl", "a") as f:
        f.write(json.dumps({"test": name, **numbers}) + "\n")


def switch(s, pair, label: str) -> dict:
    """Fails the pair over while the load runs: waits for a tool running upstream (a call in
    flight), kills the primary, keeps it dead until three calls were refused (the time a
    failover manager takes to notice, here as short as the test can make it), promotes the
    standby, then waits for the first call answered again. Every call that started and ended
    between the kill and that answer must be denied `gateway_unavailable` (an outage
    window of the history)."""
    wait_until(lambda: s.upstream.executing() >= 1, 20, "a call running at the upstream")
    killed = pair.kill_primary()
    window = s.history.expect_window(label, killed + 0.05, float("inf"), {"gateway_unavailable"}, min_calls=3)
    wait_until(lambda: len([r for r in s.history.inside(window) if r.outcome == "denied"]) >= 3, 20,
               f"three calls refused after the kill ({label})")
    promoting = time.monotonic()
    new, promoted, cleared = pair.promote_standby()
    first = wait_until(lambda: next((r for r in list(s.history.calls) if r.started > promoting and r.outcome == "ok"),
                                    None), FAILOVER_BOUND, f"a call answered after the {label} (promoted {new.name})")
    window.end = first.started
    during = [r for r in list(s.history.calls) if killed < r.ended and r.started < first.started]
    return {
        "switch": label,
        "kill_to_promote_s": round(promoting - killed, 2),
        "promotion_s": round(promoted - promoting, 2),
        "clearing_s": round(cleared - promoted, 2),
        "cleared_to_first_answer_s": round(first.ended - cleared, 2),
        "promote_to_first_answer_s": round(first.ended - promoting, 2),
        "kill_to_first_answer_s": round(first.ended - killed, 2),
        "denied_during": sum(1 for r in during if r.outcome == "denied" and r.code == "gateway_unavailable"),
        "denied_after_promote": sum(1 for r in during if r.outcome == "denied" and r.ended > promoting),
        "calls_during": [(round(r.started - killed, 2), round(r.ended - killed, 2), r.outcome, r.code, r.replayed)
                         for r in during],
    }


def dispatched_since(s, moment: float) -> int:
    return sum(1 for r in list(s.history.calls) if r.started > moment and r.outcome == "ok" and not r.replayed)


def test_failover_and_failback_under_load_with_synchronous_replication(fault_stack, log_dir):
    pair = PgPair(synchronous_commit="on", name="failover").start()
    try:
        s = fault_stack("pg-failover", ledger_args=["--store", pair.url, "--pg-schema", SCHEMA])
        s.read_rows = lambda: pg_rows(pair.primary.url, SCHEMA)
        capped = s.permit({"pay": 40})
        free = s.permit()
        s.upstream.behave("pay", delay=0.08)
        s.upstream.behave("ship", delay=0.03)
        stop = threading.Event()
        threads = run_load(s, [capped, free], ["pay", "ship"], workers=4, stop=stop)
        switches = []
        try:
            wait_until(lambda: dispatched_since(s, 0) >= 5, 20, "calls dispatched before the failover")
            switches.append(switch(s, pair, "failover a -> b"))
            # The old primary comes back as the new standby, synchronous again.
            back = time.monotonic()
            pair.attach_standby(pair.a, pair.b)
            wait_until(lambda: dispatched_since(s, back) >= 5, 20, "calls dispatched while a was rebuilt")
            switches.append(switch(s, pair, "failback b -> a"))
            back = time.monotonic()
            wait_until(lambda: dispatched_since(s, back) >= 5, 20, "calls dispatched after the failback")
        finally:
            stop.set()
            join_all(threads)
        # The cap holds across both switches: new keys until the cap answers.
        deadline = time.monotonic() + 60
        while True:
            r = first_ok(s, capped, "pay", {"ref": "drain"}, phase="drain")
            if r.outcome == "denied" and r.code == "permit_max_calls_exceeded":
                break
            assert r.outcome == "ok" and time.monotonic() < deadline, r
        measured(log_dir, "failover", switches=switches, summary=s.history.summary())
        s.probe_all(wait_settled(s.rows, {p.id for p in s.permits}))
        # A group of reports commits with synchronous_commit off (docs/postgresql.md): one
        # acknowledged just before the kill may be lost with the primary, its attempt then
        # uncertain by its lease; a decision never is (every dispatch waited for the standby).
        rows = s.verify(allowed_codes=LOAD_CODES, require_probes=True, reports_may_be_lost=True)
        measured(log_dir, "failover-reports", reports_lost=len(s.history.reports_lost))
        assert recount_mismatches(pair.primary.url, SCHEMA) == []
        assert pair.primary is pair.a and not pair.a.in_recovery()
        assert [r for r in rows if r["state"] == "completed"], {r["state"] for r in rows}
    finally:
        pair.stop()


@pytest.mark.parametrize("synchronous_commit", ["local", "on"])
def test_control_a_cut_stream_loses_acknowledged_decisions_only_without_synchronous_commit(
        fault_stack, log_dir, synchronous_commit):
    """The standby stops receiving (its link is cut), the primary keeps deciding, then it
    dies and the standby is promoted: the same calls, the same keys, retried after it."""
    pair = PgPair(synchronous_commit=synchronous_commit, name=f"control-{synchronous_commit}").start()
    try:
        s = fault_stack(f"pg-cut-{synchronous_commit}", ledger_args=["--store", pair.url, "--pg-schema", SCHEMA])
        s.read_rows = lambda: pg_rows(pair.primary.url, SCHEMA)
        capped = s.permit({"pay": 3})
        free = s.permit()
        before = [s.call(free, "ship", phase="before") for _ in range(3)]
        assert all(r.outcome == "ok" for r in before), before
        wait_settled(s.rows, {free.id})  # the outcome reports landed too
        pair.wait_caught_up()  # everything so far is on the standby
        pair.cut_replication()
        cut = time.monotonic()
        # Three calls fill the cap of 3, the fourth is over it; and a call of the other permit.
        after_cut = [s.call(capped, "pay", phase="cut") for _ in range(4)] + [s.call(free, "ship", phase="cut")]
        if synchronous_commit == "local":
            wait_settled(s.rows, {capped.id, free.id})
        old = pair.primary
        new, killed = pair.fail_over()
        if synchronous_commit == "on":
            s.history.expect_window("stream cut", cut, killed, {"gateway_unavailable"}, min_calls=len(after_cut))
        first_ok(s, free, "ship", {"ref": "after"}, within=FAILOVER_BOUND)
        # The store's side: which decisions taken while the stream was cut the new primary has.
        survived = {row["key_hash"] for row in s.rows()}
        lost = [r for r in after_cut if key_hash(r.key) not in survived]
        # The client's side: the same keys again (an agent retrying), then new keys on the cap.
        retried = [s.call(capped if r.permit_id == capped.id else free, r.tool, r.arguments, r.key, phase="retry")
                   for r in after_cut]
        fresh = [s.call(capped, "pay", phase="retry") for _ in range(4)]
        rows = wait_settled(s.rows, {capped.id, free.id})
        violations = check(s.history, s.upstream.snapshot(), s.permits, UPSTREAM_SECRET,
                           store_rows=rows, acked=acked_completions([s.ledger.log_path]),
                           allowed_codes=LOAD_CODES)
        measured(log_dir, f"control-{synchronous_commit}", cut_calls=[f"{r.outcome}:{r.code}" for r in after_cut],
                 lost=len(lost), violations=len(violations), summary=s.history.summary())
        if synchronous_commit == "local":
            # The old primary acknowledged them: dispatched, answered, receipts sent...
            assert [r.outcome for r in after_cut] == ["ok", "ok", "ok", "denied", "ok"], after_cut
            assert after_cut[3].code == "permit_max_calls_exceeded"
            # ...and the new primary never heard of them.
            assert {r.rpc_id for r in lost} == {r.rpc_id for r in after_cut}, (lost, old.name)
            # So each retry is dispatched again: the cap of 3 lets 3 more through.
            assert [r.outcome for r in retried] == ["ok", "ok", "ok", "denied", "ok"], retried
            assert not any(r.replayed for r in retried), retried
            dispatched_twice = [r.key for r in after_cut if r.outcome == "ok"]
            for key in dispatched_twice:
                assert any(f"key {key} executed 2 times" in v for v in violations), violations
            assert any(f"permit {capped.id} tool pay: 6 executions over a cap of 3" in v for v in violations), \
                violations
            assert any("acknowledged completion of" in v and "lost: the attempt is gone" in v for v in violations), \
                violations
        else:
            # Every commit waited for the standby that never got it: every call was refused,
            # nothing was dispatched, so nothing acknowledged could be lost.
            assert all(r.outcome == "denied" and r.code == "gateway_unavailable" for r in after_cut), after_cut
            assert violations == [], violations
            # The retries are first decisions now: the cap of 3 holds.
            assert [r.outcome for r in retried[:3]] == ["ok"] * 3, retried
            assert recount_mismatches(pair.primary.url, SCHEMA) == []
        assert retried[3].code == "permit_max_calls_exceeded", retried
        assert all(r.code == "permit_max_calls_exceeded" for r in fresh), fresh
    finally:
        pair.stop()

