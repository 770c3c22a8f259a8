"""A rolling upgrade of the ledger across a schema version, under load (docs/postgresql.md, "Upgrades").

Two replicas of the current build share one PostgreSQL schema behind Envoy's ledger cluster
(the shipped sidecar config: /readyz health checks, no panic routing). Workers send governed
`tools/call`s through Envoy the whole time: new keys, repeated keys (replays), enough calls to
cross a per-tool cap. Replica B is replaced by the next build (`target/debug/atmost-next`, the
`schema-rehearsal` feature: one more, additive migration): SIGTERM, and the replica drains
(/readyz 503, every call still served) until Envoy's health check has taken it out of the
ledger cluster while it still runs; then it stops, and the next build starts on the same port,
migrates the database to the next version while A still serves. Both serve side by side, then
A is replaced too. No call is denied gateway_unavailable: every call is dispatched, replayed or
denied by the cap; the per-call history checker
(tests/support/history.py) finds no lost attempt and no double dispatch; the stored counters
equal a recount. A second test shows the rule's other side: a database that needs a newer
ledger is refused at start (exit status 3), an additively newer one is served.

These tests need DATABASE_URL (`make test` provides it) and the next build (`make ledger-next`,
a prerequisite of `make test-e2e`). Without them they fail; they never skip.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sqlite3
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_replicas import authorize_counts, database_url, drop_schema, total  # noqa: F401 (fixture)
from tests.support.history import (CallRecord, History, Permit, acked_completions, assert_invariants, pg_rows, psql,
                                   recount_mismatches, row_owners, wait_settled)
from tests.support.recording_upstream import RecordingUpstream
from tests.support.stack import ROOT, Envoy, Ledger, free_port, http_get, ledger_binary, wait_until

UPSTREAM_SECRET = "upgrade-upstream-secret-0123456789"
RELEASED_SCHEMA = 13
NEXT_SCHEMA = 14
# The oldest schema version a ledger may know and serve on both: versions 13 and 14 only add.
OLDEST_SERVING = 12
WORKERS = 4
# Calls each replica must decide after a swap before the next step: both versions served.
CALLS_PER_STEP = 40
# The loop bound: a worker stops after this many calls or this long, whatever happens.
MAX_CALLS_PER_WORKER = 2000
MAX_LOAD_SECONDS = 240.0
# The replaced replicas' drain delay: far longer than Envoy's health check needs to take a
# draining replica out (2 failures 2 s apart). The test ends the drain with a second SIGTERM
# once it has seen that happen, so the order is checked, not hoped for.
DRAIN_DELAY = "120s"
# Calls the other replica must decide after Envoy took the draining one out, before it stops:
# the gateway's workers have moved on.
CALLS_AFTER_TAKEN_OUT = 10


def next_binary() -> Path:
    path = Path(os.environ.get("ATMOST_NEXT_BIN", ROOT / "target" / "debug" / "atmost-next"))
    if not path.is_absolute():
        path = ROOT / path
    if not path.exists():
        pytest.fail(f"{path} is missing: `make ledger-next` builds it (a prerequisite of `make test-e2e`)")
    return path


def documented_codes() -> set[str]:
    """The atmost error codes the README's table lists (JSON-RPC codes -31001 to -310xx)."""
    readme = (ROOT / "README.md").read_text()
    codes = set(re.findall(r"^\| `([a-z_]+)` \| -310\d\d \|", readme, re.M))
    assert "permit_max_calls_exceeded" in codes and "gateway_unavailable" in codes, codes
    return codes


def replica(log_dir: Path, data_dir: Path, url: str, schema: str, name: str, port: int | None = None,
            binary: Path | None = None, drain_delay: str = "0s") -> Ledger:
    """A replica on the schema; `drain_delay` for one the test will replace (0: it stops at once)."""
    ledger = Ledger(log_dir, data_dir, port=port, name=name,
                    extra_args=["--pg-schema", schema, "--sweep-interval", "200ms", "--pg-pool-size", "8",
                                "--drain-delay", drain_delay])
    if binary is not None:
        ledger.argv[0] = str(binary)
    ledger.env["ATMOST_STORE"] = url  # the URL stays out of argv
    return ledger


