"""Histories of calls and the one checker of atmost's promises.

Every fault scenario (tests/faults) and the rolling-upgrade test (tests/e2e/test_upgrade.py)
runs a workload that records each call it makes as a `CallRecord`: permit, key, tool,
arguments, the JSON-RPC id it was sent with (unique per call), and what the client saw —
`ok` (a tool result, first answer or replay), `denied` (an atmost denial or a refused
request, with its code) or `unknown` (no usable answer: a 5xx, a reset, a timeout). The
upstream records what it really executed, with the JSON-RPC id of the request that carried
it, so every execution is tied to the one call that caused it.
`check()` then verifies, over the whole history:

1. per call: an execution belongs to a call of this history (its JSON-RPC id), carries
   that call's derived key, tool and arguments, and happened once; a call that was denied
   or answered with a replay has no execution, whatever other calls under its key got; a
   first `ok` answer is the text of the call's own execution (the nonce matches); a replay
   is the text of its key's one execution;
2. at most one execution per (permit, key);
3. at most N executions per (permit, tool) when the permit caps the tool at N;
4. no acknowledged receipt lost: every attempt the ledger acknowledged `completed` (its
   log says `ack=applied`) is still `completed` with its receipt in the final store; where
   the scenario crashes PostgreSQL or fails it over (`reports_may_be_lost`), a report's
   commit may be acknowledged before it is durable (docs/design.md#the-ledgers-hot-path),
   and the attempt it completed may instead end `uncertain` by its lease, never anything
   else: not gone, not given back;
5. the ledger's final states agree with reality: every attempt row of the history's
   permits belongs to a key the history called (key hashing is checked, not assumed), and
   every key that executed has its attempt (the decision that dispatched it); an
   executed key is never `released` / `resolved_not_executed` (its slot would come back
   for a call that ran); a `completed` key executed one time with that execution's
   answer as receipt; after the settle time nothing is left `in_flight`; probes after
   recovery replay completed keys and answer `delivery_uncertain` for uncertain ones
   (with `require_probes`, a completed or uncertain key that was never probed is a
   violation);
6. optional per-scenario rules: allowed denial codes, and "inside this time window every
   call was denied with one of these codes" (a window that holds fewer calls than it
   asked for is a violation: the fault was not tested).

The checker refuses empty inputs: a history without calls, store rows that match no key,
completed attempts without a single acknowledged completion parsed from the ledger's log.
Each run is counted on the history (`History.checks`), so the suite can tell a scenario
that was never checked. A new scenario only adds a workload; the invariants live here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from tests.support.mcp_raw import RawMcp

NONCE = re.compile(r"nonce=([0-9a-f]{12})")

# Codes that are honest answers to a fault: never a dispatch.
FAULT_CODES = {"gateway_unavailable", "idempotency_in_progress", "delivery_uncertain"}

ATTEMPT_COLUMNS = ("id", "permit_id", "tool", "key_hash", "state", "receipt", "reason", "created_at", "updated_at",
                   "lease_expires_at")


@dataclasses.dataclass
class Permit:
    id: str
    token: str
    caps: dict[str, int]


@dataclasses.dataclass
class CallRecord:
    permit_id: str
    key: str | None
    tool: str
    arguments: dict
    phase: str
    outcome: str  # ok | denied | unknown
    code: str | None = None
    text: str | None = None
    replayed: bool = False
    status: int | None = None
    error: str | None = None
    started: float = 0.0
    ended: float = 0.0
    rpc_id: str | None = None


@dataclasses.dataclass
class Window:
    label: str
    start: float
    end: float
    codes: set[str]
    min_calls: int = 1

    def holds(self, r: CallRecord) -> bool:
        return r.started >= self.start and r.ended <= self.end


def classify(response: httpx.Response | None, error: Exception | None) -> tuple[str, str | None, str | None, bool]:
    """(outcome, code, text, replayed) for one HTTP answer."""
    if response is None:
        return "unknown", None, None, False
    try:
        body = response.json()
    except ValueError:
        return "unknown", None, None, False
    if not isinstance(body, dict):
        return "unknown", None, None, False
    if response.status_code == 200 and isinstance(body.get("result"), dict):
        result = body["result"]
        if result.get("isError") and isinstance(result.get("structuredContent"), dict):
            err = result["structuredContent"].get("error") or {}
            return "denied", err.get("code"), None, False
        content = result.get("content") or [{}]
        text = content[0].get("text") if isinstance(content[0], dict) else None
        return "ok", None, text, response.headers.get("idempotent-replayed") == "true"
    if isinstance(body.get("error"), dict) and 400 <= response.status_code < 500:
        # A malformed request refused before any decision: never dispatched.
        return "denied", f"rpc{body['error'].get('code')}", None, False
    return "unknown", None, None, False


class History:
    def __init__(self, name: str):
        self.name = name
        self.calls: list[CallRecord] = []
        self._lock = threading.Lock()
        self.windows: list[Window] = []
        # One entry per checker run over this history: (what was checked, calls it held).
        self.checks: list[tuple[str, int]] = []
        # Attempts whose acknowledged report a store crash lost (check's reports_may_be_lost).
        self.reports_lost: list[str] = []

    def add(self, record: CallRecord) -> CallRecord:
        with self._lock:
            self.calls.append(record)
        return record

    def call(self, url: str, permit: Permit, tool: str, arguments: dict, key: str | None, phase: str = "load",
             timeout: float = 10.0) -> CallRecord:
        """Makes one tools/call through the gateway and records what the client saw. The
        call's JSON-RPC id is unique, so the upstream's record of it names this call."""
        client = RawMcp(url, timeout=timeout)
        rpc_id = f"call-{uuid.uuid4().hex}"
        started = time.monotonic()
        response, error = None, None
        try:
            response = client.call(tool, arguments, permit.token, key, request_id=rpc_id)
        except Exception as e:  # noqa: BLE001 - any transport failure is an unknown outcome
            error = e
        finally:
            client.close()
        outcome, code, text, replayed = classify(response, error)
        return self.add(CallRecord(
            permit_id=permit.id, key=key, tool=tool, arguments=arguments, phase=phase, outcome=outcome, code=code,
            text=text, replayed=replayed, status=response.status_code if response is not None else None,
            error=repr(error) if error else None, started=started, ended=time.monotonic(), rpc_id=rpc_id))

    def expect_window(self, label: str, start: float, end: float, codes: set[str], min_calls: int = 1) -> Window:
        """Every call that started and ended inside [start, end] must be denied with one of
        `codes`, and the window must hold at least `min_calls` such calls."""
        window = Window(label, start, end, set(codes), max(min_calls, 1))
        self.windows.append(window)
        return window

    def inside(self, window: Window) -> list[CallRecord]:
        with self._lock:
            return [r for r in self.calls if window.holds(r)]

    def in_flight_at(self, moment: float) -> list[CallRecord]:
        """Calls that had started and not yet ended at `moment` (the ones still running are
        not recorded yet: they end after it)."""
        with self._lock:
            return [r for r in self.calls if r.started < moment < r.ended]

    def summary(self) -> dict:
        c = Counter(r.outcome if r.outcome != "denied" else f"denied:{r.code}" for r in self.calls)
        return dict(sorted(c.items()))

    def keys(self) -> set[tuple[str, str]]:
        return {(r.permit_id, r.key) for r in self.calls if r.key}


# -- what the ledger holds ---------------------------------------------------------------

def _read_sqlite(path: Path, uri: bool) -> list[dict]:
    conn = sqlite3.connect(f"file:{path}?mode=ro" if uri else str(path), uri=uri, timeout=10)
    try:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(f"SELECT {', '.join(ATTEMPT_COLUMNS)} FROM attempts")]
    finally:
        conn.close()


def sqlite_rows(data_dir: Path) -> list[dict]:
    """Every attempt row of the embedded store (read-only)."""
    return _read_sqlite(Path(data_dir) / "atmost.sqlite3", uri=True)


def sqlite_snapshot(data_dir: Path) -> list[dict]:
    """Every attempt row of a store whose ledger is not running (killed): the database and
    its WAL are copied and read from the copy, so the ledger that starts next on the data
    dir finds its files exactly as the kill left them."""
    with tempfile.TemporaryDirectory(prefix="atmost-snapshot-") as tmp:
        for suffix in ("", "-wal"):
            src = Path(data_dir) / f"atmost.sqlite3{suffix}"
            if src.exists():
                shutil.copyfile(src, Path(tmp) / src.name)
        return _read_sqlite(Path(tmp) / "atmost.sqlite3", uri=False)


def psql(url: str, sql: str) -> str:
    """One statement through psql (unaligned, tuples only); raises on an error."""
    r = subprocess.run(["psql", "-X", "-Atq", "-v", "ON_ERROR_STOP=1", url, "-c", sql], capture_output=True,
                       text=True, timeout=30, env={**os.environ, "PGCONNECT_TIMEOUT": "5"})
    if r.returncode != 0:
        raise RuntimeError(f"psql failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def pg_rows(url: str, schema: str) -> list[dict]:
    """Every attempt row of the ledger's schema, read straight from PostgreSQL."""
    columns = ", ".join(ATTEMPT_COLUMNS)
    return json.loads(psql(url, f"SELECT coalesce(json_agg(t), '[]'::json) FROM "
                                f"(SELECT {columns} FROM {schema}.attempts) t") or "[]")


