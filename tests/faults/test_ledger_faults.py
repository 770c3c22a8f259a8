"""Faults on the ledger side: kill -9 under load, a slow ledger, a lost reply."""

from __future__ import annotations

import random
import threading
import time

from tests.faults.fault_stack import new_key
from tests.faults.history import wait_settled
from tests.support.stack import wait_until

LOAD_CODES = {"gateway_unavailable", "permit_max_calls_exceeded", "idempotency_in_progress", "delivery_uncertain"}


def run_load(stack, permits, tools, workers: int, calls_each: int, stop: threading.Event, retry_share: float = 0.35,
             seed: int = 7):
    """Concurrent workers: new keys, and same-key retries of earlier calls (the agent's two moves)."""

    def worker(i: int):
        rng = random.Random(seed * 100 + i)
        mine: list[tuple] = []
        for _ in range(calls_each):
            if stop.is_set():
                return
            if mine and rng.random() < retry_share:
                permit, tool, args, key = rng.choice(mine)
            else:
                permit, tool = rng.choice(permits), rng.choice(tools)
                key = new_key()
                args = {"ref": key[-8:], "amount": rng.randint(1, 9)}
                mine.append((permit, tool, args, key))
            stack.call(permit, tool, args, key, timeout=5)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    return threads


def first_ok(stack, permit, tool, args, within: float = 5.0, key: str | None = None, phase: str = "recovery"):
    """After a fault heals, Envoy may still fail a callout or two on a connection it has not
    yet noticed is gone: those are denied `gateway_unavailable` (nothing sent). Retries with
    new keys (or the same `key`: a same-key retry is always safe) until one passes."""
    deadline = time.monotonic() + within
    while True:
        r = stack.call(permit, tool, args, key or new_key(), phase=phase)
        if r.outcome != "denied" or r.code != "gateway_unavailable" or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def join_all(threads, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.1))
    assert not any(t.is_alive() for t in threads), "workload threads did not finish in time"


def test_ledger_kill9_before_during_and_after_commits_under_concurrent_load(fault_stack):
    """kill -9 the ledger three times while 6 clients call; restart it on the same data dir.

    The kills land at random points of the calls: before an authorize committed, between
    the commit and the answer, while a completion report is being written, after it.
    While the ledger is down every governed call is denied `gateway_unavailable`; after the
    restart completed keys replay, and attempts whose outcome never arrived turn
    `uncertain` through the lease sweeper — never `released`.
    """
    s = fault_stack("kill9")
    capped = s.permit({"pay": 8})
    free = s.permit()
    s.upstream.behave("pay", delay=0.12)
    s.upstream.behave("ship", delay=0.04)
    stop = threading.Event()
    threads = run_load(s, [capped, free], ["pay", "ship"], workers=6, calls_each=45, stop=stop)
    try:
        for cycle in range(3):
            time.sleep(0.8)
            s.ledger.kill9()
            down = time.monotonic()
            time.sleep(0.9)
            # Calls that started and ended while the ledger was down were refused.
            s.history.expect_window(f"ledger down #{cycle}", down + 0.05, time.monotonic(), {"gateway_unavailable"})
            s.ledger.start()
    finally:
        time.sleep(0.5)
        stop.set()
        join_all(threads)
    wait_settled(s.data_dir, {p.id for p in s.permits})
    s.probe_all()
    rows = s.verify(allowed_codes=LOAD_CODES)
    states = {r["state"] for r in rows}
    assert "completed" in states, states
    outcomes = s.history.summary()
    assert outcomes.get("denied:gateway_unavailable", 0) > 0, outcomes
    assert any(r.phase == "probe" and r.replayed for r in s.history.calls), "no completed key replayed after restart"


def test_slow_ledger_times_out_the_callout_and_the_late_reservation_turns_uncertain(fault_stack):
    """The authorize reaches the ledger after the filter gave up (500 ms): the client was
    denied `gateway_unavailable`, the tool never ran, and the reservation the ledger
    committed late is an orphan the sweeper turns `uncertain` — never `released`. Its slot
    stays held: the conservative, honest outcome."""
    s = fault_stack("slow-ledger")
    p = s.permit({"pay": 1})
    assert s.call(s.permit(), "ship").outcome == "ok"  # the h2 connection to the ledger is up
    s.ledger_proxy.set_mode("delay", delay=1.5)
    key, args = new_key(), {"invoice": "slow-1", "amount": 5}
    started = time.monotonic()
    r = s.call(p, "pay", args, key)
    assert (r.outcome, r.code) == ("denied", "gateway_unavailable"), r
    assert time.monotonic() - started < 1.4, "the callout timeout did not cut the wait short"
    # The request reaches the ledger late and commits there (the reset of the stream is held back longer).
    [late] = wait_until(lambda: s.attempts_of(p, None) or None, 6, "the late reservation")
    s.ledger_proxy.set_mode("pass")
    assert late["tool"] == "pay"
    wait_until(lambda: s.attempts_of(p, "uncertain"), 8, "the orphaned reservation to turn uncertain")
    [row] = s.attempts_of(p)
    assert row["state"] == "uncertain" and row["reason"] == "lease_expired", row
    assert s.upstream.count("pay") == 0
    # The same key is the same unknown; a new key finds the slot held.
    again = s.call(p, "pay", args, key, phase="probe")
    assert (again.outcome, again.code) == ("denied", "delivery_uncertain")
    other = s.call(p, "pay", {"invoice": "slow-2", "amount": 5})
    assert (other.outcome, other.code) == ("denied", "permit_max_calls_exceeded")
    s.verify(allowed_codes=LOAD_CODES)


def test_lost_ledger_reply_denies_and_the_reservation_turns_uncertain(fault_stack):
    """The ledger commits the reservation but its answer never reaches Envoy."""
    s = fault_stack("reply-lost")
    p = s.permit({"pay": 2})
    # On the open connections (warmed up): requests still arrive, answers vanish.
    s.ledger_proxy.set_mode("drop_reply")
    key, args = new_key(), {"invoice": "lost-1", "amount": 5}
    r = s.call(p, "pay", args, key)
    assert (r.outcome, r.code) == ("denied", "gateway_unavailable"), r
    s.ledger_proxy.set_mode("pass", cut=True)
    wait_until(lambda: s.attempts_of(p, "uncertain"), 8, "the unanswered reservation to turn uncertain")
    assert s.upstream.count("pay") == 0
    again = first_ok(s, p, "pay", args, key=key, phase="probe")
    assert (again.outcome, again.code) == ("denied", "delivery_uncertain")
    # The gateway works again for new keys; the held slot counts.
    assert first_ok(s, p, "pay", {"invoice": "lost-2", "amount": 5}).outcome == "ok"
    assert first_ok(s, p, "pay", {"invoice": "lost-3", "amount": 5}).code == "permit_max_calls_exceeded"
    s.verify(allowed_codes=LOAD_CODES)
