"""A partition between the ledger and PostgreSQL in the middle of a decision's transaction.

The ledger runs on a PostgreSQL cluster this test starts itself (`track_commit_timestamp =
on`, so every attempt row tells when it was committed), behind a fault proxy. The partition
is placed exactly: a direct session holds the permit's row lock, governed calls queue behind
it (the ledger's group transaction waits on the lock, its first flight sent), the proxy then
holds everything towards PostgreSQL, and the direct session lets go. The group gets its
locks and its reads back; its writes and COMMIT are held on the way. The server sits idle in
the transaction, holding the permit's lock, until the ledger's session timeout ends it.

Fixed (the filter sends its callout timeout; the ledger runs with `--callout-timeout` equal
to it): the permit's lock is free within LOCK_BOUND of the group taking it, no attempt is
committed for a call whose callout timed out, and nothing is stranded. The control runs the
same partition with the behaviour of a filter that does not send its timeout, against a
ledger told callouts wait 30 s: the lock stays held past the bound, and the held COMMIT,
let through after the caller gave up, commits: a reservation for a call nobody dispatched.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.faults.fault_stack import CALLOUT_TIMEOUT_MS, new_key
from tests.faults.test_postgres_faults import through
from tests.support.fault_proxy import FaultProxy
from tests.support.history import key_hash, psql, recount_mismatches, wait_settled
from tests.support.pg_pair import DATABASE, PgNode, _as_pg, pg_bindir
from tests.support.stack import wait_until

SCHEMA = "atmost"
# The ledger's PostgreSQL sessions end a transaction idle for half the callout timeout
# (250 ms here); the bound leaves room for the server's timer and this test's polling.
LOCK_BOUND = 1.0
# How long the partition lasts after the group took the lock: past every caller's give-up.
PARTITION = 2.0


class PsqlSession:
    """One psql process kept open: statements run in one session, in order."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen(["psql", "-X", "-Atq", "-v", "ON_ERROR_STOP=0", url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.marks = 0

    def run(self, sql: str, timeout: float = 30.0) -> list[str]:
        """Runs `sql`; its output lines (errors included)."""
        self.marks += 1
        mark = f"--done-{self.marks}--"
        assert self.proc.stdin and self.proc.stdout
        terminated = sql if sql.rstrip().endswith(";") else sql + ";"
        self.proc.stdin.write(f"{terminated}\n\\echo {mark}\n")
        self.proc.stdin.flush()
        lines, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"psql ended: {lines}")
            if line.strip() == mark:
                return lines
            lines.append(line.strip())
        raise TimeoutError(f"psql did not answer {sql!r} within {timeout}s")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