def schema_versions(url: str, schema: str) -> list[tuple[int, int]]:
    out = psql(url, f"SELECT version, compatible_from FROM {schema}.atmost_migrations ORDER BY version")
    return [tuple(int(x) for x in line.split("|")) for line in out.split()]


class Load:
    """Workers calling through the gateway until told to stop (bounded in calls and time):
    new keys on a capped and an uncapped permit, and same-key retries of their own earlier
    calls. Each call is recorded in the history with the phase it started in."""

    def __init__(self, url: str, history: History, permits: list[Permit], tools: list[str]):
        self.url, self.history, self.permits, self.tools = url, history, permits, tools
        self.phase = "before"
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(WORKERS)]

    def _work(self, worker: int) -> None:
        rng = random.Random(worker)
        mine: list[tuple[Permit, str, dict, str]] = []
        deadline = time.monotonic() + MAX_LOAD_SECONDS
        for n in range(MAX_CALLS_PER_WORKER):
            if self.stop.is_set() or time.monotonic() > deadline:
                return
            if mine and rng.random() < 0.3:
                permit, tool, args, key = rng.choice(mine)
            else:
                permit, tool = self.permits[n % len(self.permits)], rng.choice(self.tools)
                key = f"up-{worker}-{uuid.uuid4().hex}"
                args = {"ref": key[-8:], "amount": rng.randint(1, 9)}
                mine.append((permit, tool, args, key))
            self.history.call(self.url, permit, tool, args, key, phase=self.phase, timeout=10)

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in self.threads), "a worker did not stop"


def taken_out_by_health_check(envoy: Envoy, ledger: Ledger) -> bool:
    """Envoy's admin /clusters shows the ledger's host failed by the active health check."""
    clusters = http_get(envoy.admin_url + "/clusters")[1].decode()
    flags = f"atmost_ledger::127.0.0.1:{ledger.port}::health_flags::"
    return any(line.startswith(flags) and "failed_active_hc" in line for line in clusters.splitlines())


def swap(old: Ledger, other: Ledger, log_dir: Path, url: str, schema: str, binary: Path, envoy: Envoy,
         started: list[Ledger]) -> Ledger:
    """Replaces one replica by `binary` on the same port and data dir, as a Deployment's
    rolling update does with one pod: SIGTERM, and the ledger drains: /readyz answers 503
    while it serves every call, until Envoy's health check has taken it out (seen while it
    still runs) and the other replica decides the calls; a second SIGTERM ends the drain
    delay, the ledger finishes what is in flight and exits 0. Then the new one starts,
    migrates, and takes callouts once Envoy's health check sees it ready."""
    assert old.proc is not None
    old.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: taken_out_by_health_check(envoy, old), 30, f"Envoy's health check to take {old.name} out")
    other_before = total(authorize_counts(other))
    wait_decided([other], [other_before], CALLS_AFTER_TAKEN_OUT, f"{other.name} to decide the calls")
    assert old.alive(), f"{old.name} stopped before Envoy took it out:\n{old.log_text()[-2000:]}"
    assert '"message":"draining:' in old.log_text() and '"drain_delay_ms":120000' in old.log_text()
    old.stop()
    assert old.proc.returncode == 0, f"{old.name} did not drain cleanly: {old.proc}"
    new = replica(log_dir, old.data_dir, url, schema, f"{old.name}-next", port=old.port, binary=binary)
    started.append(new)
    new.start()
    wait_until(envoy.ledgers_healthy, 30, f"Envoy to take callouts to {new.name} again")
    return new


