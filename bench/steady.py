#!/usr/bin/env python3
"""`make bench-steady`: a steady load for half an hour, with a short replay retention. Does the
pruner keep up, does PostgreSQL's autovacuum keep up, do the processes' memory and the calls'
latency stay where they were at the start?

One gateway (Envoy with the filter, one worker, as `make bench` runs it) in front of the stub
upstream, one ledger on PostgreSQL (the bench's own cluster, setup E of `make bench`) or on
SQLite (setup D). The calls go as teams send them, with a permit per task: BENCH_STEADY_PERMITS
permits at a time, each created with the retention BENCH_STEADY_RETENTION and an expiry
BENCH_STEADY_PERMIT_LIFE ahead, and replaced between windows by a new one when it would expire
before the next window ends (the first ones' lives are staggered, so a few are replaced at each
window, not all at once). Request n goes under permit n mod permits, every call with a fresh
idempotency key. The ledger purges the history of a permit BENCH_STEADY_PURGE_AFTER after it
expired (`--purge-ended-permits-after`, docs/design.md, "Purging ended permits"). The load is
consecutive open-loop windows of BENCH_STEADY_WINDOW seconds at BENCH_STEADY_RATE calls/s
(bench/loadgen `rate`), BENCH_STEADY_SECONDS in all. After each window (and once before the
first) the bench samples:

  - the window's p50 / p99 / p99.9 (from each request's due time), its errors, non-2xx
    answers and denials (the gateway's `atmost_denied` counter);
  - the store: attempts (every row, and those still holding their receipt, i.e. not yet
    pruned); bytes on disk (PostgreSQL: pg_total_relation_size of every table of the
    ledger's schema, indexes and TOAST included; SQLite: the file and its WAL); on
    PostgreSQL the attempts table's live and dead tuples and its autovacuum count
    (pg_stat_user_tables); on SQLite the free pages of the file;
  - the receipts the ledger pruned, the attempts and permits it purged, and its sweeps
    (`atmost_receipts_pruned_total`, `atmost_attempts_purged_total`,
    `atmost_permits_purged_total`, `atmost_sweeps_total`); the permit rows;
  - the resident memory (VmRSS) of the ledger and of Envoy, and Envoy's heap (/memory);
  - each process's CPU per call over the window (PostgreSQL's every backend included).

The pruner is the ledger's sweeper: every `--sweep-interval` (BENCH_STEADY_SWEEP, default 1s, the
ledger's default) it turns every receipt older than its permit's retention into a tombstone.
The tombstone row stays, with its idempotency key (docs/design.md, "Attempt states"), so that
reusing the key fails closed, for as long as its permit can authorize; the same sweeper
purges the permit's attempts, keys and the permit itself once it has been expired for the
purge delay. So the store holds about rate × (permit life + purge delay) rows.

Checks (PASS/FAIL, each with its rule; "baseline": the first sample at or after a third of the
run, the retention plus one window, and the permit life plus the purge delay plus one window,
when the pruner and the purge have each been running a window long):
  - every window: no error, no non-2xx, no denial, the schedule kept (not overloaded);
  - latency: the median over the last k windows of the windows' p50 at most 20 % above the
    median over the first k windows after the first (warm-up) window; the same for p99, or
    at most 1 ms above (k = 5, or a third of the windows when there are fewer than 16);
  - receipts held: the maximum over the last third at most 10 % above the baseline (the
    pruner keeps up);
  - rows and bytes on disk: the maximum over the last third at most 10 % above the baseline
    (the issue's words: "stop growing after the first window");
  - bytes per attempt row at the rows' peak: the most bytes over the last third divided by the
    most rows over it, at most 10 % above the same over the middle third (the space a pruned
    receipt or a purged attempt leaves is used again: autovacuum on PostgreSQL, the free pages
    of SQLite's file). Rows rise and fall as permits are purged a window at a time while the
    bytes stay, so a ratio of one sample would measure where in that cycle it fell;
  - PostgreSQL: autovacuum processed the attempts table during the last third;
  - memory: for the ledger and Envoy, the median VmRSS over the last third at most 10 % above
    the median over the second third.

Environment (besides bench/run.py's BENCH_PG_BINDIR and BENCH_LEDGER_BIN):
  BENCH_STEADY_SECONDS    the whole load, seconds (default 1800)
  BENCH_STEADY_RATE       calls per second (default 200)
  BENCH_STEADY_WINDOW     one window, seconds (default 30)
  BENCH_STEADY_RETENTION  the permits' retention, as the admin API takes it (default "5m")
  BENCH_STEADY_PERMITS    permits the calls are spread over at a time (default 10)
  BENCH_STEADY_PERMIT_LIFE  each permit's expiry after its creation (default "5m")
  BENCH_STEADY_PURGE_AFTER  the ledger's --purge-ended-permits-after (default "1m")
  BENCH_STEADY_SWEEP      the ledger's --sweep-interval (default "1s")
  BENCH_STEADY_STORE      "postgres" (default) or "sqlite"

A short form: BENCH_STEADY_SECONDS=360 BENCH_STEADY_WINDOW=15 BENCH_STEADY_RETENTION=1m
BENCH_STEADY_PERMIT_LIFE=1m BENCH_STEADY_PURGE_AFTER=30s.
Writes target/bench/steady/results.md, results.json, latency.png, store.png and memory.png.
`bench/steady.py report [results.json]` writes the checks, the report and the pictures again
from a run's results.json, into its directory (when a rule here changed after the run).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("BENCH_OUT", str(Path(__file__).resolve().parents[1] / "target" / "bench" / "steady"))
import run as bench  # noqa: E402  (one method: the same processes, load and CPU accounting as `make bench`)

stack = bench.stack
SECONDS = float(os.environ.get("BENCH_STEADY_SECONDS", "1800"))
RATE = float(os.environ.get("BENCH_STEADY_RATE", "200"))
WINDOW = float(os.environ.get("BENCH_STEADY_WINDOW", "30"))
RETENTION = os.environ.get("BENCH_STEADY_RETENTION", "5m")
PERMITS = int(os.environ.get("BENCH_STEADY_PERMITS", "10"))
PERMIT_LIFE = os.environ.get("BENCH_STEADY_PERMIT_LIFE", "5m")
PURGE_AFTER = os.environ.get("BENCH_STEADY_PURGE_AFTER", "1m")
SWEEP = os.environ.get("BENCH_STEADY_SWEEP", "1s")
STORE = os.environ.get("BENCH_STEADY_STORE", "postgres")
NAME = f"steady-{STORE}"
# The limits of the checks (the module's docstring states each rule).
LATENCY_LIMIT = 0.20
P99_SLACK_MS = 1.0
GROWTH_LIMIT = 0.10
RSS_LIMIT = 0.10
COMPARED_WINDOWS = 5
# A permit is replaced when it would expire before the next window ends and this much after
# (the window's last calls, its sample).
ROTATION_SLACK_S = 10.0
UNITS = {"s": 1, "m": 60, "h": 3600}


def log(msg: str) -> None:
    bench.log(msg)


def duration_s(text: str) -> float:
    """The subset of the ledger's durations this bench takes: a number and s, m or h."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh])\s*", text)
    if not m:
        raise ValueError(f"{text!r}: write a duration as 90s, 5m or 1h")
    return float(m.group(1)) * UNITS[m.group(2)]


