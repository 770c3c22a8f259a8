"""A decision goes from socket to commit on one thread (docs/design.md#the-ledgers-hot-path).

The ledger reads the filter's requests, decides them and commits them on one thread, named
`atmost-decide`; its other threads (the admin API, the sweeper, the readiness check, the
blocking pool) are not on a call's path. Measured the way the kernel counts it: every thread's
voluntary context switches (its sleeps, from /proc/PID/task/*/status) before and after governed
calls sent one after another through real Envoy, on each store. A hand-off to another thread
on the path (a channel to a writer thread and a reply back, a task woken on another worker)
costs at least one switch of that thread per call.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.conftest import new_key
from tests.e2e.test_replicas import database_url, drop_schema  # noqa: F401 (fixture)
from tests.support.mcp_raw import RawMcp, result_text
from tests.support.stack import Envoy, Ledger

CALLS = 200
# The ledger's other threads wake on timers (the sweeper, the readiness check) however many
# calls there are: what they switched over an idle window as long as the calls took is
# subtracted. On the path they would switch at least once per call; beyond the idle window's
# count, the calls may wake them this many times each.
OTHER_THREADS_PER_CALL = 0.1
# The kernel keeps 15 bytes of a thread's name.
DECISION_THREAD = "atmost-decide"


def thread_switches(pid: int) -> dict[str, int]:
    """Voluntary context switches so far of each thread of `pid`, by `name/tid`."""
    switches = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended while we read
            continue
        # Voluntary switches only: each is a sleep, waiting for a socket, a lock, a disk or
        # another thread; the involuntary ones are the machine's other load preempting it.
        counts = [int(line.split()[1]) for line in status.splitlines()
                  if line.startswith("voluntary_ctxt_switches")]
        switches[f"{name}/{task.name}"] = sum(counts)
    return switches


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request, log_dir, data_root, mcp_server, database_url):
    store = request.param
    tag = f"{store}-{uuid.uuid4().hex[:6]}"
    schema = f"atmost_hot_{uuid.uuid4().hex[:10]}" if store == "postgres" else None
    ledger = Ledger(log_dir, data_root / f"ledger-hot-{tag}", name=f"ledger-hot-{tag}",
                    extra_args=["--pg-schema", schema] if schema else [])
    if schema:
        ledger.env["ATMOST_STORE"] = database_url  # the URL stays out of argv
    ledger.start()
    envoy = Envoy(log_dir, mcp_server.port, [ledger.port], name=f"envoy-hot-{tag}",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    try:
        envoy.start()
        yield ledger, envoy
    finally:
        envoy.stop()
        ledger.stop()
        if schema:
            drop_schema(database_url, schema)


def test_governed_calls_switch_only_the_decision_thread(stack, server):
    ledger, envoy = stack
    permit = ledger.create_permit(label=f"hot-{uuid.uuid4().hex[:8]}")
    client = RawMcp(envoy.url)
    try:
        # Warm: the callout connection and the store's connections are open.
        assert "executions=" in result_text(client.call("pay_invoice", {"invoice": "warm", "amount": 1},
                                                        permit["token"], new_key()))
        before = thread_switches(ledger.proc.pid)
        started = time.monotonic()
        for n in range(CALLS):
            answer = client.call("pay_invoice", {"invoice": f"hot-{n}", "amount": 1}, permit["token"], new_key())
            assert "executions=" in result_text(answer), answer.text
        took = time.monotonic() - started
        after = thread_switches(ledger.proc.pid)
    finally:
        client.close()
    # The same threads over as long with no call: their timers' share (a measurement window,
    # not a wait for anything).
    time.sleep(took)
    idle_after = thread_switches(ledger.proc.pid)
    grew = {t: after[t] - before.get(t, 0) for t in after}
    idle = {t: idle_after.get(t, after[t]) - after[t] for t in after}
    decision_threads = [t for t in grew if t.startswith(DECISION_THREAD + "/")]
    assert len(decision_threads) == 1, sorted(grew)
    [decisions] = decision_threads
    others = sum(n for t, n in grew.items() if t != decisions)
    others_idle = sum(n for t, n in idle.items() if t != decisions)
    print(f"\nvoluntary context switches over {CALLS} calls ({took:.1f} s), by thread: {grew}; "
          f"idle as long: {idle}")
    # The calls did go through the decision thread: it slept at least once per request.
    assert grew[decisions] >= CALLS, grew
    assert others - others_idle <= OTHER_THREADS_PER_CALL * CALLS, (
        f"the ledger's other threads switched {others} times over {CALLS} calls in {took:.1f} s, "
        f"{others_idle} in as long idle: {grew}; idle {idle}")