def why_refused(refused: list[CallRecord], envoy: Envoy, ledgers: list[Ledger]) -> str:
    """What a failure needs to be understood: when each refused call ran (UTC, as the logs
    print it), why the filter refused it, and what the ledgers warned of."""
    to_wall = time.time() - time.monotonic()

    def stamp(t: float) -> str:
        return time.strftime("%H:%M:%S", time.gmtime(t + to_wall)) + f".{int((t + to_wall) % 1 * 1000):03d}"

    calls = [f"{r.phase} {r.outcome} {r.code} {stamp(r.started)} .. {stamp(r.ended)} ({r.ended - r.started:.3f} s)"
             for r in refused]
    filter_lines = [line for line in envoy.log_text().splitlines() if "authorize failed" in line]
    ledger_lines = [f"{x.name}: {line}" for x in ledgers for line in x.log_text().splitlines()
                    if '"level":"WARN"' in line or '"level":"ERROR"' in line or "draining" in line
                    or "stopped" in line or "listening" in line]
    return "\n".join(["refused calls:", *calls[:10], "the filter's reasons:", *filter_lines[-10:],
                      "the ledgers' warnings and transitions:", *ledger_lines[-30:]])


def wait_decided(ledgers: list[Ledger], since: list[int], calls: int, what: str) -> None:
    """Waits until each replica decided `calls` more authorizations than `since` (the load runs)."""
    wait_until(lambda: all(total(authorize_counts(r)) >= b + calls for r, b in zip(ledgers, since)), 90, what)


def test_rolling_upgrade_to_the_next_schema_under_load(log_dir, data_root, database_url):
    next_bin = next_binary()
    schema = f"atmost_upgrade_{uuid.uuid4().hex[:10]}"
    upstream = RecordingUpstream().start()
    a = replica(log_dir, data_root / f"{schema}-a", database_url, schema, "ledger-upgrade-a", drain_delay=DRAIN_DELAY)
    b = replica(log_dir, data_root / f"{schema}-b", database_url, schema, "ledger-upgrade-b", drain_delay=DRAIN_DELAY)
    running = [a, b]
    started = list(running)  # every replica, stopped at the end whatever happened
    envoy = None
    load = None
    try:
        for r in running:
            r.start()
        assert schema_versions(database_url, schema)[-1] == (RELEASED_SCHEMA, OLDEST_SERVING)
        envoy = Envoy(log_dir, upstream.port, [a.port, b.port], name="envoy-upgrade", plugin_overrides={
            "ledger": {"service_token": a.service_token},
            "upstream_key": {"mode": "hmac", "secret": UPSTREAM_SECRET},
            "report_interval_ms": 100,
        })
        envoy.start()
        history = History("rolling-upgrade")
        capped_created = a.create_permit("--max-calls", "pay=15", label="upgrade-capped")
        free_created = a.create_permit(label="upgrade-free")
        permits = [Permit(capped_created["id"], capped_created["token"], {"pay": 15}),
                   Permit(free_created["id"], free_created["token"], {})]
        load = Load(envoy.url, history, permits, ["pay", "ship"]).start()

        wait_decided(running, [0, 0], CALLS_PER_STEP, "both replicas to serve before the upgrade")
        # Step 1: B is replaced by the next build, which migrates while A still serves.
        load.phase = "b-replaced"
        b_next = swap(b, a, log_dir, database_url, schema, next_bin, envoy, started)
        running = [a, b_next]
        assert schema_versions(database_url, schema)[-1] == (NEXT_SCHEMA, OLDEST_SERVING)
        assert '"migration applied"' in b_next.log_text() and f'"version":{NEXT_SCHEMA}' in b_next.log_text()
        a_before = total(authorize_counts(a))
        wait_decided(running, [a_before, 0], CALLS_PER_STEP, "the old and the new build both to decide calls")
        # Step 2: A is replaced too.
        load.phase = "a-replaced"
        a_next = swap(a, b_next, log_dir, database_url, schema, next_bin, envoy, started)
        running = [a_next, b_next]
        wait_decided(running, [0, total(authorize_counts(b_next))], CALLS_PER_STEP,
                     "both upgraded replicas to decide calls")
        load.finish()

        # Every key that was let through or holds an attempt is called once more: completed
        # keys replay from the upgraded replicas, uncertain ones say so (the checker reads
        # each key's last probe).
        rows = wait_settled(lambda: pg_rows(database_url, schema), {p.id for p in permits}, 30)
        holders = set(row_owners(history, rows).values())
        by_id = {p.id: p for p in permits}
        probed = set()
        for r in list(history.calls):
            k = (r.permit_id, r.key)
            if (r.outcome == "ok" or k in holders) and k not in probed:
                probed.add(k)
                history.call(envoy.url, by_id[r.permit_id], r.tool, r.arguments, r.key, phase="probe")
        rows = wait_settled(lambda: pg_rows(database_url, schema), {p.id for p in permits}, 30)
        acked = acked_completions([x.log_path for x in (a, b, a_next, b_next)])
        summary = history.summary()
        unanswered = [r for r in history.calls if r.outcome == "unknown"]
        assert not unanswered, \
            f"{len(unanswered)} calls got no answer: {[(r.phase, r.status, r.error) for r in unanswered[:5]]}"
        assert_invariants(history, upstream.snapshot(), permits, UPSTREAM_SECRET, store_rows=rows, acked=acked,
                          allowed_codes=documented_codes(), require_probes=True)
        phases = {p: sum(1 for r in history.calls if r.phase == p) for p in ("before", "b-replaced", "a-replaced")}
        slowest = {p: round(max((r.ended - r.started for r in history.calls if r.phase == p), default=0), 3)
                   for p in phases}
        print(f"rolling upgrade: {len(history.calls)} calls, {summary}, per phase {phases}, slowest (s) {slowest}")
        # A planned rollout denies nothing: no call met an unavailable gateway.
        refused = [r for r in history.calls
                   if not (r.outcome == "ok" or (r.outcome == "denied" and r.code == "permit_max_calls_exceeded"))]
        assert not refused, (f"{len(refused)} calls neither dispatched, replayed nor capped:\n"
                             + why_refused(refused, envoy, started))
        # What the workload was meant to exercise did happen: dispatches, replays, the cap.
        assert summary.get("ok", 0) > 0 and any(r.replayed for r in history.calls if r.phase != "probe"), summary
        assert summary.get("denied:permit_max_calls_exceeded", 0) > 0, summary
        assert schema_versions(database_url, schema)[-1] == (NEXT_SCHEMA, OLDEST_SERVING)
        assert recount_mismatches(database_url, schema) == []
    finally:
        if load is not None:
            load.finish()
        if envoy is not None:
            envoy.stop()
        for r in started:
            r.stop()
        upstream.stop()
        drop_schema(database_url, schema)