def recount_mismatches(url: str, schema: str) -> list[str]:
    """The O(1) counters against a recount from the attempts (the state lists of
    AttemptState::holds_slot, reserves_budget, spends_budget): every mismatching row."""
    slots = ("('in_flight','completed','uncertain','resolved_executed','awaiting_input','accepted',"
             "'awaiting_approval','approved')")
    sql = f"""
    SELECT 'slots ' || coalesce(u.permit_id, r.permit_id) || ' ' || coalesce(u.tool, r.tool)
           || ': stored ' || coalesce(u.slots_held, 0) || ', recount ' || coalesce(r.n, 0)
    FROM {schema}.permit_tool_usage u
    FULL JOIN (SELECT permit_id, tool, count(*) AS n FROM {schema}.attempts WHERE state IN {slots}
               GROUP BY permit_id, tool) r ON r.permit_id = u.permit_id AND r.tool = u.tool
    WHERE coalesce(u.slots_held, 0) <> coalesce(r.n, 0)
    UNION ALL
    SELECT 'budget ' || p.id || ': stored ' || p.reserved || '/' || p.spent || ', recount '
           || coalesce(b.reserved, 0) || '/' || coalesce(b.spent, 0)
    FROM {schema}.permits p
    LEFT JOIN (SELECT permit_id,
                      sum(cost) FILTER (WHERE state IN ('in_flight','awaiting_input','awaiting_approval',
                                                        'approved')) AS reserved,
                      sum(cost) FILTER (WHERE state IN ('completed','uncertain','resolved_executed',
                                                        'accepted')) AS spent
               FROM {schema}.attempts GROUP BY permit_id) b ON b.permit_id = p.id
    WHERE p.reserved <> coalesce(b.reserved, 0) OR p.spent <> coalesce(b.spent, 0)
    UNION ALL
    SELECT 'states ' || coalesce(c.permit_id, r.permit_id) || ' ' || coalesce(c.state, r.state)
           || ': stored ' || coalesce(c.n, 0) || ', recount ' || coalesce(r.n, 0)
    FROM {schema}.permit_state_counts c
    FULL JOIN (SELECT permit_id, state, count(*) AS n FROM {schema}.attempts GROUP BY permit_id, state) r
        ON r.permit_id = c.permit_id AND r.state = c.state
    WHERE coalesce(c.n, 0) <> coalesce(r.n, 0)
    """
    return [line for line in psql(url, sql).splitlines() if line]


