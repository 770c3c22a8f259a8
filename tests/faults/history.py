"""Histories of calls and the one checker of atmost's promises.

Every fault scenario runs a workload that records each call it makes as a `CallRecord`:
permit, key, tool, arguments, and what the client saw — `ok` (a tool result, first answer
or replay), `denied` (an atmost denial or a refused request, with its code) or `unknown`
(no usable answer: a 5xx, a reset, a timeout). The upstream records what it really
executed. `check()` then verifies, over the whole history:

1. at most one execution per (permit, key);
2. at most N executions per (permit, tool) when the permit caps the tool at N;
3. no unchecked dispatch: every execution belongs to a key the client called and was not
   denied on every time (a fault is answered `denied` or `unknown`, never a silent send);
   an execution without a key, or with a key nobody called, is a violation;
4. replays are faithful: every `ok` answer for a key carries the text of that key's one
   execution (the nonce matches), and an `ok` without an execution is a violation;
5. no acknowledged receipt lost: every attempt the ledger acknowledged `completed` (its
   log says `ack=applied`) is still `completed` with its receipt in the final store, and
   its receipt is the execution's answer;
6. the ledger's final states agree with reality: an executed key is never `released` /
   `resolved_not_executed` (its slot would come back for a call that ran), a `completed`
   key executed one time (no more, no fewer), and after the settle time nothing is left `in_flight`;
7. optional per-scenario rules: allowed denial codes, and "inside this time window every
   call was denied with one of these codes".

A new scenario only adds a workload; the invariants live here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import sqlite3
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from tests.support.mcp_raw import RawMcp

NONCE = re.compile(r"nonce=([0-9a-f]{12})")

# Codes that are honest answers to a fault: never a dispatch.
FAULT_CODES = {"gateway_unavailable", "idempotency_in_progress", "delivery_uncertain"}


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
        self.windows: list[tuple[str, float, float, set[str]]] = []

    def add(self, record: CallRecord) -> CallRecord:
        with self._lock:
            self.calls.append(record)
        return record

    def call(self, url: str, permit: Permit, tool: str, arguments: dict, key: str | None, phase: str = "load",
             timeout: float = 10.0) -> CallRecord:
        """Makes one tools/call through the gateway and records what the client saw."""
        client = RawMcp(url, timeout=timeout)
        started = time.monotonic()
        response, error = None, None
        try:
            response = client.call(tool, arguments, permit.token, key)
        except Exception as e:  # noqa: BLE001 - any transport failure is an unknown outcome
            error = e
        finally:
            client.close()
        outcome, code, text, replayed = classify(response, error)
        return self.add(CallRecord(
            permit_id=permit.id, key=key, tool=tool, arguments=arguments, phase=phase, outcome=outcome, code=code,
            text=text, replayed=replayed, status=response.status_code if response is not None else None,
            error=repr(error) if error else None, started=started, ended=time.monotonic()))

    def expect_window(self, label: str, start: float, end: float, codes: set[str]) -> None:
        """Every call that started and ended inside [start, end] must be denied with one of `codes`."""
        self.windows.append((label, start, end, codes))

    def summary(self) -> dict:
        c = Counter(r.outcome if r.outcome != "denied" else f"denied:{r.code}" for r in self.calls)
        return dict(sorted(c.items()))

    def keys(self) -> set[tuple[str, str]]:
        return {(r.permit_id, r.key) for r in self.calls if r.key}


# -- what the ledger holds ---------------------------------------------------------------

def sqlite_rows(data_dir: Path) -> list[dict]:
    """Every attempt row of the embedded store (read-only)."""
    path = Path(data_dir) / "atmost.sqlite3"
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(
            "SELECT id, permit_id, tool, key_hash, state, receipt, reason FROM attempts")]
    finally:
        conn.close()


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
            if entry.get("message") == "outcome" and entry.get("outcome") == "completed" and entry.get("ack") == "applied":
                acked.add(entry["attempt_id"])
    return acked


def upstream_key(secret: str, permit_id: str, key: str) -> str:
    return hmac.new(secret.encode(), f"{permit_id}:{key}".encode(), hashlib.sha256).hexdigest()


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# -- the checker -------------------------------------------------------------------------

def check(history: History, executions: list[dict], permits: list[Permit], upstream_secret: str,
          store_rows: list[dict] | None = None, acked: set[str] | None = None, settled: bool = True,
          allowed_codes: set[str] | None = None) -> list[str]:
    """Returns every violation found (empty: the promises held)."""
    v: list[str] = []
    by_permit = {p.id: p for p in permits}
    # Upstream key → (permit, client key), for every key any call used.
    reverse: dict[str, tuple[str, str]] = {}
    for permit_id, key in history.keys():
        reverse[upstream_key(upstream_secret, permit_id, key)] = (permit_id, key)

    calls_by_key: dict[tuple[str, str], list[CallRecord]] = defaultdict(list)
    for r in history.calls:
        if r.key:
            calls_by_key[(r.permit_id, r.key)].append(r)

    execs_by_key: dict[tuple[str, str], list[dict]] = defaultdict(list)
    execs_by_tool: Counter = Counter()
    for e in executions:
        owner = reverse.get(e.get("upstream_key") or "")
        if owner is None:
            v.append(f"unchecked dispatch: execution #{e['n']} of {e['tool']} carries no key of this history "
                     f"(upstream key {e.get('upstream_key')!r})")
            continue
        execs_by_key[owner].append(e)
        execs_by_tool[(owner[0], e["tool"])] += 1

    # 1. at most one execution per key
    for k, es in execs_by_key.items():
        if len(es) > 1:
            v.append(f"key {k[1]} executed {len(es)} times (executions {[e['n'] for e in es]})")
    # 2. caps
    for (permit_id, tool), n in execs_by_tool.items():
        cap = by_permit[permit_id].caps.get(tool) if permit_id in by_permit else None
        if cap is not None and n > cap:
            v.append(f"permit {permit_id} tool {tool}: {n} executions over a cap of {cap}")
    # 3. no unchecked dispatch: an executed key had a call that was let through (ok or unknown)
    for k, es in execs_by_key.items():
        outcomes = {r.outcome for r in calls_by_key.get(k, [])}
        if not outcomes & {"ok", "unknown"}:
            codes = sorted({str(r.code) for r in calls_by_key.get(k, [])})
            v.append(f"key {k[1]} executed although every call of it was denied ({codes})")
        tools = {r.tool for r in calls_by_key.get(k, [])}
        for e in es:
            if e["tool"] not in tools:
                v.append(f"key {k[1]} executed tool {e['tool']} but was called for {sorted(tools)}")
    # 4. faithful replays
    for k, rs in calls_by_key.items():
        es = execs_by_key.get(k, [])
        for r in rs:
            if r.outcome != "ok":
                continue
            if not es:
                v.append(f"key {k[1]}: ok answer {r.text!r} without any execution")
                continue
            m = NONCE.search(r.text or "")
            if not m or m.group(1) not in {e["nonce"] for e in es}:
                v.append(f"key {k[1]}: ok answer {r.text!r} is not the answer of its execution")
    # 5 + 6. the store
    if store_rows is not None:
        rows_by_id = {row["id"]: row for row in store_rows}
        for attempt_id in sorted(acked or ()):
            row = rows_by_id.get(attempt_id)
            if row is None:
                v.append(f"acknowledged completion of {attempt_id} lost: the attempt is gone")
            elif row["state"] not in ("completed", "resolved_executed") or not row["receipt"]:
                v.append(f"acknowledged completion of {attempt_id} lost: now {row['state']}")
        by_hash = {}
        for permit_id, key in history.keys():
            by_hash[(permit_id, key_hash(key))] = (permit_id, key)
        for row in store_rows:
            owner = by_hash.get((row["permit_id"], row["key_hash"]))
            if owner is None:
                continue
            es = execs_by_key.get(owner, [])
            if es and row["state"] in ("released", "resolved_not_executed"):
                v.append(f"key {owner[1]} executed but its attempt {row['id']} is {row['state']} (slot given back)")
            if row["state"] == "completed":
                if len(es) != 1:
                    v.append(f"key {owner[1]} completed with {len(es)} executions")
                elif row["receipt"] and es[0]["nonce"] not in row["receipt"]:
                    v.append(f"key {owner[1]}: stored receipt is not its execution's answer")
            if settled and row["state"] == "in_flight":
                v.append(f"attempt {row['id']} of key {owner[1]} still in_flight after the settle time")
            # Probes run after recovery: a completed key replays, an uncertain one says so (the
            # last probe counts: one may have met a connection Envoy had not yet seen die).
            probes = [r for r in calls_by_key.get(owner, []) if r.phase == "probe"]
            for r in probes[-1:]:
                if row["state"] == "completed" and not (r.outcome == "ok" and r.replayed):
                    v.append(f"completed key {owner[1]} did not replay after recovery: {r.outcome}/{r.code}")
                if row["state"] == "uncertain" and not (r.outcome == "denied" and r.code == "delivery_uncertain"):
                    v.append(f"uncertain key {owner[1]} answered {r.outcome}/{r.code}, not delivery_uncertain")
    # 7. per-scenario rules
    if allowed_codes is not None:
        for r in history.calls:
            if r.outcome == "denied" and r.code not in allowed_codes:
                v.append(f"unexpected denial {r.code} for key {r.key} in phase {r.phase}")
    for label, start, end, codes in history.windows:
        for r in history.calls:
            if r.started >= start and r.ended <= end and not (r.outcome == "denied" and r.code in codes):
                v.append(f"window {label}: call {r.key} got {r.outcome}/{r.code}, expected one of {sorted(codes)}")
    return v


def assert_invariants(history: History, executions: list[dict], permits: list[Permit], upstream_secret: str,
                      **kwargs) -> None:
    violations = check(history, executions, permits, upstream_secret, **kwargs)
    summary = history.summary()
    assert not violations, f"{history.name}: {len(violations)} violation(s) over {summary}:\n" + "\n".join(
        violations[:40])


def wait_settled(data_dir: Path, permit_ids: set[str], timeout: float = 15.0) -> list[dict]:
    """Waits until no attempt of these permits is in_flight (leases ran out or outcomes arrived)."""
    deadline = time.monotonic() + timeout
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = sqlite_rows(data_dir)
        if not any(r["state"] == "in_flight" and r["permit_id"] in permit_ids for r in rows):
            return rows
        time.sleep(0.2)
    return rows
