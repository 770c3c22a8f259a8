"""The checker itself, on small made-up histories: each rule reports the violation it
exists for, and a history that keeps every promise passes. No processes are started."""

from __future__ import annotations

import pytest

from tests.support.history import CallRecord, History, Permit, check, key_hash, upstream_key

SECRET = "checker-secret"
PERMIT = Permit("pmt_a", "atmp_pmt_a", {"pay": 2})


def record(h: History, rpc: str, key: str, outcome: str, code: str | None = None, nonce: str | None = None,
           replayed: bool = False, args: dict | None = None, phase: str = "load", at: float = 1.0) -> CallRecord:
    text = f"pay executed nonce={nonce}" if nonce else None
    return h.add(CallRecord(permit_id=PERMIT.id, key=key, tool="pay", arguments=args or {"invoice": key},
                            phase=phase, outcome=outcome, code=code, text=text, replayed=replayed, started=at,
                            ended=at + 0.1, rpc_id=rpc))


def execution(n: int, r: CallRecord, nonce: str, args: dict | None = None, key: str | None = None) -> dict:
    return {"n": n, "nonce": nonce, "tool": r.tool, "arguments": args if args is not None else r.arguments,
            "rpc_id": r.rpc_id, "upstream_key": upstream_key(SECRET, r.permit_id, key or r.key)}


def row(attempt: str, key: str, state: str, receipt: str | None = None) -> dict:
    return {"id": attempt, "permit_id": PERMIT.id, "tool": "pay", "key_hash": key_hash(key), "state": state,
            "receipt": receipt, "reason": None, "created_at": 0, "updated_at": 0, "lease_expires_at": 0}


def good_history() -> tuple[History, list[dict], list[dict]]:
    """k1: answered, then replayed; k2: unknown, then denied as uncertain; k3: denied."""
    h = History("made-up")
    first = record(h, "c1", "k1", "ok", nonce="aaaaaaaaaaaa")
    record(h, "c2", "k1", "ok", nonce="aaaaaaaaaaaa", replayed=True, phase="probe")
    lost = record(h, "c3", "k2", "unknown")
    record(h, "c4", "k2", "denied", code="delivery_uncertain", phase="probe")
    record(h, "c5", "k3", "denied", code="permit_max_calls_exceeded")
    executions = [execution(1, first, "aaaaaaaaaaaa"), execution(2, lost, "bbbbbbbbbbbb")]
    rows = [row("att_1", "k1", "completed", '{"text":"pay executed nonce=aaaaaaaaaaaa"}'),
            row("att_2", "k2", "uncertain")]
    return h, executions, rows


def violations(h, executions, rows=None, acked=None) -> list[str]:
    return check(h, executions, [PERMIT], SECRET, store_rows=rows, acked=acked)


def test_a_history_that_keeps_every_promise_passes_and_is_counted():
    h, executions, rows = good_history()
    assert violations(h, executions, rows, {"att_1"}) == []
    assert h.checks == [("calls+store", 5)]


def test_a_denied_call_never_executes_even_after_an_unknown_call_of_its_key():
    h, executions, rows = good_history()
    denied = next(r for r in h.calls if r.rpc_id == "c4")
    executions[1] = execution(2, denied, "bbbbbbbbbbbb")  # the unknown call never ran; the denied one did
    v = violations(h, executions, rows, {"att_1"})
    assert any("c4" in x and "was denied delivery_uncertain but executed" in x for x in v), v


def test_a_replayed_call_never_executes():
    h, executions, rows = good_history()
    replay = next(r for r in h.calls if r.rpc_id == "c2")
    executions.append(execution(3, replay, "cccccccccccc"))
    v = violations(h, executions, rows, {"att_1"})
    assert any("c2" in x and "replay but executed" in x for x in v), v
    assert any("key k1 executed 2 times" in x for x in v), v


def test_executed_arguments_are_the_calls_arguments():
    h, executions, rows = good_history()
    executions[0]["arguments"] = {"invoice": "k1", "amount": 1000}
    v = violations(h, executions, rows, {"att_1"})
    assert any("c1" in x and "ran with arguments" in x for x in v), v


def test_an_execution_of_no_call_or_under_another_key_is_reported():
    h, executions, rows = good_history()
    stray = dict(executions[0], n=3, rpc_id="nobody")
    executions[1]["upstream_key"] = upstream_key(SECRET, PERMIT.id, "k1")
    v = violations(h, executions + [stray], rows, {"att_1"})
    assert any("unchecked dispatch: execution #3" in x for x in v), v
    assert any("c3" in x and "carries upstream key" in x for x in v), v