def acked_completions(ledger_logs: list[Path]) -> set[str]:
    """Attempt ids whose `completed` report the ledger acknowledged (committed, then logged)."""
    acked = set()
    for path in ledger_logs:
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            if '"outcome"' not in line or '"applied"' not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            fields = entry.get("fields") if isinstance(entry.get("fields"), dict) else entry
            if fields.get("message") == "outcome" and fields.get("outcome") == "completed" \
                    and fields.get("ack") == "applied":
                acked.add(fields["attempt_id"])
    return acked


def upstream_key(secret: str, permit_id: str, key: str) -> str:
    return hmac.new(secret.encode(), f"{permit_id}:{key}".encode(), hashlib.sha256).hexdigest()


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# -- who did what ------------------------------------------------------------------------

@dataclasses.dataclass
class Attribution:
    """The executions tied to the calls that caused them."""
    by_call: dict[str, list[dict]]  # rpc id → executions carrying it
    by_key: dict[tuple[str, str | None], list[dict]]  # (permit, key) → executions of its calls
    orphans: list[dict]  # executions whose JSON-RPC id is no call of the history


def attribute(history: History, executions: list[dict]) -> Attribution:
    calls = {r.rpc_id: r for r in history.calls if r.rpc_id is not None}
    by_call: dict[str, list[dict]] = defaultdict(list)
    by_key: dict[tuple[str, str | None], list[dict]] = defaultdict(list)
    orphans = []
    for e in executions:
        r = calls.get(e.get("rpc_id"))
        if r is None:
            orphans.append(e)
            continue
        by_call[r.rpc_id].append(e)
        by_key[(r.permit_id, r.key)].append(e)
    return Attribution(by_call, by_key, orphans)