def start_and_exit(binary: Path, url: str, schema: str, data_dir: Path) -> subprocess.CompletedProcess:
    """Runs `atmost ledger` until it exits by itself (a refusal at start)."""
    argv = [str(binary), "ledger", "--listen", f"127.0.0.1:{free_port()}",
            "--admin-listen", f"127.0.0.1:{free_port()}", "--data-dir", str(data_dir),
            "--pg-schema", schema]
    env = {**os.environ, "ATMOST_STORE": url, "ATMOST_SERVICE_TOKEN": "compat-service-token-of-32-bytes-or-more",
           "ATMOST_ADMIN_TOKEN": "compat-admin-token-of-32-bytes-or-more"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


def test_compatibility_rule_between_builds(log_dir, data_root, database_url):
    """A step back onto an additively newer schema serves (with a warning); a database a newer
    release migrated beyond what this build may serve on is refused at start, exit status 3."""
    next_bin = next_binary()
    schema = f"atmost_upgrade_{uuid.uuid4().hex[:10]}"
    try:
        upgraded = replica(log_dir, data_root / f"{schema}-n", database_url, schema, "ledger-compat-next",
                           binary=next_bin)
        upgraded.start()
        upgraded.stop()
        assert schema_versions(database_url, schema)[-1] == (NEXT_SCHEMA, OLDEST_SERVING)
        # The current build on the database at the next version, whose newest migration admits it.
        current = replica(log_dir, data_root / f"{schema}-c", database_url, schema, "ledger-compat-current")
        current.start()
        try:
            assert current.create_permit(label="compat")["token"]
            warning = [line for line in current.log_text().splitlines() if "newer schema" in line]
            assert (warning and f'"database_version":{NEXT_SCHEMA}' in warning[-1]
                    and f'"known":{RELEASED_SCHEMA}' in warning[-1]), warning
        finally:
            current.stop()
        # A release after it applied a migration that needs a ledger of the next version at least.
        beyond = NEXT_SCHEMA + 1
        psql(database_url, f"INSERT INTO {schema}.atmost_migrations (version, description, compatible_from) "
                           f"VALUES ({beyond}, 'a contracting change', {NEXT_SCHEMA})")
        refused = start_and_exit(ledger_binary(), database_url, schema, data_root / f"{schema}-r")
        assert refused.returncode == 3, (refused.returncode, refused.stderr)
        assert (f"atmost: schema too new: the database is at schema version {beyond} and needs a ledger that "
                f"knows at least {NEXT_SCHEMA}; this ledger knows up to {RELEASED_SCHEMA}") in refused.stderr, \
            refused.stderr
        assert schema_versions(database_url, schema)[-1] == (beyond, NEXT_SCHEMA)
        # The next build knows the next version: it may still serve there (with a warning).
        still = replica(log_dir, data_root / f"{schema}-n2", database_url, schema, "ledger-compat-next-2",
                        binary=next_bin)
        still.start()
        try:
            assert still.create_permit(label="compat-next")["token"]
        finally:
            still.stop()
        assert still.proc is not None and still.proc.returncode == 0
        warning = [line for line in still.log_text().splitlines() if "newer schema" in line]
        assert (warning and f'"database_version":{beyond}' in warning[-1]
                and f'"known":{NEXT_SCHEMA}' in warning[-1]), warning
    finally:
        drop_schema(database_url, schema)


def make_recipe(target: str) -> list[str]:
    """The first cargo command `make TARGET` runs (`make -n`), as words."""
    result = subprocess.run(["make", "-n", "--no-print-directory", target], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    builds = [line.split() for line in result.stdout.splitlines() if re.match(r"^\S*cargo build ", line)]
    assert builds, result.stdout
    return builds[0]


def resolved_ledger_features(build_args: list[str]) -> set[str]:
    """The features of atmost-ledger that cargo turns on for `cargo build BUILD_ARGS` (cargo
    resolves features the same way for every profile)."""
    args = [a for a in build_args if a != "--release"]
    result = subprocess.run(["cargo", "tree", "--offline", "--locked", *args, "-e", "features", "-i", "atmost-ledger",
                             "--prefix", "none"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return set(re.findall(r'^atmost-ledger feature "([\w-]+)"$', result.stdout, re.M))


def test_released_build_has_no_rehearsal_migration(tmp_path):
    """What `make ledger-release` builds (and `make oci` packages) writes the released schema:
    the rehearsal feature is never on in a release. Without building the release (no suite
    needs its fat-LTO build): its recipe is `make ledger`'s with `--release`, cargo leaves the
    rehearsal out of the features it resolves for it (and, the control, puts it in for `make
    ledger-next`'s), and the ledger `make ledger` built by that recipe writes the released
    schema."""
    release = make_recipe("ledger-release")
    assert release[1:] == ["build", "--release", "-p", "atmost-ledger-server"], release
    assert make_recipe("ledger")[1:] == [w for w in release[1:] if w != "--release"]
    features = resolved_ledger_features(release[2:])
    assert {"sqlite", "postgres"} <= features and "schema-rehearsal" not in features, features
    rehearsal = make_recipe("ledger-next")
    assert "schema-rehearsal" in resolved_ledger_features(rehearsal[2:]), rehearsal

    ledger = Ledger(tmp_path, tmp_path / "data", name="ledger-release-schema")
    ledger.argv[0] = str(ROOT / "target" / "debug" / "atmost")
    ledger.start()
    ledger.stop()
    conn = sqlite3.connect(f"file:{tmp_path / 'data' / 'atmost.sqlite3'}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == RELEASED_SCHEMA
        columns = [row[1] for row in conn.execute("PRAGMA table_info(attempts)")]
        assert "decided_by" not in columns and "forwarded_key_carriers" in columns
    finally:
        conn.close()