# ---------------------------------------------------------------- the store's figures

class PgStore:
    """The ledger's schema on the bench's PostgreSQL."""

    def __init__(self, url: str, schema: str):
        self.url, self.schema = url, schema

    def sample(self) -> dict:
        s = self.schema
        row = bench.psql(self.url, (
            "SELECT json_build_object("
            f"'attempts', (SELECT count(*) FROM {s}.attempts), "
            f"'permits', (SELECT count(*) FROM {s}.permits), "
            f"'receipts_held', (SELECT count(*) FROM {s}.attempts WHERE pruned_at IS NULL), "
            "'attempts_table', (SELECT json_build_object('live', n_live_tup, 'dead', n_dead_tup, "
            "'autovacuum_count', autovacuum_count, 'last_autovacuum', last_autovacuum, "
            "'autoanalyze_count', autoanalyze_count) "
            f"FROM pg_stat_user_tables WHERE schemaname = '{s}' AND relname = 'attempts'))"))
        return {**json.loads(row), "bytes": sum(self.tables().values())}

    def tables(self) -> dict:
        """Each table's bytes on disk, its indexes and TOAST included."""
        return json.loads(bench.psql(self.url, "SELECT json_object_agg(relname, pg_total_relation_size(relid)) "
                                               f"FROM pg_stat_user_tables WHERE schemaname = '{self.schema}'"))