def row_owners(history: History, rows: list[dict]) -> dict[str, tuple[str, str | None] | None]:
    """Attempt id → the (permit, key) of the history it belongs to (None: no key matches)."""
    by_hash: dict[tuple[str, str | None], tuple[str, str | None]] = {}
    for r in history.calls:
        by_hash[(r.permit_id, key_hash(r.key) if r.key else None)] = (r.permit_id, r.key)
    return {row["id"]: by_hash.get((row["permit_id"], row["key_hash"])) for row in rows}


# -- the checker -------------------------------------------------------------------------

def _check_calls(history: History, att: Attribution, upstream_secret: str, v: list[str]) -> None:
    for e in att.orphans:
        v.append(f"unchecked dispatch: execution #{e['n']} of {e['tool']} carries JSON-RPC id {e.get('rpc_id')!r}, "
                 f"no call of this history")
    for r in history.calls:
        es = att.by_call.get(r.rpc_id, []) if r.rpc_id else []
        who = f"call {r.rpc_id} ({r.phase}, key {r.key}, {r.tool})"
        if len(es) > 1:
            v.append(f"{who} executed {len(es)} times (executions {[e['n'] for e in es]})")
        for e in es:
            expected_key = upstream_key(upstream_secret, r.permit_id, r.key) if r.key else None
            if e.get("upstream_key") != expected_key:
                v.append(f"{who}: execution #{e['n']} carries upstream key {e.get('upstream_key')!r}, "
                         f"not the call's {expected_key!r}")
            if e["tool"] != r.tool:
                v.append(f"{who}: execution #{e['n']} ran tool {e['tool']}")
            if e.get("arguments") != r.arguments:
                v.append(f"{who}: execution #{e['n']} ran with arguments {e.get('arguments')!r}, "
                         f"the call sent {r.arguments!r}")
        if es and r.outcome == "denied":
            v.append(f"{who} was denied {r.code} but executed (executions {[e['n'] for e in es]})")
        if es and r.outcome == "ok" and r.replayed:
            v.append(f"{who} was answered with a replay but executed (executions {[e['n'] for e in es]})")
        if r.outcome == "ok" and not r.replayed:
            if not es:
                v.append(f"{who}: ok answer {r.text!r} without an execution of this call")
            else:
                m = NONCE.search(r.text or "")
                if not m or m.group(1) != es[0]["nonce"]:
                    v.append(f"{who}: ok answer {r.text!r} is not its execution's answer ({es[0]['nonce']})")