def test_a_first_answer_is_its_own_executions_answer():
    h, executions, rows = good_history()
    executions[0]["nonce"] = "dddddddddddd"
    v = violations(h, executions, rows, {"att_1"})
    assert any("c1" in x and "is not its execution's answer" in x for x in v), v


@pytest.mark.parametrize("broken", ["no rows", "key hashing changed", "no acked completion", "no calls"])
def test_empty_inputs_are_violations(broken):
    h, executions, rows = good_history()
    acked = {"att_1"}
    if broken == "no rows":
        rows = []
    elif broken == "key hashing changed":
        rows = [dict(r, key_hash=key_hash(r["id"])) for r in rows]
    elif broken == "no acked completion":
        acked = set()
    else:
        h, executions = History("empty"), []
    expected = {"no rows": "the store holds no attempt", "key hashing changed": "matches no key",
                "no acked completion": "no acknowledged completion", "no calls": "holds no call"}[broken]
    v = violations(h, executions, rows, acked)
    assert any(expected in x for x in v), v


def test_a_key_never_probed_after_recovery_is_a_violation_when_probes_are_required():
    h, executions, rows = good_history()
    h.calls = [r for r in h.calls if r.rpc_id != "c2"]  # k1 completed, never probed
    assert violations(h, executions, rows, {"att_1"}) == []
    v = check(h, executions, [PERMIT], SECRET, store_rows=rows, acked={"att_1"}, require_probes=True)
    assert v == ["completed key k1 was never probed after recovery"], v


def test_a_probe_that_is_its_keys_first_dispatch_answers_with_its_own_execution():
    # k4's load call was denied by the filter's timeout and nothing was committed: the probe
    # dispatches it, once. Answered with a replay's text but without being one, it is not.
    h, executions, rows = good_history()
    record(h, "c6", "k4", "denied", code="gateway_unavailable")
    probe = record(h, "c7", "k4", "ok", nonce="cccccccccccc", phase="probe")
    executions.append(execution(3, probe, "cccccccccccc"))
    rows.append(row("att_4", "k4", "completed", '{"text":"pay executed nonce=cccccccccccc"}'))
    roomy = [Permit(PERMIT.id, PERMIT.token, {"pay": 3})]
    assert check(h, executions, roomy, SECRET, store_rows=rows, acked={"att_1", "att_4"}) == []
    executions.pop()
    v = check(h, executions, roomy, SECRET, store_rows=rows, acked={"att_1", "att_4"})
    assert "completed key k4 did not replay after recovery: ok/None" in v, v


def test_a_window_that_holds_too_few_calls_is_a_violation():
    h, executions, rows = good_history()
    h.expect_window("empty", 50.0, 60.0, {"gateway_unavailable"})
    h.expect_window("two of three", 0.5, 1.2, {"gateway_unavailable", "delivery_uncertain",
                                               "permit_max_calls_exceeded"}, min_calls=6)
    v = violations(h, executions, rows, {"att_1"})
    assert any("window empty: 0 calls" in x for x in v), v
    assert any("window two of three: 5 calls" in x for x in v), v
    assert any("window two of three: call k1 got ok" in x for x in v), v


def test_an_executed_key_without_its_attempt_is_a_lost_decision():
    h, executions, rows = good_history()
    rows = [r for r in rows if r["id"] != "att_2"]  # k2 executed; its attempt is gone
    v = violations(h, executions, rows, {"att_1"})
    assert v == ["key k2 executed (executions [2]) but the store holds no attempt of it: the decision to dispatch "
                 "was lost"], v


def test_a_lost_report_may_end_uncertain_only_where_the_store_may_lose_it():
    # The ledger acknowledged k2's completion, and then the store lost it (an asynchronous
    # commit gone with a crashed primary): the attempt ended uncertain by its lease.
    h, executions, rows = good_history()
    rows[1]["reason"] = "lease_expired"
    acked = {"att_1", "att_2"}
    assert violations(h, executions, rows, acked) == ["acknowledged completion of att_2 lost: now uncertain"]
    assert check(h, executions, [PERMIT], SECRET, store_rows=rows, acked=acked, reports_may_be_lost=True) == []
    assert h.reports_lost == ["att_2"]
    # Never given back, never gone, never uncertain for another reason.
    for state, reason in (("released", None), ("uncertain", "reported: UC")):
        rows[1].update(state=state, reason=reason)
        v = check(h, executions, [PERMIT], SECRET, store_rows=rows, acked=acked, reports_may_be_lost=True)
        assert f"acknowledged completion of att_2 lost: now {state}" in v, v
    v = check(h, executions, [PERMIT], SECRET, store_rows=rows[:1], acked=acked, reports_may_be_lost=True)
    assert "acknowledged completion of att_2 lost: the attempt is gone" in v, v