class SqliteStore:
    """The ledger's SQLite file, read from a read-only connection of its own (WAL mode: the
    ledger's writer goes on)."""

    def __init__(self, path: Path):
        self.path = path
        self.wal = path.with_name(path.name + "-wal")

    def _query(self, sql: str):
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        try:
            return db.execute(sql).fetchone()[0]
        finally:
            db.close()

    def sample(self) -> dict:
        file_bytes = self.path.stat().st_size
        wal_bytes = self.wal.stat().st_size if self.wal.exists() else 0
        page = self._query("PRAGMA page_size")
        return {"attempts": self._query("SELECT count(*) FROM attempts"),
                "permits": self._query("SELECT count(*) FROM permits"),
                "receipts_held": self._query("SELECT count(*) FROM attempts WHERE pruned_at IS NULL"),
                "bytes": file_bytes + wal_bytes, "file_bytes": file_bytes, "wal_bytes": wal_bytes,
                "free_bytes": self._query("PRAGMA freelist_count") * page}

    def tables(self) -> dict:
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        try:
            return dict(db.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC").fetchall())
        except sqlite3.OperationalError as e:  # a build without the dbstat table
            return {"error": str(e)}
        finally:
            db.close()


def ledger_counters(ledger: stack.Ledger) -> dict:
    text = ledger.metrics()
    return {"pruned": bench.metric_total(text, "atmost_receipts_pruned_total"),
            "purged_attempts": bench.metric_total(text, "atmost_attempts_purged_total"),
            "purged_permits": bench.metric_total(text, "atmost_permits_purged_total"),
            "sweeps": bench.metric_total(text, "atmost_sweeps_total")}


class PermitPool:
    """The permits the calls go under, one per task: `count` at a time, each replaced by a
    new one (written to the load generator's permit file) when it would expire before the
    next window ends. The first ones' lives are staggered over (window, life], so a few are
    replaced at each window rather than all at once."""

    def __init__(self, ledger: stack.Ledger, count: int, life_s: float, window_s: float):
        self.ledger, self.life_s, self.window_s = ledger, life_s, window_s
        self.created = 0
        shortest = window_s + ROTATION_SLACK_S + 1
        self.slots = [self._new(max(life_s * (i + 1) / count, shortest)) for i in range(count)]
        self.path = bench.permit_file(NAME, [token for token, _ in self.slots])

    def _new(self, life_s: float) -> tuple[str, float]:
        [token] = bench.create_permits(self.ledger, 1, f"{NAME}-task-{self.created}", retention=RETENTION,
                                       expires=f"{life_s:.0f}s")
        self.created += 1
        return token, time.monotonic() + life_s

    def rotate(self) -> int:
        """Replaces the permits that would expire before the next window is over; how many."""
        due = time.monotonic() + self.window_s + ROTATION_SLACK_S
        replaced = 0
        for i, (_, expires) in enumerate(self.slots):
            if expires <= due:
                self.slots[i] = self._new(self.life_s)
                replaced += 1
        if replaced:
            bench.permit_file(NAME, [token for token, _ in self.slots])
        return replaced


def sample(t: float, store, ledger: stack.Ledger, envoy: bench.Envoy) -> dict:
    heap = envoy.memory()
    return {"t_s": round(t, 1), **store.sample(), **ledger_counters(ledger),
            "rss_kib": {"ledger": bench.status_kib(ledger.proc.pid, "VmRSS"),
                        "envoy": bench.status_kib(envoy.proc.pid, "VmRSS")},
            "envoy_heap_allocated": int(heap.get("allocated", 0))}


# ---------------------------------------------------------------- the checks

def thirds(items: list) -> tuple[list, list, list]:
    n = len(items)
    return items[: n // 3], items[n // 3: 2 * n // 3], items[2 * n // 3:]


def latency_checks(windows: list[dict]) -> list[tuple[str, bool, str]]:
    out = []
    k = max(1, min(COMPARED_WINDOWS, (len(windows) - 1) // 3))
    if len(windows) < 2 * k + 1:
        return [("latency at the end matches the start", False, f"only {len(windows)} windows")]
    first, last = windows[1: 1 + k], windows[-k:]
    for key, slack in (("p50_ms", 0.0), ("p99_ms", P99_SLACK_MS)):
        start = statistics.median(w[key] for w in first)
        end = statistics.median(w[key] for w in last)
        limit = max(start * (1 + LATENCY_LIMIT), start + slack)
        out.append((f"latency {key[:3]}: last {k} windows vs windows 2–{k + 1}", end <= limit,
                    f"{end:.2f} ms vs {start:.2f} ms; limit {limit:.2f} ms "
                    f"(+{LATENCY_LIMIT:.0%}{f' or +{slack:g} ms' if slack else ''})"))
    return out


def growth_check(label: str, samples: list[dict], base: dict, value, unit: str, note: str = "") -> tuple:
    last = thirds(samples)[2]
    worst = max(value(s) for s in last)
    start = value(base)
    limit = start * (1 + GROWTH_LIMIT)
    change = (worst - start) / start if start else float("inf")
    return (label, worst <= limit,
            f"max over the last third {worst:,.0f}{unit} vs {start:,.0f}{unit} at {base['t_s']:.0f} s "
            f"({change:+.1%}; limit +{GROWTH_LIMIT:.0%}){note}")


def space_reused(samples: list[dict]) -> tuple:
    """Bytes on disk per attempt row at the rows' peak, the last third against the middle one."""
    def at_peak(part: list[dict]) -> float:
        return max(s["bytes"] for s in part) / max(max(s["attempts"] for s in part), 1)

    _, second, last = thirds(samples)
    mid, end = at_peak(second), at_peak(last)
    return ("bytes per attempt row at the rows' peak (pruned space used again)", end <= mid * (1 + GROWTH_LIMIT),
            f"most bytes over most rows: the last third {end:,.0f} B, the middle third {mid:,.0f} B "
            f"({(end - mid) / mid:+.1%}; limit +{GROWTH_LIMIT:.0%})")


def baseline(res: dict) -> dict | None:
    """The first sample at or after a third of the run, the retention plus one window, and the
    permit life plus the purge delay plus one window."""
    after = max(res["seconds"] / 3, res["retention_s"] + res["window_s"],
                res["permit_life_s"] + res["purge_after_s"] + res["window_s"])
    return next((s for s in res["samples"][1:] if s["t_s"] >= after), None)


def kept_per_call(res: dict) -> dict | None:
    """What the store keeps for good per call once the pruner and the purge run: rows and
    bytes added from the baseline to the end, over the calls made in that stretch."""
    samples = res["samples"]
    base, end = baseline(res), samples[-1]
    if not base or end is base:
        return None
    # Window i ends with sample i + 1: the windows after the baseline's sample.
    calls = sum(w["completed"] for w in res["windows"][samples.index(base):])
    if not calls:
        return None
    per_call = (end["bytes"] - base["bytes"]) / calls
    return {"from_s": base["t_s"], "to_s": end["t_s"], "calls": calls, "bytes_per_call": round(per_call, 1),
            "rows_per_call": round((end["attempts"] - base["attempts"]) / calls, 4),
            "gib_per_day_at_rate": round(per_call * res["rate"] * 86400 / 2**30, 2)}


def checks(res: dict) -> list[tuple[str, bool, str]]:
    windows, samples = res["windows"], res["samples"]
    out = []
    bad = [w for w in windows if w["errors"] or w["non2xx"] or w["denied"] or w["overloaded"]]
    out.append(("every window without errors, denials or a missed schedule", not bad,
                f"{len(windows)} windows, {sum(w['completed'] for w in windows):,} calls"
                + (f"; {len(bad)} bad, the first at {bad[0]['start_s']:.0f} s: errors {bad[0]['errors']}, "
                   f"non-2xx {bad[0]['non2xx']}, denied {bad[0]['denied']} {bad[0]['denied_codes'] or ''}, "
                   f"overloaded {bad[0]['overloaded']}, max latency {bad[0]['max_ms']:.0f} ms"
                   if bad else "")))
    out += latency_checks(windows)
    base = baseline(res)
    if not base or base is samples[-1]:
        out.append(("store figures", False,
                    "the run is too short for a baseline after the retention and the first purges"))
        return out
    expected = res["rate"] * (res["retention_s"] + duration_s(res["sweep"]))
    out.append(growth_check("receipts held (not yet pruned)", samples, base, lambda s: s["receipts_held"], "",
                            f"; rate × (retention + sweep interval) = {expected:,.0f}"))
    held = res["rate"] * (res["permit_life_s"] + res["purge_after_s"])
    out.append(growth_check("attempt rows (the issue: stop growing)", samples, base, lambda s: s["attempts"], "",
                            f"; rate × (permit life + purge delay) = {held:,.0f}"))
    last = thirds(samples)[2]
    out.append(("the purge ran during the last third", last[-1]["purged_attempts"] > last[0]["purged_attempts"],
                f"attempts purged {last[0]['purged_attempts']:,.0f} at {last[0]['t_s']:.0f} s, "
                f"{last[-1]['purged_attempts']:,.0f} at {last[-1]['t_s']:.0f} s; permits purged in all "
                f"{last[-1]['purged_permits']:,.0f} of {res.get('permits_created', 0)} created"))
    out.append(growth_check("bytes on disk (the issue: stop growing)", samples, base,
                            lambda s: s["bytes"] / 2**20, " MiB"))
    out.append(space_reused(samples))
    if res["store"] == "postgres":
        second, last = thirds(samples)[1:]
        before, after = second[-1]["attempts_table"]["autovacuum_count"], last[-1]["attempts_table"]["autovacuum_count"]
        out.append(("autovacuum processed attempts during the last third", after > before,
                    f"autovacuum_count {before} at {second[-1]['t_s']:.0f} s, {after} at {last[-1]['t_s']:.0f} s"))
    _, second, last = thirds(samples[1:])
    for proc in ("ledger", "envoy"):
        mid = statistics.median(s["rss_kib"][proc] for s in second) / 1024
        end = statistics.median(s["rss_kib"][proc] for s in last) / 1024
        out.append((f"{proc} resident memory", end <= mid * (1 + RSS_LIMIT),
                    f"median over the last third {end:.1f} MiB vs {mid:.1f} MiB over the second "
                    f"({(end - mid) / mid:+.1%}; limit +{RSS_LIMIT:.0%})"))
    return out


# ---------------------------------------------------------------- the pictures

def plots(res: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows, samples = res["windows"], res["samples"]
    minutes = lambda seconds: [x / 60 for x in seconds]  # noqa: E731
    retention_min = res["retention_s"] / 60
    title = f"{res['rate']:g} calls/s, retention {res['retention']}, {res['store']}"
    written = []

    def finish(fig, ax, name: str) -> None:
        for a in ax if isinstance(ax, (list, tuple)) else [ax]:
            a.axvline(retention_min, color="grey", linestyle=":", linewidth=1)
            a.grid(True, alpha=0.3)
        ax_last = ax[-1] if isinstance(ax, (list, tuple)) else ax
        ax_last.set_xlabel("minutes since the load started (dotted: the retention)")
        fig.tight_layout()
        fig.savefig(bench.OUT / name, dpi=110)
        plt.close(fig)
        written.append(name)

    mid = minutes([w["start_s"] + w["seconds"] / 2 for w in windows])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(mid, [w["p50_ms"] for w in windows], marker=".", label="p50")
    ax.plot(mid, [w["p99_ms"] for w in windows], marker=".", label="p99")
    # Log scale: p50 and p99 differ by a factor of several, and one stalled window by far more.
    ax.set_yscale("log")
    ax.set_ylabel("ms, per window (log scale)")
    ax.set_title(f"Latency of governed calls: {title}")
    ax.legend()
    finish(fig, ax, "latency.png")

    t = minutes([s["t_s"] for s in samples])
    fig, (rows, size) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    rows.plot(t, [s["attempts"] for s in samples], label="attempt rows")
    rows.plot(t, [s["receipts_held"] for s in samples], label="holding a receipt (not pruned)")
    rows.set_ylabel("rows")
    rows.set_ylim(bottom=0)
    rows.legend()
    rows.set_title(f"The store: {title}")
    size.plot(t, [s["bytes"] / 2**20 for s in samples], label="on disk (tables, indexes, TOAST)"
              if res["store"] == "postgres" else "on disk (file and WAL)")
    size.set_ylabel("MiB")
    size.set_ylim(bottom=0)
    if res["store"] == "postgres":
        dead = size.twinx()
        dead.plot(t, [s["attempts_table"]["dead"] for s in samples], color="tab:red", alpha=0.5,
                  label="dead tuples of attempts (right)")
        dead.set_ylabel("dead tuples")
        dead.set_ylim(bottom=0)
        dead.legend(loc="lower right")
    size.legend(loc="upper left")
    finish(fig, [rows, size], "store.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    for proc in ("ledger", "envoy"):
        ax.plot(t, [s["rss_kib"][proc] / 1024 for s in samples], marker=".", label=f"{proc} VmRSS")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Resident memory: {title}")
    ax.legend()
    finish(fig, ax, "memory.png")
    return written


# ---------------------------------------------------------------- the report

def write_report(res: dict, verdicts: list, pictures: list[str]) -> None:
    pg = res["store"] == "postgres"
    out = ["# Steady load with a short retention", "",
           "Machine: " + ", ".join(f"{k} {v}" for k, v in res["machine"].items()) + ".", "",
           f"{res['rate']:g} calls/s for {res['seconds']:g} s in windows of {res['window_s']:g} s, fresh keys over "
           f"{res['permits']} permits at a time with retention {res['retention']}, each expiring "
           f"{res['permit_life']} after its creation and then replaced ({res.get('permits_created', 0)} created), "
           f"their history purged {res['purge_after']} after they expired; the ledger on "
           f"{'PostgreSQL (' + res.get('postgres', {}).get('server', '') + ')' if pg else 'SQLite'}, "
           f"its sweeper every {res['sweep']}. Wall time {res.get('wall_seconds', 0)} s.", "",
           "## Checks", "", *[f"- {'PASS' if ok else 'FAIL'} {label}: {detail}" for label, ok, detail in verdicts], ""]
    kept = res.get("kept_per_call")
    if kept:
        out += [f"Kept for good once the pruner and the purge run (from {kept['from_s']:.0f} s to "
                f"{kept['to_s']:.0f} s, {kept['calls']:,} calls): {kept['rows_per_call']:+.4f} rows and "
                f"{kept['bytes_per_call']:+,.0f} bytes on disk per call, "
                f"{kept['gib_per_day_at_rate']:+,.2f} GiB a day at {res['rate']:g} calls/s.", ""]
    out += [f"![{p}]({p})" for p in pictures] + [""]
    out += ["## Per window", "",
            "CPU in ms per call over the window; the store and memory as sampled after it.", "",
            "| end s | p50 ms | p99 ms | calls | bad | rows | receipts held | permits | MiB on disk | "
            + ("dead tuples | " if pg else "free MiB | ")
            + "pruned | purged | ledger RSS MiB | Envoy RSS MiB | CPU ms/call "
            + ("Envoy/ledger/PostgreSQL |" if pg else "Envoy/ledger |"),
            "|" + "---:|" * 15]
    for w, s in zip(res["windows"], res["samples"][1:]):
        cpu = w["cpu_ms_per_call"]
        procs = ("envoy", "ledger", "postgres") if pg else ("envoy", "ledger")
        extra = s["attempts_table"]["dead"] if pg else f"{s['free_bytes'] / 2**20:.1f}"
        out.append(f"| {s['t_s']:.0f} | {w['p50_ms']:.2f} | {w['p99_ms']:.2f} | {w['completed']} | "
                   f"{w['errors'] + w['non2xx'] + w['denied']} | {s['attempts']:,} | {s['receipts_held']:,} | "
                   f"{s['permits']:,} | {s['bytes'] / 2**20:.1f} | {extra} | {s['pruned']:,.0f} | "
                   f"{s['purged_attempts']:,.0f} | {s['rss_kib']['ledger'] / 1024:.1f} | "
                   f"{s['rss_kib']['envoy'] / 1024:.1f} | {' / '.join(f'{cpu.get(p, 0):.3f}' for p in procs)} |")
    out += ["", "## Tables at the end, bytes (indexes and TOAST included)", "", "| table | MiB |", "|---|---:|"]
    for name, size in sorted(res.get("tables_at_end", {}).items(), key=lambda kv: -(kv[1] or 0)):
        if isinstance(size, int):
            out.append(f"| {name} | {size / 2**20:.2f} |")
    (bench.OUT / "results.md").write_text("\n".join(out) + "\n")


# ---------------------------------------------------------------- the run

def window(i: int, envoy: bench.Envoy, bodies: Path, permits: Path, procs: bench.Procs) -> dict:
    # The gateway's counters: dispatched, denied, and denied per code (atmost_denied_<code>).
    counters = ("wasmcustom.atmost_dispatched", "wasmcustom.atmost_denied")
    before_stats, before_cpu = envoy.stats(*counters), procs.cpu()
    r = bench.fixed_rate(envoy.url, bodies, RATE, f"{NAME}-{bench.STAMP}-w{i}", permits)
    after_cpu, after_stats = procs.cpu(), envoy.stats(*counters)
    denied_codes = {k.removeprefix("wasmcustom.atmost_denied_"): v - before_stats.get(k, 0)
                    for k, v in after_stats.items()
                    if k.startswith("wasmcustom.atmost_denied_") and v > before_stats.get(k, 0)}
    if "error" in r:
        raise RuntimeError(f"window {i}: the load generator failed: {r['error']}")
    done = max(r["completed"], 1)
    cpu = {p: round((after_cpu[p] - before_cpu[p]) / done * 1000, 4) for p in after_cpu}
    cpu["loadgen"] = round(r.pop("loadgen_cpu_s") / done * 1000, 4)
    delta = {k.rsplit("_", 1)[-1]: after_stats.get(k, 0) - before_stats.get(k, 0) for k in counters}
    return {"p50_ms": r["p50_us"] / 1000, "p99_ms": r["p99_us"] / 1000, "p999_ms": r["p999_us"] / 1000,
            "max_ms": r["max_us"] / 1000, "completed": r["completed"], "errors": r["errors"],
            "non2xx": r["non2xx"], "overloaded": r["overloaded"], "achieved_rps": r["achieved_rps"],
            "dispatched": delta["dispatched"], "denied": delta["denied"], "denied_codes": denied_codes,
            "cpu_ms_per_call": cpu}


def conclude(res: dict) -> None:
    """From a run's samples: the checks, the pictures, the report and results.json in
    bench.OUT, and the verdicts printed."""
    res["kept_per_call"] = kept_per_call(res)
    verdicts = checks(res)
    res["checks"] = [{"check": label, "pass": ok, "measured": detail} for label, ok, detail in verdicts]
    pictures = plots(res)
    write_report(res, verdicts, pictures)
    (bench.OUT / "results.json").write_text(json.dumps(res, indent=1, default=str))
    for label, ok, detail in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {label}  ({detail})")
    kept = res["kept_per_call"]
    if kept:
        print(f"kept for good per call once the pruner and the purge run: {kept['rows_per_call']:+.4f} rows, "
              f"{kept['bytes_per_call']:+,.0f} bytes ({kept['gib_per_day_at_rate']:+,.2f} GiB a day at "
              f"{res['rate']:g} calls/s)")
    print(f"\nwrote {bench.OUT / 'results.md'}, results.json and {', '.join(pictures)} ({res['wall_seconds']} s)")


def report_again(path: Path) -> int:
    """The checks, the pictures and the report written again from a run's results.json (into
    its directory), as this file's rules read them now."""
    res = json.loads(path.read_text())
    bench.OUT = path.parent
    conclude(res)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["report"]:
        return report_again(Path(sys.argv[2]) if len(sys.argv) > 2 else bench.OUT / "results.json")
    began = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for path in (bench.STUB, bench.LOAD, bench.ATMOST_WASM, bench.LEDGER_BIN):
        if not path.exists():
            log(f"missing {path}: run `make bench-steady`")
            return 2
    if STORE not in ("postgres", "sqlite"):
        log(f"BENCH_STEADY_STORE={STORE!r}: postgres or sqlite")
        return 2
    count = int(SECONDS // WINDOW)
    if count < 4:
        log("BENCH_STEADY_SECONDS: at least four windows of BENCH_STEADY_WINDOW")
        return 2
    bench.RUN.mkdir(parents=True, exist_ok=True)
    # The ledgers log at the shipped default (info: a line per decision and per report).
    os.environ.pop("RUST_LOG", None)
    # The ledger reads its sweep interval and purge delay from here too.
    os.environ["ATMOST_SWEEP_INTERVAL"] = SWEEP
    os.environ["ATMOST_PURGE_ENDED_PERMITS_AFTER"] = PURGE_AFTER
    bench.RATE_SECONDS = WINDOW
    res: dict = {"machine": bench.machine(), "store": STORE, "rate": RATE, "seconds": count * WINDOW,
                 "window_s": WINDOW, "retention": RETENTION, "retention_s": duration_s(RETENTION),
                 "sweep": SWEEP, "permits": PERMITS, "permit_life": PERMIT_LIFE,
                 "permit_life_s": duration_s(PERMIT_LIFE), "purge_after": PURGE_AFTER,
                 "purge_after_s": duration_s(PURGE_AFTER), "windows": [], "samples": []}
    running: list = []
    pg = None
    try:
        pg_url = None
        if STORE == "postgres":
            pg, pg_url = bench.start_postgres(res)
            if not pg_url:
                log("no PostgreSQL: set BENCH_PG_BINDIR or DATABASE_URL, or BENCH_STEADY_STORE=sqlite")
                return 2
        stub, mcp_port, _ = bench.start_stub(running)
        ledger = bench.start_ledger(NAME, pg_url)
        running.append(ledger)
        if res["permit_life_s"] <= WINDOW + ROTATION_SLACK_S + 1:
            log(f"BENCH_STEADY_PERMIT_LIFE: longer than a window plus {ROTATION_SLACK_S:g} s")
            return 2
        pool = PermitPool(ledger, PERMITS, res["permit_life_s"], WINDOW)
        envoy = bench.Envoy(NAME, bench.ATMOST_WASM, mcp_port, [ledger.port],
                            {"ledger": {"service_token": bench.SERVICE_TOKEN}})
        envoy.start()
        running.append(envoy)
        procs = bench.Procs()
        procs.add("envoy", [envoy.proc.pid])
        procs.add("ledger", [ledger.proc.pid])
        procs.add("stub", [stub.proc.pid])
        if pg_url:
            bench.watch_postgres(procs, pg, pg_url)
        store = (PgStore(pg_url, bench.pg_schema(NAME)) if pg_url
                 else SqliteStore(bench.RUN / f"data-{NAME}" / "atmost.sqlite3"))
        bodies = bench.body_file(NAME, [bench.CALL_FRESH])
        start = time.monotonic()
        res["samples"].append(sample(0.0, store, ledger, envoy))
        for i in range(count):
            began_window = time.monotonic() - start
            pool.rotate()
            w = window(i, envoy, bodies, pool.path, procs)
            w.update(start_s=round(began_window, 1), seconds=WINDOW)
            res["windows"].append(w)
            s = sample(time.monotonic() - start, store, ledger, envoy)
            res["samples"].append(s)
            log(f"window {i + 1}/{count}: p50 {w['p50_ms']:.2f} ms, p99 {w['p99_ms']:.2f} ms, "
                f"{w['completed']} calls, bad {w['errors'] + w['non2xx'] + w['denied']}; rows {s['attempts']:,}, "
                f"receipts held {s['receipts_held']:,}, permits {s['permits']}, purged {s['purged_attempts']:,.0f}, "
                f"{s['bytes'] / 2**20:.1f} MiB; RSS ledger "
                f"{s['rss_kib']['ledger'] / 1024:.1f} MiB, Envoy {s['rss_kib']['envoy'] / 1024:.1f} MiB")
        res["tables_at_end"] = store.tables()
        res["permits_created"] = pool.created
    finally:
        bench.stop_all(running, pg, pg_url, [NAME])
    res["wall_seconds"] = round(time.monotonic() - began)
    conclude(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