def _check_keys(history: History, att: Attribution, permits: list[Permit], v: list[str]) -> None:
    by_permit = {p.id: p for p in permits}
    by_tool: Counter = Counter()
    for (permit_id, key), es in att.by_key.items():
        if key is not None and len(es) > 1:
            v.append(f"key {key} executed {len(es)} times (executions {[e['n'] for e in es]})")
        for e in es:
            by_tool[(permit_id, e["tool"])] += 1
    for (permit_id, tool), n in by_tool.items():
        cap = by_permit[permit_id].caps.get(tool) if permit_id in by_permit else None
        if cap is not None and n > cap:
            v.append(f"permit {permit_id} tool {tool}: {n} executions over a cap of {cap}")
    # A replay is the key's one execution's answer.
    for r in history.calls:
        if r.outcome != "ok" or not r.replayed:
            continue
        es = att.by_key.get((r.permit_id, r.key), [])
        m = NONCE.search(r.text or "")
        if not es:
            v.append(f"key {r.key}: replay {r.text!r} (call {r.rpc_id}) without any execution of the key")
        elif not m or m.group(1) not in {e["nonce"] for e in es}:
            v.append(f"key {r.key}: replay {r.text!r} (call {r.rpc_id}) is not the answer of its execution")


def _check_store(history: History, att: Attribution, permits: list[Permit], rows: list[dict], acked: set[str],
                 settled: bool, require_probes: bool, reports_may_be_lost: bool, v: list[str]) -> None:
    permit_ids = {p.id for p in permits}
    rows = [row for row in rows if row["permit_id"] in permit_ids]
    rows_by_id = {row["id"]: row for row in rows}
    answered = [r for r in history.calls if r.outcome == "ok" and not r.replayed]
    if answered and not rows:
        v.append(f"{len(answered)} calls were answered by their execution, yet the store holds no attempt "
                 f"of this history's permits: the checker read the wrong store")
    completed = [row for row in rows if row["state"] in ("completed", "resolved_executed")]
    if completed and not acked & {row["id"] for row in completed}:
        v.append(f"{len(completed)} attempts completed, yet no acknowledged completion of them was parsed from "
                 f"the ledger's log (log level or format changed?): invariant 4 would check nothing")
    for attempt_id in sorted(acked):
        row = rows_by_id.get(attempt_id)
        if row is None:
            v.append(f"acknowledged completion of {attempt_id} lost: the attempt is gone")
        elif reports_may_be_lost and row["state"] == "uncertain" and row["reason"] == "lease_expired":
            history.reports_lost.append(attempt_id)
        elif row["state"] not in ("completed", "resolved_executed") or not row["receipt"]:
            v.append(f"acknowledged completion of {attempt_id} lost: now {row['state']}")
    owners = row_owners(history, rows)
    # A dispatch is decided by a committed attempt: an executed key without one is a decision
    # the store lost (a failover to a standby the commit never reached).
    held = set(owners.values())
    for (permit_id, key), es in sorted(att.by_key.items(), key=lambda kv: str(kv[0])):
        if key is not None and permit_id in permit_ids and (permit_id, key) not in held:
            v.append(f"key {key} executed (executions {[e['n'] for e in es]}) but the store holds no attempt "
                     f"of it: the decision to dispatch was lost")
    calls_by_key: dict[tuple[str, str | None], list[CallRecord]] = defaultdict(list)
    for r in history.calls:
        calls_by_key[(r.permit_id, r.key)].append(r)
    for row in rows:
        owner = owners[row["id"]]
        if owner is None:
            v.append(f"attempt {row['id']} ({row['state']}) matches no key this history called "
                     f"(key hash {row['key_hash']!r}): key hashing changed, or a call went unrecorded")
            continue
        es = att.by_key.get(owner, [])
        if es and row["state"] in ("released", "resolved_not_executed"):
            v.append(f"key {owner[1]} executed but its attempt {row['id']} is {row['state']} (slot given back)")
        if row["state"] == "completed":
            if len(es) != 1:
                v.append(f"key {owner[1]} completed with {len(es)} executions")
            elif not row["receipt"] or es[0]["nonce"] not in row["receipt"]:
                v.append(f"key {owner[1]}: stored receipt is not its execution's answer")
        if settled and row["state"] == "in_flight":
            v.append(f"attempt {row['id']} of key {owner[1]} still in_flight after the settle time")
        # Probes run after recovery: a completed key replays, an uncertain one says so (the
        # last probe counts: one may have met a connection Envoy had not yet seen die).
        probes = [r for r in calls_by_key.get(owner, []) if r.phase == "probe"]
        if require_probes and not probes and row["state"] in ("completed", "uncertain"):
            v.append(f"{row['state']} key {owner[1]} was never probed after recovery")
        for r in probes[-1:]:
            # A key whose earlier calls all failed before a decision committed (denied by the
            # filter's timeout, the client gone) holds no attempt until the probe: the probe
            # is then its first dispatch, and its answer the key's one execution's.
            first = (r.outcome == "ok" and not r.replayed and len(es) == 1
                     and es[0]["nonce"] in (r.text or ""))
            if row["state"] == "completed" and not (r.outcome == "ok" and r.replayed) and not first:
                v.append(f"completed key {owner[1]} did not replay after recovery: {r.outcome}/{r.code}")
            if row["state"] == "uncertain" and not (r.outcome == "denied" and r.code == "delivery_uncertain"):
                v.append(f"uncertain key {owner[1]} answered {r.outcome}/{r.code}, not delivery_uncertain")


