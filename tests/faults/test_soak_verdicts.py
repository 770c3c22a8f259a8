"""The soak's own verdicts (tests/soak/verdicts.py) on made-up rows, windows and memory samples:
each reports the violation it exists for, and what keeps the promise passes. No processes."""

from __future__ import annotations

from tests.soak.nemesis import FaultWindow
from tests.soak.verdicts import RSS_GROWTH_MIB, STUCK_GRACE_MS, explain_uncertain, rss_flat, stuck_in_flight

T0 = 1_000_000  # the run's start, wall clock ms
LEASE_MS = 6000
CALL_BOUND_MS = 5000
DC = "sent_outcome_unknown: upstream.request_attempt_count=1 response_flags=0x4000(DC)"


def window(kind: str, start_s: float, end_s: float) -> FaultWindow:
    return FaultWindow(kind, start_s, T0 + int(start_s * 1000), end_s, T0 + int(end_s * 1000))


def uncertain(at_s: float, reason: str = "lease_expired", swept_after_ms: int = 100) -> dict:
    created = T0 + int(at_s * 1000)
    updated = created + LEASE_MS + swept_after_ms if reason == "lease_expired" else created + 200
    return {"id": f"att_{at_s}", "tool": "pay", "state": "uncertain", "reason": reason, "created_at": created,
            "updated_at": updated, "lease_expires_at": created + LEASE_MS}


def explain(rows, windows):
    return explain_uncertain(rows, windows, CALL_BOUND_MS, T0)


def test_an_uncertain_attempt_is_explained_by_an_active_fault_of_a_kind_that_can_cause_it():
    figures, violations = explain([uncertain(12.0), uncertain(31.0, DC)],
                                  [window("ledger_kill", 10, 15), window("client_hangup", 30, 35)])
    assert violations == []
    assert figures["explained_by_kind"] == {"client_hangup": 1, "ledger_kill": 1}


def test_a_fault_that_began_within_a_call_of_the_dispatch_or_before_the_lease_ran_out_explains_it():
    # Dispatched 4 s before a store partition began (the call was still running), and a kill
    # 5 s into the attempt's 6 s lease: its report could not land in time.
    _, violations = explain([uncertain(6.0), uncertain(40.0)],
                            [window("store_partition", 10, 12), window("ledger_kill", 45, 46)])
    assert violations == []


def test_a_lapsed_reservation_whose_call_was_denied_by_the_filters_timeout_is_explained_by_that():
    # The filter gave up on the authorize (its key was denied gateway_unavailable) while the
    # ledger committed it: the reservation lapses to uncertain with no fault around it.
    lapsed, lost = uncertain(100.0), uncertain(200.0, DC)
    figures, violations = explain_uncertain([lapsed, lost], [], CALL_BOUND_MS, T0,
                                            frozenset({lapsed["id"], lost["id"]}))
    assert figures["explained_by_kind"] == {"callout_given_up": 1}
    assert len(violations) == 1 and lost["id"] in violations[0], violations


def test_an_uncertain_attempt_outside_every_fault_is_a_violation():
    _, violations = explain([uncertain(100.0)], [window("ledger_kill", 10, 15)])
    assert len(violations) == 1 and "explained by no fault" in violations[0] and "none" in violations[0]


def test_a_fault_of_a_kind_that_cannot_cause_the_reason_does_not_explain_it():
    # An upstream that cuts its answers leaves the filter's own report (UC, UR), never a lost
    # report; a client hanging up is DC, not a lease.
    _, violations = explain([uncertain(12.0), uncertain(31.0, DC)],
                            [window("upstream_cut", 10, 15), window("pg_failover", 30, 35)])
    assert len(violations) == 2, violations
    assert "upstream_cut@" in violations[0] and "pg_failover@" in violations[1]


def test_an_unknown_reason_is_explained_by_nothing():
    _, violations = explain([uncertain(12.0, "receipt_too_large")], [window("upstream_cut", 10, 15)])
    assert len(violations) == 1 and "receipt_too_large" in violations[0]


def test_swept_before_its_lease_ran_out_is_a_violation_even_during_a_fault():
    _, violations = explain([uncertain(12.0, swept_after_ms=-500)], [window("ledger_kill", 10, 15)])
    assert len(violations) == 1 and "before its lease ran out" in violations[0]


def test_in_flight_past_its_lease_is_stuck_within_the_sweepers_grace_it_is_not():
    now = T0 + 100_000
    rows = [{"id": "late", "tool": "pay", "state": "in_flight", "lease_expires_at": now - STUCK_GRACE_MS - 1},
            {"id": "fresh", "tool": "pay", "state": "in_flight", "lease_expires_at": now - STUCK_GRACE_MS + 500},
            {"id": "done", "tool": "pay", "state": "completed", "lease_expires_at": now - 60_000}]
    violations = stuck_in_flight(rows, now)
    assert len(violations) == 1 and violations[0].startswith("attempt late ")


def samples(component: str, pid: int, from_s: float, to_s: float, mib, step: float = 2.0) -> list:
    out, t = [], from_s
    while t <= to_s:
        out.append((t, component, pid, int(mib(t - from_s) * 1024)))
        t += step
    return out


def test_flat_memory_passes_and_growth_beyond_the_allowance_fails():
    flat = samples("envoy", 1, 0, 300, lambda t: 110 + (t % 7) * 0.1)
    growing = samples("ledger-1", 2, 0, 300, lambda t: 40 + t * 0.15)  # 45 MiB over the run
    figures, violations = rss_flat(flat + growing, ["envoy", "ledger-1"], min_span=100)
    assert figures["envoy"][0]["flat"] and not figures["ledger-1"][0]["flat"]
    assert len(violations) == 1 and violations[0].startswith("ledger-1: resident memory grew")
    assert figures["ledger-1"][0]["growth_mib"] > RSS_GROWTH_MIB


def test_start_up_growth_is_not_counted_and_each_process_is_judged_alone():
    # Fills up in its first 20 s, then flat; killed at 200 s, and the next one starts lower.
    first = samples("ledger-2", 10, 0, 200, lambda t: 20 + min(t, 20) * 1.5)
    second = samples("ledger-2", 11, 202, 400, lambda t: 30.0)
    figures, violations = rss_flat(first + second, ["ledger-2"], min_span=100)
    assert violations == [] and [e["flat"] for e in figures["ledger-2"]] == [True, True]


def test_a_process_that_never_lived_long_enough_leaves_its_memory_unjudged():
    short = samples("envoy", 1, 0, 60, lambda t: 110) + samples("envoy", 2, 62, 120, lambda t: 110)
    _, violations = rss_flat(short, ["envoy"], min_span=100)
    assert violations == ["envoy: no process lived 100 s: its memory was not judged"]
