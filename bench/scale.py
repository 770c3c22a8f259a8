#!/usr/bin/env python3
"""`make bench-scale`: what a governed call costs as the store grows.

`make bench` starts every setup on an empty store. Here each store (PostgreSQL, then SQLite)
is filled, straight through SQL in the ledger's own schema, to each size of
BENCH_SCALE_ATTEMPTS attempts (default 10^4, 10^6, 10^7) over BENCH_SCALE_PERMITS permits
(default 10^5), and at each size the same figures are taken on the filled store:

  - E (PostgreSQL) or D (SQLite): p50 / p99 at 1 % of plain Envoy's ceiling (B, measured once
    at the start of the run; its own p50 / p99 at that rate too, so "added" is in the table);
    CPU per call of each process (PostgreSQL's every backend included);
  - the ledger alone: authorize + completed report pairs per second, one permit;
  - table and index sizes; at the largest size on PostgreSQL, the plans of the statements the
    calls ran (auto_explain, EXPLAIN ANALYZE of every statement of a short burst).

Target (issue: "flat as the data grows"): every figure within 10 % of the smallest size's.

How the store is filled: a ledger migrates the empty store, one permit is created through the
admin API and a second's worth of real authorize + completed pairs runs under it, so the
template rows are the ledger's own. With the ledger stopped, its attempts are cloned by SQL
(`generate_series` on PostgreSQL, a recursive CTE on SQLite) under generated permits (clones of
the template permit, tokens nobody holds), each with an idempotency key; the counters the
ledger keeps (slots held per permit and tool, attempts per state, budget spent) are recomputed
from the rows, so the store is one the ledger could have written. The non-unique indexes are
dropped before a batch and built again after it, from their own definitions. The attempts
were created over the last six days, within the default retention (7 days), so the pruner has
nothing to do during the measurement (the pruner under steady load is a soak's question).
States: 96 % completed (with the template's receipt), 3 % released, 1 % resolved either way.

Environment (besides bench/run.py's BENCH_RATE_SECONDS, BENCH_LEDGER_SECONDS, BENCH_PG_BINDIR):
  BENCH_SCALE_ATTEMPTS  sizes, ascending, comma-separated (default "10000,1000000,10000000")
  BENCH_SCALE_PERMITS   permits of the filled store (default 100000)
  BENCH_SCALE_STORES    "postgres,sqlite" (default both)
  BENCH_SCALE_RATE      percent of B's ceiling for the latency runs (default 1)
  BENCH_SCALE_PG_SETTINGS  server settings of the bench's PostgreSQL, space-separated
                        name=value (default none: PostgreSQL's own, shared_buffers 128 MB)

Writes target/bench/scale/results.md and results.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("BENCH_OUT", str(Path(__file__).resolve().parents[1] / "target" / "bench" / "scale"))
import run as bench  # noqa: E402  (one method: the same processes, load and CPU accounting as `make bench`)

stack = bench.stack
SIZES = [int(x) for x in os.environ.get("BENCH_SCALE_ATTEMPTS", "10000,1000000,10000000").split(",") if x.strip()]
PREFILL_PERMITS = int(os.environ.get("BENCH_SCALE_PERMITS", "100000"))
STORES = [s.strip() for s in os.environ.get("BENCH_SCALE_STORES", "postgres,sqlite").split(",") if s.strip()]
RATE = float(os.environ.get("BENCH_SCALE_RATE", "1"))
SPAN_MS = 6 * 24 * 3600 * 1000
# The model's state lists (ledger/model, docs/design.md "Attempt states"): which states hold a
# slot and which count as spent. Only states that hold or give back a slot for good are
# generated: nothing leased, nothing for the inbox.
HOLDS_SLOT = ("completed", "resolved_executed")
GENERATED_STATE_SQL = ("CASE WHEN g % 100 < 96 THEN 'completed' WHEN g % 100 < 99 THEN 'released' "
                       "WHEN g % 2 = 0 THEN 'resolved_executed' ELSE 'resolved_not_executed' END")


def log(msg: str) -> None:
    bench.log(msg)


# ---------------------------------------------------------------- filling the store

def attempt_columns(names: list[str], now_ms: int, dialect: str) -> list[str]:
    """The SELECT list that clones the template attempt `a` as generated attempt `g`: the
    columns this generator sets, the template's value for every other (so a column a later
    schema adds is still filled as the ledger fills it)."""
    if dialect == "pg":
        hexid = lambda width, expr: f"lpad(to_hex({expr}), {width}, '0')"  # noqa: E731
        digest = lambda salt: f"md5('{salt}' || g::text) || md5('{salt}x' || g::text)"  # noqa: E731
    else:
        hexid = lambda width, expr: f"printf('%0{width}x', {expr})"  # noqa: E731
        digest = lambda salt: "lower(hex(randomblob(32)))"  # noqa: E731
    created = f"({now_ms} - ((g * 7919) % {SPAN_MS}))"
    state = GENERATED_STATE_SQL
    executed = "CASE WHEN g % 100 < 99 THEN NULL WHEN g % 2 = 0 THEN TRUE ELSE FALSE END"
    if dialect != "pg":
        executed = "CASE WHEN g % 100 < 99 THEN NULL WHEN g % 2 = 0 THEN 1 ELSE 0 END"
    resolved = f"CASE WHEN g % 100 < 99 THEN NULL ELSE {created} + 60000 END"
    chosen = {
        "id": f"'att_' || {hexid(32, 'g')}",
        "permit_id": f"'pmt_' || {hexid(24, f'(g % {PREFILL_PERMITS}) + 1')}",
        "key_hash": digest("k"),
        "fingerprint": digest("f"),
        "state": state,
        "created_at": created,
        "updated_at": f"{created} + 40",
        "finished_at": f"{created} + 40",
        "lease_expires_at": f"{created} + 300000",
        "receipt": f"CASE WHEN g % 100 < 96 OR (g % 100 >= 99 AND g % 2 = 0) THEN a.receipt ELSE NULL END",
        "reason": "NULL",
        "replay_count": "0",
        "pruned_at": "NULL",
        "resolved_executed": executed,
        "resolved_at": resolved,
        "resolved_by": "CASE WHEN g % 100 < 99 THEN NULL ELSE 'scale-bench' END",
        "resolution_source": "CASE WHEN g % 100 < 99 THEN NULL ELSE 'person' END",
        "resolution_note": "NULL",
        "provider_answer": "NULL",
        "capability_hash": "NULL",
    }
    return [chosen.get(c, f"a.{c}") for c in names]


def permit_columns(names: list[str], dialect: str) -> list[str]:
    hexid = (lambda e: f"lpad(to_hex({e}), 24, '0')") if dialect == "pg" else (lambda e: f"printf('%024x', {e})")
    token = "md5('t' || g::text) || md5('u' || g::text)" if dialect == "pg" else "lower(hex(randomblob(32)))"
    chosen = {"id": f"'pmt_' || {hexid('g')}", "token_hash": token, "label": "'scale-fill-' || g",
              "reserved": "0", "spent": "0", "revoked_at": "NULL"}
    return [chosen.get(c, f"p.{c}") for c in names]


class PgStore:
    dialect = "pg"

    def __init__(self, url: str, schema: str):
        self.url, self.schema = url, schema

    def sql(self, text: str) -> str:
        """Statements in one transaction (psql -c sends them as one query), in the ledger's schema;
        no time limit of its own: ten million rows take minutes."""
        r = subprocess.run(["psql", self.url, "-XAtqc", f"SET search_path TO {self.schema}; {text}"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"psql: {r.stderr.strip()[-800:]}")
        return r.stdout.strip()

    def each(self, statements: list[str]) -> None:
        """Statements one after another in one session, each in a transaction of its own
        (VACUUM cannot run inside one)."""
        argv = ["psql", self.url, "-XAtq", "-v", "ON_ERROR_STOP=1", "-c", f"SET search_path TO {self.schema}"]
        for statement in statements:
            argv += ["-c", statement]
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"psql: {r.stderr.strip()[-800:]}")

    def columns(self, table: str) -> list[str]:
        out = bench.psql(self.url, "SELECT string_agg(column_name, ',' ORDER BY ordinal_position) FROM "
                                   f"information_schema.columns WHERE table_schema = '{self.schema}' "
                                   f"AND table_name = '{table}'")
        return out.split(",")

    def count(self, table: str) -> int:
        return int(self.sql(f"SELECT count(*) FROM {table}"))

    def secondary_indexes(self) -> list[tuple[str, str]]:
        rows = bench.psql(self.url, "SELECT i.indexname || '|' || i.indexdef FROM pg_indexes i WHERE "
                                    f"i.schemaname = '{self.schema}' AND i.tablename IN ('attempts', 'idempotency_keys') "
                                    "AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)")
        return [tuple(r.split("|", 1)) for r in rows.splitlines() if r]

    def fill(self, template_permit: str, first: int, last: int, permits_wanted: int, now_ms: int) -> None:
        indexes = self.secondary_indexes()
        pcols = self.columns("permits")
        have = int(self.sql("SELECT count(*) FROM permits WHERE label LIKE 'scale-fill-%'"))
        statements = []
        if have < permits_wanted:
            statements.append(
                f"INSERT INTO permits ({','.join(pcols)}) SELECT {','.join(permit_columns(pcols, 'pg'))} "
                f"FROM permits p, generate_series({have + 1}::bigint, {permits_wanted}::bigint) g WHERE p.id = '{template_permit}'")
        acols = self.columns("attempts")
        statements += [f"DROP INDEX {name}" for name, _ in indexes]
        statements.append(
            f"INSERT INTO attempts ({','.join(acols)}) SELECT {','.join(attempt_columns(acols, now_ms, 'pg'))} "
            f"FROM (SELECT * FROM attempts WHERE permit_id = '{template_permit}' AND state = 'completed' "
            f"ORDER BY created_at LIMIT 1) a, generate_series({first}::bigint, {last}::bigint) g")
        statements.append(
            "INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) SELECT permit_id, key_hash, id "
            f"FROM attempts WHERE id >= 'att_' || lpad(to_hex({first}), 32, '0') "
            f"AND id <= 'att_' || lpad(to_hex({last}), 32, '0') AND key_hash IS NOT NULL")
        statements += [definition for _, definition in indexes]
        statements += self.recount()
        self.sql("; ".join(statements))
        # What a store that grew over days has had done to it: its new rows vacuumed (hint
        # bits, visibility map) and analyzed, and written out by a checkpoint. Without this the
        # first measurement after a fill meets autovacuum and the checkpointer working
        # through gigabytes the fill just wrote.
        self.each([f"VACUUM (ANALYZE) {t}" for t in ("attempts", "idempotency_keys", "permits", "permit_tool_usage",
                                                    "permit_state_counts")] + ["CHECKPOINT"])

    def recount(self) -> list[str]:
        """The counters of the generated permits, from their rows."""
        held = ",".join(f"'{s}'" for s in HOLDS_SLOT)
        scale = "(SELECT id FROM permits WHERE label LIKE 'scale-fill-%')"
        return [
            f"DELETE FROM permit_tool_usage WHERE permit_id IN {scale}",
            "INSERT INTO permit_tool_usage (permit_id, tool, slots_held) SELECT permit_id, tool, count(*) "
            f"FROM attempts WHERE state IN ({held}) AND permit_id IN {scale} GROUP BY permit_id, tool",
            f"DELETE FROM permit_state_counts WHERE permit_id IN {scale}",
            "INSERT INTO permit_state_counts (permit_id, state, n) SELECT permit_id, state, count(*) "
            f"FROM attempts WHERE permit_id IN {scale} GROUP BY permit_id, state",
            "UPDATE permits p SET spent = t.spent FROM (SELECT permit_id, sum(cost) AS spent FROM attempts "
            f"WHERE state IN ({held}) GROUP BY permit_id) t WHERE t.permit_id = p.id AND p.label LIKE 'scale-fill-%'",
        ]

    def sizes(self) -> dict:
        rows = bench.psql(self.url, "SELECT coalesce(json_agg(t), '[]') FROM (SELECT c.relname AS name, "
                                    "CASE c.relkind WHEN 'i' THEN 'index' ELSE 'table' END AS kind, "
                                    "pg_relation_size(c.oid) AS bytes, "
                                    "CASE WHEN c.relkind = 'r' THEN pg_total_relation_size(c.oid) END AS total_bytes "
                                    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                                    f"WHERE n.nspname = '{self.schema}' AND c.relkind IN ('r', 'i') "
                                    "ORDER BY pg_relation_size(c.oid) DESC) t")
        return {"relations": json.loads(rows)}


class SqliteStore:
    dialect = "sqlite"

    def __init__(self, path: Path):
        self.path = path

    def _db(self) -> contextlib.closing[sqlite3.Connection]:
        # Closed on leaving the block (a connection's own `with` only ends a transaction): the
        # fill changes the journal mode, which no other open connection may see.
        return contextlib.closing(sqlite3.connect(self.path, timeout=60, isolation_level=None))

    def columns(self, db: sqlite3.Connection, table: str) -> list[str]:
        return [r[1] for r in db.execute(f"PRAGMA table_info({table})")]

    def count(self, table: str) -> int:
        with self._db() as db:
            return db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]

    def fill(self, template_permit: str, first: int, last: int, permits_wanted: int, now_ms: int) -> None:
        with self._db() as db:
            indexes = db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL "
                                 "AND tbl_name IN ('attempts', 'idempotency_keys')").fetchall()
            series = "WITH RECURSIVE s(g) AS (SELECT ? UNION ALL SELECT g + 1 FROM s WHERE g < ?) "
            # No ledger has the file open while it is filled. In WAL mode every new page of the
            # one big transaction would go to the log and be copied again at the checkpoint, and
            # the log's index grows with it (a fill to 10^7 had not finished in 30 minutes); a
            # rollback journal keeps only the few existing pages that change. The ledger puts the
            # file back into WAL mode when it opens it.
            db.execute("PRAGMA journal_mode = DELETE")
            db.execute("PRAGMA synchronous = OFF")
            db.execute("PRAGMA cache_size = -1048576")  # 1 GiB, for the index builds' sorts
            db.execute("BEGIN")
            have = db.execute("SELECT count(*) FROM permits WHERE label LIKE 'scale-fill-%'").fetchone()[0]
            pcols = self.columns(db, "permits")
            if have < permits_wanted:
                db.execute(f"{series}INSERT INTO permits ({','.join(pcols)}) "
                           f"SELECT {','.join(permit_columns(pcols, 'sqlite'))} FROM permits p, s WHERE p.id = ?",
                           (have + 1, permits_wanted, template_permit))
            for name, _ in indexes:
                db.execute(f"DROP INDEX {name}")
            acols = self.columns(db, "attempts")
            # The recursive series yields its first value even past the last: no batch, no rows.
            first, last = (first, last) if last >= first else (0, -1)
            db.execute(f"{series}INSERT INTO attempts ({','.join(acols)}) "
                       f"SELECT {','.join(attempt_columns(acols, now_ms, 'sqlite'))} FROM "
                       "(SELECT * FROM attempts WHERE permit_id = ? AND state = 'completed' ORDER BY created_at LIMIT 1) a, s "
                       "WHERE g >= 1",
                       (first, last, template_permit))
            db.execute("INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) SELECT permit_id, key_hash, id "
                       "FROM attempts WHERE id >= ? AND id <= ? AND key_hash IS NOT NULL",
                       (f"att_{first:032x}", f"att_{last:032x}"))
            for _, definition in indexes:
                db.execute(definition)
            held = ",".join(f"'{s}'" for s in HOLDS_SLOT)
            scale = "(SELECT id FROM permits WHERE label LIKE 'scale-fill-%')"
            db.execute(f"DELETE FROM permit_tool_usage WHERE permit_id IN {scale}")
            db.execute("INSERT INTO permit_tool_usage (permit_id, tool, slots_held) SELECT permit_id, tool, count(*) "
                       f"FROM attempts WHERE state IN ({held}) AND permit_id IN {scale} GROUP BY permit_id, tool")
            db.execute("DELETE FROM attempt_state_counts")
            db.execute("INSERT INTO attempt_state_counts (state, n) SELECT state, count(*) FROM attempts GROUP BY state")
            db.execute(f"UPDATE permits SET spent = (SELECT coalesce(sum(cost), 0) FROM attempts a "
                       f"WHERE a.permit_id = permits.id AND a.state IN ({held})) WHERE label LIKE 'scale-fill-%'")
            db.execute("COMMIT")
            db.execute("ANALYZE")
            db.execute("PRAGMA journal_mode = WAL")

    def sizes(self) -> dict:
        out: dict = {"file_bytes": self.path.stat().st_size}
        with self._db() as db:
            try:
                rows = db.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC").fetchall()
                kinds = dict(db.execute("SELECT name, type FROM sqlite_master").fetchall())
                out["relations"] = [{"name": n, "kind": kinds.get(n, "table"), "bytes": b} for n, b in rows]
            except sqlite3.OperationalError as e:  # a build without the dbstat table
                out["relations_error"] = str(e)
        return out


# ---------------------------------------------------------------- measuring

def template(ledger: stack.Ledger, name: str) -> str:
    """The template permit, and a second of real pairs under it; returns its id."""
    created = ledger.create_permit("--tools", "*", label=f"template-{name}")
    tokens = bench.permit_file(f"template-{name}", [created["token"]])
    saved = bench.LEDGER_SECONDS
    bench.LEDGER_SECONDS = 1
    try:
        out = bench.ledger_pairs(f"template-{name}", ledger, tokens, None)
    finally:
        bench.LEDGER_SECONDS = saved
    if out.get("error") or not out.get("pairs"):
        raise RuntimeError(f"template pairs failed: {out}")
    return created["id"]


def wal(store_url: str | None) -> dict:
    """PostgreSQL's write-ahead log so far (`pg_stat_wal`, the whole cluster): bytes, records
    and full-page images. A page's first change after a checkpoint writes the whole page
    into the log, so a store whose index inserts land on pages nobody touched since the last
    checkpoint writes more per call as it grows; this is how that shows."""
    if not store_url:
        return {}
    row = bench.psql(store_url, "SELECT wal_bytes || ',' || wal_records || ',' || wal_fpi FROM pg_stat_wal")
    wal_bytes, records, fpi = (float(x) for x in row.split(","))
    return {"bytes": wal_bytes, "records": records, "fpi": fpi}


def per(after: dict, before: dict, n: float) -> dict:
    return {k: round((after[k] - before[k]) / max(n, 1), 2) for k in after}


def measure(name: str, store_url: str | None, pg: bench.OwnPostgres | None, b_ceiling: float,
            mcp_port: int, permit_tokens_name: str) -> dict:
    """The calls at RATE % of B through Envoy, then the ledger alone, on the filled store."""
    ledger = bench.start_ledger(name, store_url, keep=True)
    envoy = None
    try:
        permit = ledger.create_permit("--tools", "*", label=f"bench-{permit_tokens_name}")["token"]
        envoy = bench.Envoy(name, bench.ATMOST_WASM, mcp_port, [ledger.port], {"ledger": {"service_token": bench.SERVICE_TOKEN}})
        envoy.start()
        procs = bench.Procs()
        procs.add("envoy", [envoy.proc.pid])
        procs.add("ledger", [ledger.proc.pid])
        if store_url:
            bench.watch_postgres(procs, pg, store_url)
            bench.reset_statements(store_url)
        bodies = bench.body_file(name, [bench.CALL_FRESH])
        prefix = f"{name}-{bench.STAMP}"
        bench.wrk(envoy.url, bodies, 2, prefix + "-warm", permit)
        before, wal_before = procs.cpu(), wal(store_url)
        r = bench.fixed_rate(envoy.url, bodies, b_ceiling * RATE / 100, prefix + "-rate", permit)
        after, wal_after = procs.cpu(), wal(store_url)
        done = max(r.get("completed", 0), 1)
        r["cpu_s_per_1000"] = {p: round((after[p] - before[p]) / done * 1000, 4) for p in after}
        if store_url:
            r["wal_per_call"] = per(wal_after, wal_before, done)
        if store_url:
            r["pg_statements"] = bench.top_statements(store_url)
        tokens = bench.permit_file(f"{name}-alone", [ledger.create_permit("--tools", "*", label="alone")["token"]])
        wal_before = wal(store_url)
        alone = bench.ledger_pairs(name, ledger, tokens, store_url, pg=pg)
        if store_url and alone.get("pairs"):
            alone["wal_per_pair"] = per(wal(store_url), wal_before, alone["pairs"])
        return {"rate": r, "ledger_alone": alone, "peak_rss_mib": procs.hwm_mib()}
    finally:
        if envoy:
            envoy.stop()
        ledger.stop()


def plans(pg: bench.OwnPostgres, store_url: str, name: str, mcp_port: int, b_ceiling: float) -> list[dict]:
    """EXPLAIN ANALYZE of every statement of a short burst of calls (auto_explain in the
    ledger's sessions), one plan per distinct statement."""
    settings = {"auto_explain.log_min_duration": "0",
                "auto_explain.log_analyze": "on", "auto_explain.log_buffers": "on",
                "auto_explain.log_nested_statements": "on"}
    log_path = pg.dir / "server.log"
    start_at = log_path.stat().st_size if log_path.exists() else 0
    for k, v in settings.items():
        bench.psql(pg.url, f"ALTER SYSTEM SET {k} = {v}")
    bench.psql(pg.url, "SELECT pg_reload_conf()")
    saved = (bench.RATE_SECONDS, bench.LEDGER_SECONDS)
    bench.RATE_SECONDS, bench.LEDGER_SECONDS = 2, 1
    try:
        measure(name, store_url, pg, b_ceiling, mcp_port, name)
    finally:
        bench.RATE_SECONDS, bench.LEDGER_SECONDS = saved
        for k in settings:
            bench.psql(pg.url, f"ALTER SYSTEM RESET {k}")
        bench.psql(pg.url, "SELECT pg_reload_conf()")
    with open(log_path, encoding="utf-8", errors="replace") as f:
        f.seek(start_at)
        text = f.read()
    found: dict[str, dict] = {}
    for entry in re.split(r"\n(?=\S.*LOG:\s+duration:)", text):
        m = re.search(r"duration: ([\d.]+) ms\s+plan:\s*\n\s*Query Text: (.*?)\n(.*)", entry, re.S)
        if not m:
            continue
        query = re.sub(r"\s+", " ", m.group(2)).strip()
        if "pg_stat_statements" in query or "search_path" in query.lower():
            continue
        # The plan's own lines (tab-indented), not the log lines after it (CONTEXT, STATEMENT).
        plan = "\n".join(line[1:] for line in m.group(3).splitlines() if line.startswith("\t"))
        item = found.setdefault(query, {"query": query, "count": 0, "plan": plan, "max_ms": 0.0})
        item["count"] += 1
        item["max_ms"] = max(item["max_ms"], float(m.group(1)))
    return sorted(found.values(), key=lambda p: -p["count"])


# ---------------------------------------------------------------- the report

def figures(m: dict, store: str) -> dict:
    rate = m["rate"]
    cpu = rate.get("cpu_s_per_1000", {})
    return {"p50_ms": rate.get("p50_us", 0) / 1000, "p99_ms": rate.get("p99_us", 0) / 1000,
            "postgres_cpu_ms": cpu.get("postgres") if store == "postgres" else None,
            "ledger_cpu_ms": cpu.get("ledger"), "envoy_cpu_ms": cpu.get("envoy"),
            "ledger_alone_pairs_per_s": m["ledger_alone"].get("pairs_per_s")}


def write_report(res: dict) -> list[str]:
    out = ["# What a call costs as the store grows", "",
           "Machine: " + ", ".join(f"{k} {v}" for k, v in res["machine"].items()) + f". B's ceiling {res['b_ceiling_rps']:.0f} requests/s; the calls run at "
           f"{RATE:g} % of it ({res['rate_rps']:.0f}/s) for {bench.RATE_SECONDS:g} s per size; B's own p50 / p99 at "
           f"that rate: {res['b_rate']['p50_us'] / 1000:.2f} / {res['b_rate']['p99_us'] / 1000:.2f} ms. "
           f"Filled with {PREFILL_PERMITS:,} permits.", "",
           "| store | attempts | p50 ms (added) | p99 ms (added) | PostgreSQL CPU ms/call | ledger CPU ms/call | "
           "Envoy CPU ms/call | ledger alone pairs/s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    b50, b99 = res["b_rate"]["p50_us"] / 1000, res["b_rate"]["p99_us"] / 1000
    verdicts = []
    for store, sizes in res["stores"].items():
        base = None
        for size, m in sizes.items():
            f = figures(m, store)
            cell = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
            out.append(f"| {store} | {int(size):,} | {f['p50_ms']:.2f} (+{f['p50_ms'] - b50:.2f}) | "
                       f"{f['p99_ms']:.2f} (+{f['p99_ms'] - b99:.2f}) | {cell(f['postgres_cpu_ms'])} | "
                       f"{cell(f['ledger_cpu_ms'])} | {cell(f['envoy_cpu_ms'])} | "
                       f"{f['ledger_alone_pairs_per_s'] or 0:.0f} |")
            if base is None:
                base = f
                continue
            for key in ("p50_ms", "p99_ms", "postgres_cpu_ms", "ledger_cpu_ms", "ledger_alone_pairs_per_s"):
                if base.get(key) in (None, 0) or f.get(key) is None:
                    continue
                change = (f[key] - base[key]) / base[key]
                worse = -change if key == "ledger_alone_pairs_per_s" else change
                verdicts.append(f"{'PASS' if worse <= 0.10 else 'FAIL'}  {store} {key} at {int(size):,}: "
                                f"{f[key]:.3f} vs {base[key]:.3f} at the smallest size ({change:+.1%}; limit +10 %)")
    out += ["", "## Within 10 % of the smallest size", "", *[f"- {v}" for v in verdicts], ""]
    for store, sizes in res["stores"].items():
        rows = [(size, m["rate"].get("wal_per_call"), m["ledger_alone"].get("wal_per_pair")) for size, m in sizes.items()]
        if not any(call for _, call, _ in rows):
            continue
        out += [f"## {store}: write-ahead log per call", "",
                "`pg_stat_wal` of the whole cluster over the calls at the bench's rate and over the ledger-alone run. "
                "A full-page image is a page's first change after a checkpoint, written into the log whole.", "",
                "| attempts | WAL bytes/call | full pages/call | WAL bytes/pair, ledger alone | full pages/pair |",
                "|---:|---:|---:|---:|---:|"]
        for size, call, pair in rows:
            call, pair = call or {}, pair or {}
            out.append(f"| {int(size):,} | {call.get('bytes', 0):,.0f} | {call.get('fpi', 0):.2f} | "
                       f"{pair.get('bytes', 0):,.0f} | {pair.get('fpi', 0):.2f} |")
        out.append("")
    for store, sizes in res["stores"].items():
        largest = list(sizes)[-1]
        sz = sizes[largest].get("sizes", {})
        out += [f"## {store}: tables and indexes at {int(largest):,} attempts", ""]
        if "file_bytes" in sz:
            out.append(f"The file: {sz['file_bytes'] / 2**20:,.1f} MiB.")
            out.append("")
        out += ["| relation | kind | MiB | with indexes and TOAST, MiB |", "|---|---|---:|---:|"]
        for r in sz.get("relations", [])[:20]:
            total = r.get("total_bytes")
            out.append(f"| {r['name']} | {r['kind']} | {r['bytes'] / 2**20:,.1f} | "
                       f"{'' if total is None else f'{total / 2**20:,.1f}'} |")
        out.append("")
    if res.get("plans"):
        out += [f"## PostgreSQL: the plans of the calls' statements at {int(SIZES[-1]):,} attempts", "",
                "EXPLAIN ANALYZE (auto_explain) of every statement of a short burst of calls, one plan per statement, "
                "the most frequent first.", ""]
        for p in res["plans"]:
            out += [f"**{p['count']} ×, at most {p['max_ms']:.3f} ms:** `{p['query'][:300]}`", "", "```text",
                    p["plan"], "```", ""]
    (bench.OUT / "results.md").write_text("\n".join(out) + "\n")
    return verdicts


def main() -> int:
    began = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench.RUN.mkdir(parents=True, exist_ok=True)
    # The ledgers log at the shipped default (info: a line per decision and per report).
    os.environ.pop("RUST_LOG", None)
    for path in (bench.STUB, bench.LOAD, bench.ATMOST_WASM, bench.LEDGER_BIN):
        if not path.exists():
            log(f"missing {path}: run `make bench-scale`")
            return 2
    if SIZES != sorted(SIZES) or not SIZES:
        log("BENCH_SCALE_ATTEMPTS: ascending sizes, e.g. 10000,1000000")
        return 2
    # Loaded from the start, off (log_min_duration -1) until the plans are taken.
    bench.OwnPostgres.PRELOAD = "pg_stat_statements,auto_explain"
    bench.OwnPostgres.SETTINGS = os.environ.get("BENCH_SCALE_PG_SETTINGS", "").split()
    res: dict = {"machine": bench.machine(), "sizes": SIZES, "permits": PREFILL_PERMITS, "rate_percent": RATE,
                 "stores": {}}
    running: list = []
    pg = None
    try:
        pg, pg_url = bench.start_postgres(res) if "postgres" in STORES else (None, None)
        _, mcp_port, callout_port = bench.start_stub(running)
        plain = bench.Envoy("B", None, mcp_port, [callout_port])
        plain.start()
        running.append(plain)
        bodies = bench.body_file("B", [bench.CALL_FRESH])
        res["b_ceiling_rps"] = bench.wrk(plain.url, bodies, bench.SECONDS, "B-ceil", None)["rps"]
        res["rate_rps"] = res["b_ceiling_rps"] * RATE / 100
        res["b_rate"] = bench.fixed_rate(plain.url, bodies, res["rate_rps"], "B-rate", None)
        plain.stop()
        running.remove(plain)
        log(f"B: ceiling {res['b_ceiling_rps']:.0f}/s; at {RATE:g} %: p50 {res['b_rate']['p50_us'] / 1000:.2f} ms")
        for store_name in STORES:
            if store_name == "postgres" and not pg_url:
                res.setdefault("pending", []).append("postgres: no PostgreSQL")
                continue
            name = f"scale-{store_name}"
            url = pg_url if store_name == "postgres" else None
            ledger = bench.start_ledger(name, url)
            try:
                template_id = template(ledger, name)
            finally:
                ledger.stop()
            store = (PgStore(pg_url, bench.pg_schema(name)) if url
                     else SqliteStore(bench.RUN / f"data-{name}" / "atmost.sqlite3"))
            generated = 0
            sizes: dict = {}
            for size in SIZES:
                wanted = max(size - store.count("attempts"), 0)
                t0 = time.monotonic()
                store.fill(template_id, generated + 1, generated + wanted, PREFILL_PERMITS, int(time.time() * 1000))
                generated += wanted
                log(f"{name}: filled to {store.count('attempts'):,} attempts in {time.monotonic() - t0:.0f} s")
                m = measure(name, url, pg, res["b_ceiling_rps"], mcp_port, f"{name}-{size}")
                m["attempts"] = store.count("attempts")
                m["sizes"] = store.sizes()
                sizes[str(size)] = m
                f = figures(m, store_name)
                log(f"{name} at {size:,}: p50 {f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms, "
                    f"ledger alone {f['ledger_alone_pairs_per_s'] or 0:.0f} pairs/s")
            res["stores"][store_name] = sizes
            if url and pg:
                res["plans"] = plans(pg, url, name, mcp_port, res["b_ceiling_rps"])
    finally:
        for p in reversed(running):
            p.stop()
        if pg:
            pg.stop()
        elif "postgres" in STORES and os.environ.get("DATABASE_URL"):
            bench.drop_pg_schemas(os.environ["DATABASE_URL"], ["scale-postgres"])
        shutil.rmtree(bench.RUN / "data-scale-sqlite", ignore_errors=True)
    res["wall_seconds"] = round(time.monotonic() - began)
    verdicts = write_report(res)
    (bench.OUT / "results.json").write_text(json.dumps(res, indent=1, default=str))
    print("\n".join(verdicts))
    print(f"\nwrote {bench.OUT / 'results.md'} and {bench.OUT / 'results.json'} ({res['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