class OwnPostgres:
    """A throwaway cluster on a loopback port, with commit timestamps."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="atmost-pg-partition-"))
        if _as_pg():
            shutil.chown(self.root, user="postgres")
        self.node = PgNode("p", self.root, pg_bindir())

    def start(self) -> "OwnPostgres":
        n = self.node
        n.run("initdb", "-D", str(n.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        with open(n.data / "postgresql.conf", "a") as conf:
            conf.write("\ntrack_commit_timestamp = on\nfsync = off\nmax_connections = 100\n")
        n.start()
        n.sql(f"CREATE DATABASE {DATABASE}", database="postgres")
        return self

    @property
    def url(self) -> str:
        return self.node.url

    def stop(self) -> None:
        self.node.kill_processes()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def own_postgres():
    if not shutil.which("psql"):
        pytest.fail("the partition scenario needs psql and the PostgreSQL server binaries")
    pg = OwnPostgres().start()
    try:
        yield pg
    finally:
        pg.stop()


def attempts(url: str) -> list[tuple[str, str, float]]:
    """(key hash, state, commit time as Unix seconds) of every attempt row."""
    out = psql(url, f"SELECT key_hash, state, extract(epoch FROM pg_xact_commit_timestamp(xmin)) "
                    f"FROM {SCHEMA}.attempts")
    rows = []
    for line in out.splitlines():
        kh, state, ts = line.split("|")
        rows.append((kh, state, float(ts)))
    return rows


def partition_mid_transaction(pg_url: str, pg_proxy: FaultProxy, permit_id: str, send_calls) -> dict:
    """Places the partition between a group's first flight and its second (module docs) while
    `send_calls()` (which starts the calls and returns their threads) runs; measures how long
    the permit's lock stays held after the group took it. Returns the figures."""
    holder, poller = PsqlSession(pg_url), PsqlSession(pg_url)
    try:
        holder.run(f"BEGIN; SELECT 1 FROM {SCHEMA}.permits WHERE id = '{permit_id}' FOR UPDATE;")
        threads = send_calls()
        # Server side, so the partition lands within a few milliseconds of the group's lock
        # wait (the ledger's lock_timeout is short).
        holder.run("DO $$ BEGIN WHILE NOT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted) LOOP "
                   "PERFORM pg_sleep(0.002); END LOOP; END $$;", timeout=20)
        pg_proxy.set_mode("hold")
        holder.run("COMMIT;")
        taken = time.monotonic()
        # The group took the lock, read, answered the ledger: now idle in its transaction,
        # its writes and COMMIT held on the way. Its session is the one that has a transaction
        # id (locking a row takes one): the sweeper's read-only transaction, caught between
        # two of its round trips by the same partition, is idle in transaction too, without.
        idle_sql = ("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'atmost-ledger' "
                    "AND state = 'idle in transaction' AND backend_xid IS NOT NULL")
        mid_transaction = False
        while not mid_transaction and time.monotonic() - taken < 0.2:
            mid_transaction = poller.run(idle_sql) == ["1"]
        lock_sql = f"SELECT 1 FROM {SCHEMA}.permits WHERE id = '{permit_id}' FOR UPDATE NOWAIT;"
        freed = None
        while time.monotonic() - taken < PARTITION:
            if poller.run(lock_sql) == ["1"]:
                freed = time.monotonic() - taken
                break
            time.sleep(0.01)
        # Every caller has given up by now; the held bytes go through (or to a closed session).
        while time.monotonic() - taken < PARTITION:
            time.sleep(0.05)
        committed = poller.run(f"SELECT count(*) FROM {SCHEMA}.attempts WHERE permit_id = '{permit_id}'")
        released_wall = time.time()
        pg_proxy.set_mode("pass")
        for t in threads:
            t.join(timeout=30)
        return {"lock_held": freed, "mid_transaction": mid_transaction, "released_wall": released_wall,
                "attempts_before_release": int(committed[0])}
    finally:
        holder.close()
        poller.close()


def test_partition_mid_transaction_commits_nothing_late_and_frees_the_lock(fault_stack, own_postgres):
    pg_proxy = FaultProxy(own_postgres.node.port, name="pg-partition").start()
    try:
        s = fault_stack("pg-partition", ledger_args=[
            "--store", through(pg_proxy, own_postgres.url), "--pg-schema", SCHEMA,
            "--callout-timeout", f"{CALLOUT_TIMEOUT_MS}ms"])
        permit = s.permit({"pay": 2})
        gave_up: dict[str, float] = {}  # key → when its client heard gateway_unavailable (Unix s)

        def one(key: str) -> None:
            r = s.call(permit, "pay", {"ref": key[-8:]}, key=key)
            if r.outcome == "denied" and r.code == "gateway_unavailable":
                gave_up[key] = time.time()

        def send_calls():
            threads = [threading.Thread(target=one, args=(new_key(),), daemon=True) for _ in range(4)]
            for t in threads:
                t.start()
            return threads

        figures = partition_mid_transaction(own_postgres.url, pg_proxy, permit.id, send_calls)
        print(f"fixed: {figures}, gave up: {len(gave_up)}")
        assert figures["mid_transaction"], "the partition did not catch a group in its transaction"
        assert figures["lock_held"] is not None and figures["lock_held"] <= LOCK_BOUND, figures
        assert gave_up, "no call's callout timed out during the partition"
        # Recovered: the ledger decides again, and the cap of 2 is whole.
        wait_until(lambda: s.call(permit, "pay", {"ref": "after"}, key=new_key(), phase="probe").outcome == "ok",
                   20, "a governed call dispatched after the partition")
        rows = attempts(own_postgres.url)
        denied = {key_hash(k): k for k in gave_up}
        late = [(denied[kh], ts - gave_up[denied[kh]]) for kh, _, ts in rows if kh in denied]
        assert not late, f"attempts committed for calls whose callout timed out (key, s after): {late}"
        settled = wait_settled(lambda: [dict(key_hash=kh, state=st, permit_id=permit.id) for kh, st, _ in
                                        attempts(own_postgres.url)], {permit.id})
        assert not [r for r in settled if r["state"] in ("in_flight", "uncertain")], settled
        assert recount_mismatches(own_postgres.url, SCHEMA) == []
        assert "atmost_decisions_past_deadline_total" in s.ledger.metrics()
        s.check_calls()
    finally:
        pg_proxy.stop()


