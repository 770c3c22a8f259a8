"""PostgreSQL restarted under load (the PostgreSQL store: `atmost ledger --store postgres://…`).

The machine's shared PostgreSQL (DATABASE_URL, usually 127.0.0.1:5432) is never restarted:
the fault proxy sits between the ledger and PostgreSQL, and a "restart" is every
connection reset plus new connections refused for a while, then accepted again — what
the ledger sees when the server restarts. The ledger's tables live in a schema of their
own, dropped at the end; the checker reads the attempt rows from it directly (psql, not
through the proxy). Without DATABASE_URL or the PostgreSQL store the test fails, never skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import uuid

import pytest

from tests.faults.fault_stack import new_key
from tests.faults.test_ledger_faults import LOAD_CODES, first_ok, hold_outage, join_all, run_load
from tests.support.fault_proxy import FaultProxy
from tests.support.history import pg_rows, psql, wait_settled
from tests.support.stack import ledger_binary, wait_until


def pg_store_available() -> str | None:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")) or not shutil.which("psql"):
        return None
    try:
        help_text = subprocess.run([str(ledger_binary()), "ledger", "--help"], capture_output=True, text=True,
                                   timeout=20).stdout
    except (OSError, RuntimeError):
        return None
    return url if "--store" in help_text and "--pg-schema" in help_text else None


def through(proxy: FaultProxy, url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    auth = netloc[0] + "@" if len(netloc) == 2 else ""
    return urllib.parse.urlunsplit((parts.scheme, f"{auth}127.0.0.1:{proxy.port}", parts.path, parts.query, ""))


def test_postgres_restart_under_load(fault_stack):
    url = pg_store_available()
    if url is None:
        pytest.fail("the PostgreSQL fault scenario needs DATABASE_URL (make test-faults sets it), psql, "
                    "and `atmost ledger --store … --pg-schema`")
    parts = urllib.parse.urlsplit(url)
    assert (parts.hostname or "").startswith("127.") or parts.hostname == "localhost", "loopback PostgreSQL only"
    schema = f"atmost_faults_{uuid.uuid4().hex[:10]}"
    pg_proxy = FaultProxy(parts.port or 5432, name="pg").start()
    try:
        s = fault_stack("pg-restart", ledger_args=["--store", through(pg_proxy, url), "--pg-schema", schema])
        s.read_rows = lambda: pg_rows(url, schema)
        capped = s.permit({"pay": 6})
        free = s.permit()
        s.upstream.behave("pay", delay=0.1)
        stop = threading.Event()
        threads = run_load(s, [capped, free], ["pay", "ship"], workers=5, stop=stop)
        try:
            for outage in range(2):
                wait_until(lambda: s.upstream.executing() >= 1, 20, "calls reaching the upstream")
                pg_proxy.set_mode("refuse")
                pg_proxy.cut_all()  # the server went away: every connection reset
                # Calls that started and ended while PostgreSQL was down were refused.
                hold_outage(s.history, f"PostgreSQL down #{outage}", time.monotonic())
                pg_proxy.set_mode("pass")  # the server is back
            back = time.monotonic()
            wait_until(lambda: sum(1 for r in s.history.calls if r.started > back and r.outcome == "ok"
                                   and not r.replayed) >= 3, 30, "calls answered after the last outage")
        finally:
            stop.set()
            join_all(threads)
        # Recovered: a new key dispatches (its own execution answers it)...
        fresh = first_ok(s, free, "pay", {"invoice": "after-restart", "amount": 1}, key=new_key())
        assert fresh.outcome == "ok" and not fresh.replayed, fresh
        assert [e for e in s.upstream.snapshot() if e["rpc_id"] == fresh.rpc_id], "the new key did not dispatch"
        # ...and every completed key replays (the checker reads each key's last probe).
        s.probe_all(wait_settled(s.rows, {p.id for p in s.permits}))
        rows = s.verify(allowed_codes=LOAD_CODES, require_probes=True)
        completed = [r for r in rows if r["state"] == "completed"]
        assert completed, {r["state"] for r in rows}
        assert any(r.phase == "probe" and r.replayed for r in s.history.calls), "no completed key replayed"
        assert s.history.summary().get("denied:gateway_unavailable", 0) > 0
    finally:
        pg_proxy.stop()
        try:
            psql(url, f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            pass