def check(history: History, executions: list[dict], permits: list[Permit], upstream_secret: str,
          store_rows: list[dict] | None = None, acked: set[str] | None = None, settled: bool = True,
          allowed_codes: set[str] | None = None, require_probes: bool = False,
          reports_may_be_lost: bool = False) -> list[str]:
    """Returns every violation found (empty: the promises held). Without `store_rows` the
    store's invariants (4, 5) are not checked: only `verify` style runs pass them. With
    `require_probes`, every completed or uncertain key must have been probed after recovery.
    `reports_may_be_lost`: the scenario crashes or fails over the store, so an acknowledged
    report may be lost to its asynchronous commit (invariant 4); each such attempt is listed
    in `history.reports_lost`."""
    v: list[str] = []
    if not history.calls:
        v.append("the history holds no call: nothing was tested")
    att = attribute(history, executions)
    _check_calls(history, att, upstream_secret, v)
    _check_keys(history, att, permits, v)
    if store_rows is not None:
        _check_store(history, att, permits, store_rows, set(acked or ()), settled, require_probes,
                     reports_may_be_lost, v)
    if allowed_codes is not None:
        for r in history.calls:
            if r.outcome == "denied" and r.code not in allowed_codes:
                v.append(f"unexpected denial {r.code} for key {r.key} in phase {r.phase}")
    for w in history.windows:
        inside = history.inside(w)
        if len(inside) < w.min_calls:
            v.append(f"window {w.label}: {len(inside)} calls started and ended inside it, fewer than "
                     f"{w.min_calls}: the fault was not tested")
        for r in inside:
            if not (r.outcome == "denied" and r.code in w.codes):
                v.append(f"window {w.label}: call {r.key} got {r.outcome}/{r.code}, expected one of {sorted(w.codes)}")
    history.checks.append(("calls+store" if store_rows is not None else "calls", len(history.calls)))
    return v


def assert_invariants(history: History, executions: list[dict], permits: list[Permit], upstream_secret: str,
                      **kwargs) -> None:
    violations = check(history, executions, permits, upstream_secret, **kwargs)
    summary = history.summary()
    assert not violations, f"{history.name}: {len(violations)} violation(s) over {summary}:\n" + "\n".join(
        violations[:40])


def wait_settled(read_rows, permit_ids: set[str], timeout: float = 15.0) -> list[dict]:
    """Waits until no attempt of these permits is in_flight (leases ran out or outcomes
    arrived); `read_rows()` reads the store's attempt rows. Returns the last rows read."""
    deadline = time.monotonic() + timeout
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = read_rows()
        if not any(r["state"] == "in_flight" and r["permit_id"] in permit_ids for r in rows):
            return rows
        time.sleep(0.2)
    return rows
