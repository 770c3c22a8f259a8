"""PostgreSQL restarted under load (the PostgreSQL store: `atmost ledger --store postgres://…`).

The machine's shared PostgreSQL (DATABASE_URL, usually 127.0.0.1:5432) is never restarted:
the fault proxy sits between the ledger and PostgreSQL, and a "restart" is every
connection reset plus new connections refused for a while, then accepted again — what
the ledger sees when the server restarts. Skipped until the PostgreSQL store has landed
(`atmost ledger --help` shows `--store`) and DATABASE_URL is set.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import urllib.parse

import pytest

from tests.faults.test_ledger_faults import LOAD_CODES, join_all, run_load
from tests.support.fault_proxy import FaultProxy
from tests.support.stack import ledger_binary


def pg_store_available() -> str | None:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        return None
    try:
        help_text = subprocess.run([str(ledger_binary()), "ledger", "--help"], capture_output=True, text=True,
                                   timeout=20).stdout
    except (OSError, RuntimeError):
        return None
    return url if "--store" in help_text else None


def through(proxy: FaultProxy, url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    auth = netloc[0] + "@" if len(netloc) == 2 else ""
    return urllib.parse.urlunsplit((parts.scheme, f"{auth}127.0.0.1:{proxy.port}", parts.path, parts.query, ""))


def test_postgres_restart_under_load(fault_stack):
    url = pg_store_available()
    if url is None:
        pytest.fail("the PostgreSQL fault scenario needs DATABASE_URL (make test-faults sets it) and `atmost ledger --store`")
    parts = urllib.parse.urlsplit(url)
    assert (parts.hostname or "").startswith("127.") or parts.hostname == "localhost", "loopback PostgreSQL only"
    pg_proxy = FaultProxy(parts.port or 5432, name="pg").start()
    try:
        s = fault_stack("pg-restart", ledger_args=["--store", through(pg_proxy, url)])
        capped = s.permit({"pay": 6})
        free = s.permit()
        s.upstream.behave("pay", delay=0.1)
        stop = threading.Event()
        threads = run_load(s, [capped, free], ["pay", "ship"], workers=5, calls_each=30, stop=stop)
        try:
            for _ in range(2):
                time.sleep(0.8)
                pg_proxy.set_mode("refuse")
                pg_proxy.cut_all()  # the server went away: every connection reset
                time.sleep(1.0)
                pg_proxy.set_mode("pass")  # the server is back
        finally:
            time.sleep(0.8)
            stop.set()
            join_all(threads)
        time.sleep(3)  # lease 2 s + sweep
        s.probe_all()
        # The store is PostgreSQL: the checker runs without the SQLite view of attempts.
        from tests.faults.fault_stack import UPSTREAM_SECRET
        from tests.faults.history import assert_invariants
        assert_invariants(s.history, s.upstream.snapshot(), s.permits, UPSTREAM_SECRET, allowed_codes=LOAD_CODES)
        assert s.history.summary().get("ok", 0) > 0
    finally:
        pg_proxy.stop()
