"""Faults on the ledger side: kill -9 under load, a slow ledger, a lost reply."""

from __future__ import annotations

import random
import threading
import time

from tests.faults.fault_stack import new_key
from tests.support.history import attribute, row_owners, sqlite_snapshot, wait_settled
from tests.support.stack import wait_until

LOAD_CODES = {"gateway_unavailable", "permit_max_calls_exceeded", "idempotency_in_progress", "delivery_uncertain"}


def run_load(stack, permits, tools, workers: int, stop: threading.Event, retry_share: float = 0.35, seed: int = 7,
             max_seconds: float = 120.0):
    """Concurrent workers: new keys, and same-key retries of earlier calls (the agent's two
    moves). Each calls until `stop` is set, so every fault lands while calls are in flight;
    a worker still calling after `max_seconds` gives up (`join_all` then fails the test)."""

    def worker(i: int):
        rng = random.Random(seed * 100 + i)
        mine: list[tuple] = []
        deadline = time.monotonic() + max_seconds
        while not stop.is_set() and time.monotonic() < deadline:
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


def hold_outage(history, label: str, down: float, calls: int = 3, within: float = 20.0):
    """Keeps a fault on until at least `calls` calls started and ended inside it (the load
    keeps calling), and registers the outage window: every one of them must be denied
    `gateway_unavailable`. Returns the window."""
    start = down + 0.05  # a call that met the fault on its way in may still be ending
    probe = history.expect_window(label, start, float("inf"), {"gateway_unavailable"}, min_calls=calls)
    wait_until(lambda: len(history.inside(probe)) >= calls, within,
               f"{calls} calls inside the outage {label!r}")
    probe.end = time.monotonic()
    return probe


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
    """kill -9 the ledger three times while 6 clients keep calling; restart it on the same data dir.

    Each kill waits for calls in flight: the first and the last while a tool runs at the
    upstream (their outcome reports meet a dead ledger and are sent again after the
    restart), the second while the ledger has committed reservations whose answers have
    not reached Envoy yet (held back by the proxy, then lost with the connection). While
    the ledger is down every governed call is denied `gateway_unavailable`; after the
    restart completed keys replay, and attempts whose outcome can never arrive turn
    `uncertain` once their lease has run out — never `released`.
    """
    s = fault_stack("kill9")
    capped = s.permit({"pay": 8})
    free = s.permit()
    permit_ids = {p.id for p in s.permits}
    s.upstream.behave("pay", delay=0.12)
    s.upstream.behave("ship", delay=0.04)
    stop = threading.Event()
    threads = run_load(s, [capped, free], ["pay", "ship"], workers=6, stop=stop)
    # Per kill: how it landed, when, and the attempts it left in_flight (reserved by the
    # ledger it killed, not leftovers of an earlier kill).
    kills: list[tuple[str, float, list[dict]]] = []
    started_ms = 0
    try:
        for cycle, how in enumerate(["tools running", "answers held", "tools running"]):
            if how == "tools running":
                # A `pay` (120 ms) that started under 50 ms ago is still running when the kill lands.
                wait_until(lambda: [e for e in s.upstream.running("pay") if time.monotonic() - e["at"] < 0.05], 15,
                           "a tool starting to run at the upstream")
            else:
                # The restarted ledger's connections from both workers first (see
                # callout_connections_open): under load, calls open them again.
                wait_until(s.callout_connections_open, 15, "every worker's callout connection open again")
                s.ledger_proxy.set_mode("delay_reply", delay=5.0)
                since_ms = int(time.time() * 1000)  # decided after the switch: its answer is held
                wait_until(lambda: [r for r in s.rows() if r["state"] == "in_flight"
                                    and r["permit_id"] in permit_ids and r["created_at"] >= since_ms], 15,
                           "a reservation committed and not yet answered")
            s.ledger.kill9()
            down = time.monotonic()
            s.ledger_proxy.set_mode("pass", cut=True)  # held answers die with the connection
            stranded = [r for r in sqlite_snapshot(s.data_dir) if r["state"] == "in_flight"
                        and r["permit_id"] in permit_ids and r["created_at"] >= started_ms]
            kills.append((how, down, stranded))
            # Calls that started and ended while the ledger was down were refused.
            hold_outage(s.history, f"ledger down #{cycle} ({how})", down)
            started_ms = int(time.time() * 1000)
            s.ledger.start()
        # Recovery under the same load: a few first answers after the last restart.
        restarted = time.monotonic()
        wait_until(lambda: sum(1 for r in s.history.calls if r.started > restarted and r.outcome == "ok"
                               and not r.replayed) >= 3, 20, "calls answered after the last restart")
    finally:
        stop.set()
        join_all(threads)
    s.probe_all(wait_settled(s.rows, permit_ids))
    rows = s.verify(allowed_codes=LOAD_CODES, require_probes=True)

    for how, down, stranded in kills:
        assert s.history.in_flight_at(down), f"kill with {how}: no call was in flight"
        assert stranded, f"kill with {how}: no attempt was in_flight in the store"
    final = {r["id"]: r for r in rows}
    att = attribute(s.history, s.upstream.snapshot())
    owners = row_owners(s.history, rows)
    never_answered = 0
    for how, _, stranded in kills:
        for before in stranded:
            row = final[before["id"]]
            executed = att.by_key.get(owners[row["id"]], [])
            # A late outcome report may complete an attempt that ran; nothing gives its slot back.
            assert row["state"] in ("completed", "uncertain"), (how, row)
            if row["reason"] == "lease_expired":
                assert row["updated_at"] >= row["lease_expires_at"], ("uncertain before its lease ran out", row)
            if not executed:
                never_answered += 1
                assert (row["state"], row["reason"]) == ("uncertain", "lease_expired"), (how, row)
    assert never_answered, "no kill left a reservation whose answer was lost"
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