def test_control_without_the_callers_timeout_commits_late_and_holds_the_lock(fault_stack, own_postgres):
    """What the fixed run guards against, shown by the same partition: a filter that does not
    send its timeout, a ledger told callouts wait 30 s (session timeouts of 5 s and more)."""
    pg_proxy = FaultProxy(own_postgres.node.port, name="pg-partition-control").start()
    try:
        s = fault_stack("pg-partition-control", ledger_args=[
            "--store", through(pg_proxy, own_postgres.url), "--pg-schema", SCHEMA, "--callout-timeout", "30s"])
        permit = s.permit({"pay": 2})
        key = new_key()
        gave_up: list[float] = []

        def old_filter_call() -> None:
            # A callout as a filter without the timeout header makes it, given up after the
            # fault stack's callout timeout.
            body = {"permit_token": permit.token, "tool": "pay", "idempotency_key": key,
                    "fingerprint": hashlib.sha256(key.encode()).hexdigest(), "arguments": {}}
            try:
                httpx.post(f"{s.ledger.url}/v1/authorize", json=body, timeout=CALLOUT_TIMEOUT_MS / 1000,
                           headers={"authorization": f"Bearer {s.ledger.service_token}"},
                           verify=s.ledger.ssl_context or True)
            except httpx.TimeoutException:
                gave_up.append(time.time())

        def send_calls():
            t = threading.Thread(target=old_filter_call, daemon=True)
            t.start()
            return [t]

        figures = partition_mid_transaction(own_postgres.url, pg_proxy, permit.id, send_calls)
        print(f"control: {figures}")
        assert figures["mid_transaction"], "the partition did not catch a group in its transaction"
        assert gave_up, "the control's callout did not time out"
        assert figures["lock_held"] is None or figures["lock_held"] > LOCK_BOUND, figures
        # The held COMMIT went through once the partition ended: committed after the caller
        # gave up, a slot held for a call that was never dispatched.
        wait_until(lambda: any(kh == key_hash(key) for kh, _, _ in attempts(own_postgres.url)), 10,
                   "the control's late commit")
        [(state, ts)] = [(st, ts) for kh, st, ts in attempts(own_postgres.url) if kh == key_hash(key)]
        # Not there while the COMMIT was held: committed once it went through. (The commit
        # time read is the row's last write: the sweeper's, if the short lease ran out first.)
        assert figures["attempts_before_release"] == 0, figures
        print(f"control: committed {figures['released_wall'] - gave_up[0]:.3f} s or more after its caller "
              f"gave up (row written {ts - gave_up[0]:.3f} s after), state {state}")
        assert ts > gave_up[0] and state in ("in_flight", "uncertain")
    finally:
        pg_proxy.stop()

