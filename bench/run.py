#!/usr/bin/env python3
"""`make bench`: how much latency and CPU atmost adds per call, next to plain Envoy; the
ledger's throughput; the targets.

One file on purpose: the setups, the runs and the report share one table of setups and one
results record, and a reader checks the method against the numbers in one place.

Every setup runs on this machine, in this run, against the same stub upstream
(bench/stub, one thread), with Envoy pinned to one worker (`--concurrency 1`):

  B   plain Envoy (the shipped sidecar config without the wasm filter)
  N   Envoy + a no-op Rust proxy-wasm filter (bench/filters/noop)
  S   Envoy + a filter making one HTTP/2 callout per request to a static stub (bench/filters/callout)
  S2  the same filter making a second callout before releasing the response's last chunk: the
      floor of "authorize, then report completion in-band" (two callouts per call)
  C   atmost, non-tool MCP traffic (initialize, tools/list in turn)
  D0  atmost, tools/call with fresh keys, its ledger cluster pointed at the static stub (which
      answers `dispatch` and acks every completion): the gateway's own cost, no store
  D0a D0 with `answer_release: at_once`: the zero of Da and Ea
  D   atmost + ledger on the embedded store (SQLite), tools/call with fresh keys
  Dr  D with one repeated key (replays)
  Df  D while a flood from the same address hits its ledger: wrong service tokens (answered
      429 past the ledger's failure limit) and /readyz (answered from a background check),
      each on FLOOD_CONNECTIONS keep-alive connections as fast as they are answered
      (`bench/run.py flood URL`); the flood's own CPU is not counted
  E   D with the ledger on PostgreSQL
  E2  E with two ledger replicas on the same PostgreSQL schema, both endpoints of Envoy's
      ledger cluster
  E1k E with BENCH_PERMITS permits in use at once (1,000): request n goes under permit n mod
      1,000, as 1,000 agents each with its own permit
  D1k D with BENCH_PERMITS permits in use at once, as E1k
  Da, Ea  D and E with `answer_release: at_once`: a completed answer goes to the client when
      whole, its report to the ledger after it (their zero: D0a)
  Vp  D with a second, plain Envoy at the tool, between the gateway and the stub: the hop alone
  V   D with the verifier at the tool: the second Envoy runs the same module in
      `role: "verify"` (its keys inline, read from the bench ledger's `GET /v1/keys`), so
      every dispatch is signed by the ledger, sent with its headers and checked before the
      stub; V - Vp is the verifier's check, V - D the hop and the check together

PostgreSQL: the bench starts its own cluster (initdb under target/bench, its own loopback
port, `shared_preload_libraries=pg_stat_statements`, fsync and synchronous_commit at their
defaults), so every postgres process's CPU is the bench's; it is stopped at the end, also on
error. pg_stat_statements is reset before each setup on PostgreSQL and its top statements
recorded after it. Without the binaries (BENCH_PG_BINDIR) the server of DATABASE_URL is used
instead, and the report says so (its CPU is then shared with whatever else uses it).

Per setup: the ceiling (wrk, closed loop, 1 thread, 32 connections), then open-loop fixed
rates at 1 % and 5 % of B's ceiling (bench/loadgen, latency from each request's due time),
each process's CPU per request at each rate (Envoy, stub, ledger, PostgreSQL, the load
generator) and over the ceiling run, peak RSS (VmHWM). Then the ledger alone (authorize +
completed report pairs over h2c; one permit, and BENCH_PERMITS permits), criterion
micro-benchmarks, the filter's instructions per call (callgrind), the module size.

Signed dispatches: what a signature adds to the upstream request (the header lines of the
first request a ledger of the run signed, as the stub received it), and to an authorize exchange
(one with and one without a dispatch target, sent to a bench ledger of the run); criterion
benches of the ledger's signing and the verifier's check; callgrind of one verified call.

The report (target/bench/results.{md,json}) puts first the latency each setup adds over B at
each rate (p50 and p99 minus B's of the same run), next to the floors of the same run: one
callout (S - B) and the disk's fdatasync p50; then the CPU per call per process at 1 % of B;
then the targets (PASS/FAIL with the figure and the limit); then the ceilings and their
ratios as plain figures (on two shared cores they measure the squeeze, not the product).

Environment (knobs):
  BENCH_SETUPS        setups to run, e.g. "B,S,D,E,E2,E1k" (default all)
  BENCH_SECONDS       one ceiling run, seconds (default 6)
  BENCH_REPEATS       rounds: each measures every setup's ceiling once, in turn; the best
                      round of each setup is kept, the fixed rates run in the last (default 3)
  BENCH_CONNECTIONS   wrk connections of the ceiling runs (default 32)
  BENCH_RATES         fixed rates as percentages of B's ceiling (default "1,5"; empty: none);
                      the targets are read at 1 % and 5 %
  BENCH_RATE_SECONDS  each fixed rate, seconds (default 10)
  BENCH_PERMITS       permits of D1k, E1k and of the ledger-alone many-permit runs (default 1000)
  BENCH_LEDGER_ALONE  0 skips the ledger-alone runs
  BENCH_LEDGER_SECONDS  each ledger-alone run, seconds (default 8)
  BENCH_LEDGER_CONCURRENCY  pairs in flight in the ledger-alone runs (default 64)
  BENCH_CRITERION     0 skips criterion; or the benches to run, e.g. "filter,signing"
                      (default all: filter, store, signing)
  BENCH_CALLCOST      0 skips counting the filter's instructions per call (valgrind)
  BENCH_OUT           output directory
  BENCH_LEDGER_BIN    another `atmost` build, to compare a change
  ATMOST_WASM         another build of the filter module, to compare a change (as for the
                      test suites: every setup that runs atmost's filter loads it)
  BENCH_PLUGIN        JSON merged into atmost's plugin configuration,
                      e.g. '{"completion_reports": "per_call"}'
                      (setups Da and Ea add answer_release at_once to it)
  BENCH_RIDE_MS       report_ride_ms for Da and Ea (default 0: their reports do not ride;
                      D0a, their zero, never rides), to compare reports riding on the
                      next authorize with a callout of their own
  BENCH_LEDGER_HTTP   the protocol of Envoy's ledger cluster: 2 (default, h2c, as shipped) or 1
                      (HTTP/1.1, a connection per callout in flight), to compare the two
  BENCH_PG_BINDIR     PostgreSQL's binaries for the bench's own cluster
                      (default /usr/lib/postgresql/15/bin)
  BENCH_PG_SETTINGS   more server settings of the bench's own cluster, space-separated,
                      e.g. "synchronous_commit=off" (an experiment: docs/performance.md)
  DATABASE_URL        the PostgreSQL server used only when the binaries are missing (E, E2,
                      E1k and the ledger alone on PostgreSQL are skipped if neither is there)

A quick run: BENCH_SETUPS=B,S,D,E,E2,E1k BENCH_REPEATS=1 BENCH_SECONDS=2 BENCH_RATE_SECONDS=3
BENCH_LEDGER_SECONDS=2 BENCH_CRITERION=0 BENCH_CALLCOST=0. What signing costs:
BENCH_SETUPS=B,D,Vp,V BENCH_LEDGER_ALONE=0 (criterion and callcost as wanted). What releasing
the answer before its report gives: BENCH_SETUPS=B,S,D,Da,E,Ea BENCH_LEDGER_ALONE=0.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import atmost_stack as stack  # noqa: E402  (`make run`'s process wrappers and sidecar_config)
import yaml  # noqa: E402

OUT = Path(os.environ.get("BENCH_OUT", ROOT / "target" / "bench"))
RUN = OUT / "run"
TOOLS = ROOT / "target" / "bench" / "release"
STUB = TOOLS / "atmost-bench-stub"
LOAD = TOOLS / "atmost-bench-load"
CALLCOST = ROOT / "target" / "bench" / "callcost" / "atmost-bench-callcost"
WASM_DIR = ROOT / "target" / "bench" / "wasm32-wasip1" / "wasm"
NOOP_WASM = WASM_DIR / "bench_filter_noop.wasm"
CALLOUT_WASM = WASM_DIR / "bench_filter_callout.wasm"
ATMOST_WASM = stack.WASM
LEDGER_BIN = Path(os.environ.get("BENCH_LEDGER_BIN", ROOT / "target" / "release" / "atmost"))
ENVOY = Path(sys.executable).parent / "envoy"
LUA = ROOT / "bench" / "lua" / "post.lua"
OHA = shutil.which("oha") or str(ROOT / "target" / "bench-tools" / "bin" / "oha")

SECONDS = float(os.environ.get("BENCH_SECONDS", "6"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
RATE_SECONDS = float(os.environ.get("BENCH_RATE_SECONDS", "10"))
LEDGER_SECONDS = float(os.environ.get("BENCH_LEDGER_SECONDS", "8"))
LEDGER_CONCURRENCY = int(os.environ.get("BENCH_LEDGER_CONCURRENCY", "64"))
WRK_CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "32"))
RATE_CONNECTIONS = 64
# Percentages of B's ceiling; a rate's label is its percentage as written ("1%", "5%").
RATES = tuple(float(x) for x in os.environ.get("BENCH_RATES", "1,5").split(",") if x.strip())
PERMITS = int(os.environ.get("BENCH_PERMITS", "1000"))
PG_BINDIR = Path(os.environ.get("BENCH_PG_BINDIR", "/usr/lib/postgresql/15/bin"))
LEDGER_ALONE = os.environ.get("BENCH_LEDGER_ALONE", "1") != "0"
LEDGER_HTTP = os.environ.get("BENCH_LEDGER_HTTP", "2")
if LEDGER_HTTP not in ("1", "2"):
    raise SystemExit(f"BENCH_LEDGER_HTTP must be 1 or 2, not {LEDGER_HTTP!r}")
CLK_TCK = os.sysconf("SC_CLK_TCK")
SERVICE_TOKEN = "bench-service-token-of-32-bytes-or-more"
ADMIN_TOKEN = "bench-admin-token-of-32-bytes-or-more"
STAMP = str(int(time.time()))

INIT = '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"bench","version":"0"}}}'
LIST = '{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{}}'
CALL_FRESH = '{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"{SEQ}"},"_meta":{"dev.atmost/idempotency-key":"{SEQ}"}}}'
CALL_REPLAY = '{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"same"},"_meta":{"dev.atmost/idempotency-key":"replay-' + STAMP + '"}}}'

SETUPS = ("B", "N", "S", "S2", "C", "D0", "D0a", "D", "Da", "D1k", "Dr", "Df", "E", "Ea", "E2", "E1k", "Vp", "V")
ON_POSTGRES = ("E", "Ea", "E2", "E1k")
# Setups whose calls go under PERMITS permits in turn, as that many agents.
MANY_PERMITS = ("D1k", "E1k")
# Setups whose gateway releases a completed answer before the ledger has its report
# (`answer_release: at_once`): D and E otherwise.
ANSWER_AT_ONCE = ("D0a", "Da", "Ea")
# Setups whose ledger cluster is the static stub (no store): the gateway's own cost.
STUB_LEDGER = ("D0", "D0a")
BODIES = {"B": [CALL_FRESH], "N": [CALL_FRESH], "S": [CALL_FRESH], "S2": [CALL_FRESH], "C": [INIT, LIST],
          "D0": [CALL_FRESH], "D0a": [CALL_FRESH], "D": [CALL_FRESH], "Da": [CALL_FRESH], "D1k": [CALL_FRESH], "Dr": [CALL_REPLAY], "Df": [CALL_FRESH], "E": [CALL_FRESH],
          "Ea": [CALL_FRESH], "E2": [CALL_FRESH],
          "E1k": [CALL_FRESH], "Vp": [CALL_FRESH], "V": [CALL_FRESH]}
DESCRIPTION = {
    "B": "plain Envoy",
    "N": "Envoy + no-op wasm filter",
    "S": "Envoy + wasm filter, one HTTP/2 callout per request (static stub)",
    "S2": "Envoy + wasm filter, two callouts per request (before the request, before the last response chunk)",
    "C": "atmost, non-tool MCP traffic (initialize, tools/list)",
    "D0": "atmost, tools/call, fresh keys, ledger replaced by the static stub (no store)",
    "D0a": "D0 with answer_release at_once: the zero of Da and Ea",
    "D": "atmost, tools/call, fresh keys, ledger on SQLite",
    "Da": "D with answer_release at_once: the answer goes on before the ledger has its report",
    "D1k": f"D with {PERMITS} permits in use at once, each request under one of them in turn",
    "Dr": "atmost, tools/call, one repeated key (replays), SQLite",
    "Df": "D while wrong service tokens and /readyz flood its ledger from the same address",
    "E": "atmost, tools/call, fresh keys, ledger on PostgreSQL",
    "Ea": "E with answer_release at_once",
    "E2": "E with two ledger replicas on the same PostgreSQL, both in Envoy's ledger cluster",
    "E1k": f"E with {PERMITS} permits in use at once, each request under one of them in turn",
    "Vp": "D with a second, plain Envoy at the tool (the hop alone)",
    "V": "D with the verifier at the tool: a second Envoy running the module in role verify",
}
# Setups whose ledger is flooded while they run, and the connections of each flood kind.
FLOODED = ("Df",)
FLOOD_CONNECTIONS = 2
# Setups with a second Envoy at the tool, between the gateway and the stub: True when it runs
# the verifier, False when it is plain.
AT_THE_TOOL = {"Vp": False, "V": True}
# The tool the bench calls, which the verifier governs.
TOOL = "echo"
# Setups whose ledger signs each dispatch (D0's stub stands in for the signatures).
SIGNED_BY_LEDGER = ("D", "Da", "D1k", "Dr", "E", "Ea", "E2", "E1k", *AT_THE_TOOL)


def rate_label(percent: float) -> str:
    return f"{percent:g}%"


def log(msg: str) -> None:
    print(f"bench: {msg}", flush=True)


# ---------------------------------------------------------------- processes and /proc

def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def reaped_children_cpu_seconds(pid: int) -> float:
    """CPU time of the children a process has waited for (cutime + cstime): a PostgreSQL
    backend that exited during a run still counts, through its postmaster."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[13]) + int(fields[14])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of every thread the process has now: how
    often it slept and was woken, a count that, unlike CPU time, hardly depends on what a
    wake-up costs on the machine at hand."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                    total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total


def status_kib(pid: int, field: str) -> int:
    """A memory figure of /proc/PID/status, KiB: VmHWM (the peak resident set), VmRSS (now)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def hwm_kib(pid: int) -> int:
    return status_kib(pid, "VmHWM")


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d.name))
    return out


def postgres_pids(url: str) -> list[int]:
    """The postmaster listening on the URL's port and its children (backends)."""
    m = re.search(r"@[^:/]+:(\d+)", url) or re.search(r"port=(\d+)", url)
    port = m.group(1) if m else "5432"
    try:
        ss = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    m = re.search(r"pid=(\d+)", ss)
    if not m:
        return []
    main = int(m.group(1))
    return [main, *children_of(main)]


class OwnPostgres:
    """The bench's own PostgreSQL cluster, so that every postgres process's CPU is the bench's:
    initdb in a fresh directory under the output directory, its own loopback port,
    pg_stat_statements loaded; fsync and synchronous_commit stay at their defaults (on), as a
    production server has them. As root it runs as the `postgres` user (PostgreSQL refuses root).
    `PRELOAD`: bench/scale.py adds auto_explain (off until it turns it on). `SETTINGS`: more
    server settings (`name=value`), e.g. a `shared_buffers` that holds a large store's indexes;
    BENCH_PG_SETTINGS gives them to `make bench`, and the report prints synchronous_commit as run."""

    PRELOAD = "pg_stat_statements"
    SETTINGS: list[str] = os.environ.get("BENCH_PG_SETTINGS", "").split()

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="pg-", dir=OUT))
        self.data = self.dir / "data"
        self.port = stack.free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/bench"
        self.as_pg: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
            self.as_pg = ["runuser", "-u", "postgres", "--"]

    def _run(self, tool: str, *args: str) -> None:
        r = subprocess.run([*self.as_pg, str(self.bindir / tool), *args], capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{tool} failed: {(r.stdout + r.stderr)[-2000:]}")

    def start(self) -> None:
        # --no-sync only spares initdb's own final flush; the server's settings are untouched.
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} -c max_connections=200 "
                   f"-c shared_preload_libraries={self.PRELOAD}" + "".join(f" -c {s}" for s in self.SETTINGS))
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-t", "60",
                  "-o", options, "start")
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "bench")
        psql(self.url, "CREATE EXTENSION pg_stat_statements")

    def postmaster(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            return None

    def pids(self) -> list[int]:
        main = self.postmaster()
        return [main, *children_of(main)] if main else []

    def reaped_cpu(self) -> float:
        main = self.postmaster()
        return reaped_children_cpu_seconds(main) if main else 0.0

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                log(f"stopping PostgreSQL: {e}")
        shutil.rmtree(self.dir, ignore_errors=True)


def psql(url: str, sql: str) -> str:
    r = subprocess.run(["psql", url, "-XAtqc", sql], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"psql: {r.stderr.strip()[-500:]}")
    return r.stdout.strip()


def reset_statements(url: str) -> None:
    try:
        psql(url, "SELECT pg_stat_statements_reset()")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        log(f"pg_stat_statements_reset: {e}")


def statements_run(url: str) -> int | None:
    """Statements the server ran since the last reset (pg_stat_statements, utility statements
    such as BEGIN, SET and COMMIT included), less the bench's own reads of it; None when the
    extension is missing."""
    try:
        return int(psql(url, "SELECT COALESCE(sum(calls), 0) FROM pg_stat_statements "
                             "WHERE query NOT ILIKE '%pg_stat_statements%'"))
    except (RuntimeError, ValueError, subprocess.SubprocessError):
        return None


def top_statements(url: str, limit: int = 8) -> list[dict] | dict:
    """Where PostgreSQL's time went since the last reset: the statements by total execution
    time (the bench's own queries to pg_stat_statements left out)."""
    sql = ("SELECT coalesce(json_agg(t), '[]') FROM (SELECT calls, round(total_exec_time::numeric, 2) AS total_ms, "
           "round(mean_exec_time::numeric, 4) AS mean_ms, rows, "
           "left(regexp_replace(query, '\\s+', ' ', 'g'), 200) AS query FROM pg_stat_statements "
           "WHERE query NOT ILIKE '%pg_stat_statements%' ORDER BY total_exec_time DESC LIMIT " + str(limit) + ") t")
    try:
        return json.loads(psql(url, sql))
    except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError) as e:
        return {"error": str(e)}


class Procs:
    """Named groups of pids whose CPU time and peak RSS are reported."""

    def __init__(self):
        self.groups: dict[str, callable] = {}
        self.reaped: dict[str, callable] = {}

    def add(self, name: str, pids, reaped=None) -> None:
        """`pids`: a list or a function giving one; `reaped`: a function giving the CPU-seconds
        of the group's processes that have already exited (counted too)."""
        self.groups[name] = pids if callable(pids) else (lambda p=pids: p)
        if reaped:
            self.reaped[name] = reaped

    def cpu(self) -> dict[str, float]:
        return {n: sum(cpu_seconds(p) for p in f()) + (self.reaped[n]() if n in self.reaped else 0.0)
                for n, f in self.groups.items()}

    def switches(self) -> dict[str, int]:
        """Context switches of each group's live processes (one that exited takes its count along)."""
        return {n: sum(context_switches(p) for p in f()) for n, f in self.groups.items()}

    def hwm_mib(self) -> dict[str, float]:
        return {n: round(sum(hwm_kib(p) for p in f()) / 1024, 1) for n, f in self.groups.items()}


class Envoy(stack.Process):
    def __init__(self, name: str, wasm: Path | None, upstream_port: int, ledger_ports: list[int],
                 plugin_overrides: dict | None = None, plugin: dict | None = None, port: int | None = None):
        """`plugin`: the module's whole configuration instead of the shipped one with
        `plugin_overrides` (the verifier's); its `atmost_ledger` cluster then has no health
        checks, since nothing but a key fetch would use it. `port`: the listener's, when the
        caller picked it."""
        self.port = port or stack.free_port()
        self.admin_port = stack.free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.ledger_ports = ledger_ports
        # The callouts in cleartext (h2c), as every published run measured them; the shipped
        # file's TLS to the ledger is not in these numbers yet.
        config = stack.sidecar_config(self.port, self.admin_port, upstream_port, ledger_ports, plugin_overrides,
                                      wasm=wasm or ATMOST_WASM, plain=wasm is None, ledger_tls=False)
        if LEDGER_HTTP == "1":
            for cluster in config["static_resources"]["clusters"]:
                if cluster["name"] == "atmost_ledger":
                    options = cluster["typed_extension_protocol_options"][
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
                    options["explicit_http_config"] = {"http_protocol_options": {}}
                    for check in cluster.get("health_checks", []):
                        check["http_health_check"]["codec_client_type"] = "HTTP1"
        if plugin is not None:
            wasm_filter = next(f for f in stack.listener_hcm(config)["http_filters"]
                               if f["name"] == "envoy.filters.http.wasm")
            wasm_filter["typed_config"]["config"]["configuration"]["value"] = json.dumps(plugin)
            wasm_filter["typed_config"]["config"]["vm_config"].pop("environment_variables", None)
            for cluster in config["static_resources"]["clusters"]:
                if cluster["name"] == "atmost_ledger":
                    cluster.pop("health_checks", None)
                    cluster.pop("common_lb_config", None)
        path = RUN / f"envoy-{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        # One worker, so runs compare; warning level: a production log level, and the same
        # for every setup.
        super().__init__(f"envoy-{name}", [str(ENVOY), "-c", str(path), "--concurrency", "1",
                                           "--use-dynamic-base-id", "-l", "warning"], RUN)

    def start(self) -> None:
        super().start()
        self.wait_started(lambda: stack.http_get(self.admin + "/ready")[0] == 200, 30, f"envoy {self.name}")
        # A ledger endpoint counts as unhealthy until its first health check passes (and the
        # cluster has no panic threshold): load sent before that is denied at once, which
        # would count fast denials as calls.
        stack.wait_until(self.ledgers_healthy, 30, f"every ledger endpoint healthy in envoy {self.name}")

    def ledgers_healthy(self) -> bool:
        clusters = stack.http_get(self.admin + "/clusters")[1].decode()
        if "atmost_ledger::" not in clusters:
            return True
        return all(f"atmost_ledger::127.0.0.1:{p}::health_flags::healthy" in clusters for p in self.ledger_ports)

    def stats(self, *prefixes: str) -> dict[str, int]:
        text = stack.http_get(self.admin + "/stats?usedonly")[1].decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefixes) and value.strip().isdigit():
                out[name] = int(value)
        return out

    def memory(self) -> dict:
        try:
            return json.loads(stack.http_get(self.admin + "/memory")[1])
        except ValueError:
            return {}


SCHEMAS_USED: set[str] = set()


def ledger_counters(ledger: stack.Ledger) -> dict[str, float]:
    """What a flood shows in the ledger's metrics: refusals answered 429 and background store
    checks (`/readyz` never reads the store itself)."""
    text = ledger.metrics()
    return {"answered_429": metric_total(text, "atmost_auth_failures_limited_total"),
            "store_checks": metric_total(text, "atmost_readiness_checks_total")}


def metric_total(text: str, name: str) -> float:
    """A metric of Prometheus text summed over its labels."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def flood(base: str) -> int:
    """`bench/run.py flood URL`: setup Df's flood of the ledger at URL (plain HTTP), until
    SIGTERM: FLOOD_CONNECTIONS connections sending wrong service tokens to /v1/authorize and
    as many asking /readyz, each as fast as it is answered; prints the answers it got."""
    import http.client
    import threading
    import urllib.parse

    where = urllib.parse.urlsplit(base)
    stop = threading.Event()
    answers: dict[str, int] = {}

    def hammer(method: str, path: str, headers: dict, body: bytes | None) -> None:
        conn = None
        while not stop.is_set():
            try:
                conn = conn or http.client.HTTPConnection(where.hostname, where.port, timeout=10)
                conn.request(method, path, body=body, headers=headers)
                r = conn.getresponse()
                r.read()
                key = f"{path} {r.status}"
                answers[key] = answers.get(key, 0) + 1
            except (OSError, http.client.HTTPException):
                # A refusal may close the connection before the body is read: open another.
                conn = None

    wrong = {"authorization": "Bearer not-the-service-token", "content-type": "application/json"}
    threads = [threading.Thread(target=hammer, args=args, daemon=True)
               for args in [("POST", "/v1/authorize", wrong, b"{}"), ("GET", "/readyz", {}, None)]
               for _ in range(FLOOD_CONNECTIONS)]
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for t in threads:
        t.start()
    while not stop.wait(0.5):
        pass
    print(json.dumps(answers, sort_keys=True), flush=True)
    return 0


def start_ledger(name: str, store: str | None, schema: str | None = None, keep: bool = False) -> stack.Ledger:
    """A ledger on SQLite (`store` None) or on the PostgreSQL of `store`, in the schema of
    `schema` (default: its own name), fresh like the fresh SQLite file (dropped at the end);
    `keep`: on the SQLite file a ledger of the same name left (bench/scale.py fills it)."""
    data = RUN / f"data-{name}"
    if not keep:
        shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True, exist_ok=True)
    if store:
        SCHEMAS_USED.add(schema or name)
    extra = ["--store", store, "--pg-schema", pg_schema(schema or name)] if store else []
    os.environ["ATMOST_BIN"] = str(LEDGER_BIN)
    ledger = stack.Ledger(RUN, data, service_token=SERVICE_TOKEN, admin_token=ADMIN_TOKEN,
                          extra_args=extra, name=f"ledger-{name}", tls=False)
    ledger.start()
    return ledger


def pg_schema(name: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", f"atmost_bench_{STAMP}_{name}".lower())


def create_permits(ledger: stack.Ledger, count: int, label: str, **policy: str) -> list[str]:
    """`count` permits for every tool, through the admin API (one CLI process per permit
    would take minutes for 1,000); returns their tokens. `policy`: members of the permit
    request that replace or add to these (bench/steady.py's `retention`, `expires`)."""
    tokens = []
    for i in range(count):
        req = urllib.request.Request(
            ledger.admin_url + "/admin/v1/permits", method="POST",
            data=json.dumps({"label": f"{label}-{i}", "expires": "2h", "tools": ["*"], **policy}).encode(),
            headers={"content-type": "application/json", "authorization": f"Bearer {ADMIN_TOKEN}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            tokens.append(json.loads(r.read())["token"])
    return tokens


def permit_file(name: str, tokens: list[str]) -> Path:
    path = RUN / f"permits-{name}.txt"
    path.write_text("\n".join(tokens) + "\n")
    return path


def drop_pg_schemas(url: str, names) -> None:
    if not shutil.which("psql"):
        return
    for n in names:
        subprocess.run(["psql", url, "-qc", f"DROP SCHEMA IF EXISTS {pg_schema(n)} CASCADE"],
                       capture_output=True, timeout=60)


# ---------------------------------------------------------------- signed dispatches

def verifier_plugin(ledger: stack.Ledger, authority: str) -> dict:
    """The verifier's configuration: the bench's tool governed, the ledger's public keys
    inline as its `GET /v1/keys` lists them, serving `authority` (the gateway's, which its
    dispatches are signed for)."""
    status, body = stack.http_get(ledger.url + "/v1/keys", timeout=10)
    if status != 200:
        raise RuntimeError(f"GET /v1/keys answered {status}")
    return {"role": "verify", "verify": {"keys": {"keys": json.loads(body)["keys"]}, "authorities": [authority]},
            "governed_tools": [TOOL]}


def authorize_bytes(ledger: stack.Ledger, permit: str, authority: str) -> dict:
    """What signing adds to an authorize exchange, from two real ones with `ledger`: the same
    request as the gateway sends it for the bench's call (fresh key, the default upstream_key
    form of a 64-hex forwarded key), once without and once with the `dispatch` target the
    gateway names when it asks for a signature. Both dispatch; the request grows by its
    `dispatch` member, the Dispatch answer by its `signature` member. The bodies are JSON
    alike over HTTP/1.1 here and over h2c from Envoy."""
    out: dict = {}
    for signed in (False, True):
        key = f"bytes-{STAMP}-{'signed' if signed else 'unsigned'}"
        call = CALL_FRESH.replace("{SEQ}", key)
        forwarded = hashlib.sha256(f"fwd:{key}".encode()).hexdigest()
        req = {"permit_token": permit, "tool": TOOL, "idempotency_key": key,
               "fingerprint": hashlib.sha256(call.encode()).hexdigest(), "arguments": {"text": key},
               "key_required": False, "forwarded_key": forwarded}
        if signed:
            req["dispatch"] = {"method": "POST", "authority": authority, "path": "/mcp",
                               "body_sha256": hashlib.sha256(call.encode()).hexdigest(),
                               "idempotency_key": forwarded, "validity_s": 15}
        data = json.dumps(req, separators=(",", ":")).encode()
        request = urllib.request.Request(ledger.url + "/v1/authorize", data=data, method="POST", headers={
            "content-type": "application/json", "authorization": f"Bearer {SERVICE_TOKEN}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                answer = r.read()
        except OSError as e:
            return {"error": f"authorize: {e}"}
        decision = json.loads(answer)
        if decision.get("decision") != "dispatch" or bool(decision.get("signature")) != signed:
            return {"error": f"authorize answered {answer[:300]!r}"}
        out["signed" if signed else "unsigned"] = {"request_bytes": len(data), "answer_bytes": len(answer)}
        if signed:
            out["signature"] = decision["signature"]
    out["request_grew_bytes"] = out["signed"]["request_bytes"] - out["unsigned"]["request_bytes"]
    out["answer_grew_bytes"] = out["signed"]["answer_bytes"] - out["unsigned"]["answer_bytes"]
    return out


SIGNATURE_HEADERS = ("content-digest", "signature-input", "signature")


def forget_signed(stub_port: int) -> None:
    """Has the stub forget the signed request it kept, so it keeps the next one."""
    request = urllib.request.Request(f"http://127.0.0.1:{stub_port}/_bench/signed", method="DELETE")
    with urllib.request.urlopen(request, timeout=5) as r:
        r.read()


def upstream_bytes(stub_port: int) -> dict:
    """What a signed dispatch adds to the upstream request: the three header lines of the first
    signed request the stub received since `forget_signed`, as it recorded them."""
    status, body = stack.http_get(f"http://127.0.0.1:{stub_port}/_bench/signed", timeout=5)
    if status != 200:
        return {"error": "the stub received no signed request in this run"}
    record = json.loads(body)
    added = [(n, v) for n, v in record["headers"] if n.lower() in SIGNATURE_HEADERS]
    if len(added) != len(SIGNATURE_HEADERS):
        return {"error": f"the signed request carried {[n for n, _ in added]}"}
    return {"headers": {n: v for n, v in added},
            "name_value_bytes": sum(len(n) + len(v) for n, v in added),
            # name ": " value CRLF, as an HTTP/1.1 request carries each line.
            "http1_line_bytes": sum(len(n) + len(v) + 4 for n, v in added),
            "all_header_lines": len(record["headers"]), "version": record.get("version")}


# ---------------------------------------------------------------- load

def body_file(name: str, lines: list[str]) -> Path:
    path = RUN / f"bodies-{name}.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


# A setup's permit: one token, or a file of tokens (one a line) that requests take in turn.
Permit = str | Path | None


def wrk(url: str, bodies: Path, seconds: float, prefix: str, permit: Permit) -> dict:
    env = {**os.environ, "BODY_FILE": str(bodies), "KEY_PREFIX": prefix,
           "PERMIT": permit if isinstance(permit, str) else "",
           "PERMIT_FILE": str(permit) if isinstance(permit, Path) else ""}
    argv = ["wrk", "-t1", f"-c{WRK_CONNECTIONS}", f"-d{seconds:g}s", "--latency", "-s", str(LUA), url]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=seconds + 60).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": float(rps.group(1)) if rps else 0.0, "requests": int(total.group(1)) if total else 0,
            "non2xx": int(bad.group(1)) if bad else 0, "socket_errors": errors.group(1) if errors else "",
            "raw": out}


def fixed_rate(url: str, bodies: Path, rate: float, prefix: str, permit: Permit) -> dict:
    """One open-loop run; `loadgen_cpu_s` is the load generator's own CPU time (it shares the
    two cores with everything measured)."""
    argv = [str(LOAD), "rate", "--url", url, "--rate", f"{max(rate, 1):.0f}", "--duration", f"{RATE_SECONDS:g}",
            "--connections", str(RATE_CONNECTIONS), "--body-file", str(bodies), "--key-prefix", prefix]
    if isinstance(permit, Path):
        argv += ["--permit-file", str(permit)]
    elif permit:
        argv += ["--permit", permit]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=RATE_SECONDS + 60)
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    out = json.loads(r.stdout)
    out["loadgen_cpu_s"] = (done.ru_utime + done.ru_stime) - (children.ru_utime + children.ru_stime)
    return out


def oha_fixed_rate(url: str, body: str, rate: float) -> dict | None:
    """Cross-check of the load generator on a static body with a packaged tool."""
    if not Path(OHA).exists():
        return None
    argv = [OHA, "--no-tui", "--output-format", "json", "-z", f"{RATE_SECONDS:g}s", "-q", f"{rate:.0f}",
            "--latency-correction", "-c", str(RATE_CONNECTIONS), "-m", "POST", "-T", "application/json",
            "-d", body, url]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=RATE_SECONDS + 60)
    try:
        data = json.loads(r.stdout)
    except ValueError:
        return {"error": (r.stderr or r.stdout)[-500:]}
    pct = data.get("latencyPercentiles", {})
    return {"p50_us": round(pct.get("p50", 0) * 1e6), "p99_us": round(pct.get("p99", 0) * 1e6),
            "p999_us": round(pct.get("p99.9", 0) * 1e6), "rps": data.get("summary", {}).get("requestsPerSec")}


# ---------------------------------------------------------------- setups

def run_setup(name: str, envoy: Envoy, procs: Procs, rate_base: float | None, permit: Permit,
              pg_url: str | None = None) -> dict:
    """One round of a setup: its ceiling run, then its fixed-rate runs at RATES of `rate_base`
    (B's ceiling in the first round; this run's own ceiling when there is none). `pg_url`: the
    setup's PostgreSQL, whose statements per call are counted at each rate."""
    bodies = body_file(name, BODIES[name])
    prefix = f"{name}-{STAMP}-{len(os.listdir(RUN))}"
    if name == "Dr":  # the one key completes first; every later call is a replay
        fixed_rate(envoy.url, bodies, 10, prefix + "-prime", permit)
    wrk(envoy.url, bodies, 2, prefix + "-warm", permit)
    before = procs.cpu()
    run = wrk(envoy.url, bodies, SECONDS, f"{prefix}-ceil", permit)
    after = procs.cpu()
    n = max(run["requests"], 1)
    run["cpu"] = {p: round((after[p] - before[p]) / n * 1000, 4) for p in after}
    run.pop("raw", None)
    rates = {}
    base = rate_base or run["rps"]
    for percent in RATES:
        # CPU per request at a fixed rate: the cost of a request when nothing is saturated
        # (at the ceiling, time slices fight for 2 cores and the per-request cost grows).
        if pg_url:
            reset_statements(pg_url)
        before, switched = procs.cpu(), procs.switches()
        r = fixed_rate(envoy.url, bodies, base * percent / 100, f"{prefix}-r{percent:g}", permit)
        after, switched_after = procs.cpu(), procs.switches()
        done = max(r.get("completed", 0), 1)
        if pg_url:
            statements = statements_run(pg_url)
            if statements is not None:
                r["pg_statements_per_call"] = round(statements / done, 2)
        r["cpu_s_per_1000"] = {p: round((after[p] - before[p]) / done * 1000, 4) for p in after}
        r["switches_per_call"] = {p: round((switched_after[p] - switched[p]) / done, 1) for p in switched_after}
        if "loadgen_cpu_s" in r:
            r["cpu_s_per_1000"]["loadgen"] = round(r.pop("loadgen_cpu_s") / done * 1000, 4)
        rates[rate_label(percent)] = r
    result = {
        "setup": name, "description": DESCRIPTION[name], "runs": [run],
        "rates": rates, "peak_rss_mib": procs.hwm_mib(),
        "envoy_memory": envoy.memory(), "envoy_stats": envoy.stats("wasmcustom.", "wasm.", "cluster.atmost_ledger.upstream_rq_",
                                   "cluster.mcp_upstream.upstream_rq_total"),
    }
    log(f"{name}: {run['rps']:.0f} rps" + "".join(
        f", {k}: p50 {v.get('p50_us', 0) / 1000:.2f} ms p99 {v.get('p99_us', 0) / 1000:.2f} ms"
        + (" (overloaded)" if v.get("overloaded") else "") for k, v in rates.items()))
    return result


def merge_round(prev: dict | None, new: dict) -> dict:
    """A setup's rounds so far: every ceiling run kept, the best one is the ceiling (with its
    CPU); each round's fixed-rate runs kept (`rate_rounds`), and `rates` their median, figure
    by figure, which the report and the targets read; Envoy's stats are the last round's."""
    runs = (prev["runs"] if prev else []) + new["runs"]
    rounds = (prev["rate_rounds"] if prev else []) + ([new["rates"]] if new["rates"] else [])
    best = max(runs, key=lambda r: r["rps"])
    merged = {**new, "runs": runs, "ceiling_rps": best["rps"],
              "ceiling": {k: v for k, v in best.items() if k != "cpu"},
              "ceiling_runs_rps": [r["rps"] for r in runs], "cpu_s_per_1000": best["cpu"],
              "rate_rounds": rounds, "rates": median_rates(rounds)}
    if prev:
        merged["peak_rss_mib"] = {k: max(v, prev["peak_rss_mib"].get(k, 0)) for k, v in new["peak_rss_mib"].items()}
    return merged


def median_rates(rounds: list[dict]) -> dict:
    """Per rate, the median over the rounds of every number (nested dicts alike); a flag is
    set when any round set it (an overloaded round)."""
    def median(values: list):
        if all(isinstance(v, bool) for v in values):
            return any(values)
        if all(isinstance(v, (int, float)) for v in values):
            ordered = sorted(values)
            return ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1]
                                                                       + ordered[len(ordered) // 2]) / 2
        if all(isinstance(v, dict) for v in values):
            return {k: median([v[k] for v in values if k in v]) for k in dict.fromkeys(k for v in values for k in v)}
        return values[-1]
    labels = dict.fromkeys(lb for r in rounds for lb in r)
    return {lb: median([r[lb] for r in rounds if lb in r]) for lb in labels}


def watch_postgres(procs: Procs, pg: OwnPostgres | None, url: str) -> None:
    """PostgreSQL's CPU: the bench's own cluster, every process of it (backends that exited
    too); else the server listening on the URL's port and its children."""
    if pg:
        procs.add("postgres", pg.pids, pg.reaped_cpu)
    else:
        procs.add("postgres", lambda: postgres_pids(url))


def ledger_alone(name: str, store: str | None, permits: int = 1, batched: bool = True,
                 pg: OwnPostgres | None = None) -> dict:
    """Authorize + completed-report pairs. `batched`: the completions are sent the way the
    filter sends them by default (`completion_reports: batched`: whatever waits goes in one
    request when the previous one is answered); otherwise one report per request. On one
    permit every decision is serialized on it; with n permits pair i goes under permit
    i mod n, as n agents of the same rate."""
    ledger = start_ledger(f"alone-{name}", store)
    try:
        tokens = permit_file(f"alone-{name}", create_permits(ledger, permits, f"bench-{name}"))
        return ledger_pairs(name, ledger, tokens, store, batched, pg)
    finally:
        ledger.stop()


def ledger_pairs(name: str, ledger: stack.Ledger, tokens: Path, store: str | None, batched: bool = True,
                 pg: OwnPostgres | None = None) -> dict:
    """The ledger-alone run against a running ledger, under the permits of `tokens`."""
    procs = Procs()
    procs.add("ledger", [ledger.proc.pid])
    if store:
        watch_postgres(procs, pg, store)
        reset_statements(store)
    before = procs.cpu()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([str(LOAD), "ledger", "--url", ledger.url, "--service-token", SERVICE_TOKEN,
                        "--permit-file", str(tokens), "--concurrency", str(LEDGER_CONCURRENCY),
                        "--connections", "2",
                        "--duration", f"{LEDGER_SECONDS:g}", "--key-prefix", f"alone-{name}-{STAMP}"]
                       + (["--batched-completions"] if batched else []),
                       capture_output=True, text=True, timeout=LEDGER_SECONDS + 60)
    after = procs.cpu()
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    out = json.loads(r.stdout)
    pairs = max(out.get("pairs", 0), 1)
    out["cpu_s_per_1000_pairs"] = {p: round((after[p] - before[p]) / pairs * 1000, 4) for p in after}
    # The load generator runs on the same two cores.
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    loader = (done.ru_utime + done.ru_stime) - (children.ru_utime + children.ru_stime)
    out["cpu_s_per_1000_pairs"]["loader"] = round(loader / pairs * 1000, 4)
    out["peak_rss_mib"] = procs.hwm_mib()
    if store:
        out["pg_statements"] = top_statements(store)
    log(f"ledger alone ({name}): {out['pairs_per_s']:.0f} authorize+complete pairs/s, "
        f"p50 {out['p50_us'] / 1000:.2f} ms, failed {out['failed']}")
    return out


def call_instructions() -> dict:
    """Instructions per governed tools/call through the filter's state machine (natively,
    callgrind): the difference between N and N + 1000 calls, over 1000. Deterministic, so it
    shows a change to the filter's own work that timings on a shared machine would bury."""
    if os.environ.get("BENCH_CALLCOST", "1") == "0":
        return {}
    if not shutil.which("valgrind") or not CALLCOST.exists():
        return {"error": "valgrind or the call-cost driver is missing (make bench-tools)"}
    out = {}
    # The gateway's call, then a signed call through the verifier (`role: "verify"`).
    for field, mode in (("instructions_per_call", []), ("verify_instructions_per_call", ["verify"])):
        counts = []
        for n in (100, 1100):
            r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", str(CALLCOST),
                                *mode, str(n)], capture_output=True, text=True, timeout=600)
            m = re.search(r"Collected\s*:\s*(\d+)", r.stderr) or re.search(r"I\s+refs:\s+([\d,]+)", r.stderr)
            if r.returncode != 0 or not m:
                return {**out, "error": (r.stderr or r.stdout)[-500:]}
            counts.append(int(m.group(1).replace(",", "")))
        out[field] = round((counts[1] - counts[0]) / 1000)
    return out


def criterion() -> dict:
    """Runs the criterion benches (short) and reads their estimates."""
    chosen = os.environ.get("BENCH_CRITERION", "1")
    if chosen == "0":
        return {}
    args = ["--", "--warm-up-time", "1", "--measurement-time", "3", "--noplot"]
    benches = (("atmost-filter", "filter"), ("atmost-ledger", "store"), ("atmost-ledger", "signing"))
    if chosen != "1":
        names = {n.strip() for n in chosen.split(",")}
        benches = tuple(b for b in benches if b[1] in names)
    for pkg, bench in benches:
        r = subprocess.run(["cargo", "bench", "-q", "-p", pkg, "--bench", bench, *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            log(f"criterion {pkg}/{bench} failed: {r.stderr[-2000:]}")
    out = {}
    base = ROOT / "target" / "criterion"
    for est in sorted(base.glob("**/new/estimates.json")):
        bench_id = str(est.parent.parent.relative_to(base))
        try:
            data = json.loads(est.read_text())
            out[bench_id] = round(data["mean"]["point_estimate"] / 1000, 3)  # ns -> µs
        except (ValueError, KeyError):
            continue
    return out


# ---------------------------------------------------------------- report

def pct(v: dict, k: str) -> str:
    if "error" in v:
        return "error"
    return f"{v.get(k, 0) / 1000:.2f}"


def runs(v: dict) -> str:
    return ", ".join(f"{r:.0f}" for r in v.get("ceiling_runs_rps", []))


def machine() -> dict:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    envoy_version = subprocess.run([str(ENVOY), "--version"], capture_output=True, text=True).stdout.strip()
    # The embedded store commits with fsync: how long one takes on the data directory's disk.
    RUN.mkdir(parents=True, exist_ok=True)
    probe = RUN / "fsync.probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    times = []
    for _ in range(100):
        os.write(fd, b"x" * 4096)
        t = time.perf_counter()
        os.fdatasync(fd)
        times.append(time.perf_counter() - t)
    os.close(fd)
    probe.unlink()
    times.sort()
    return {"nproc": os.cpu_count(), "cpu": model, "memory_gib": round(mem_kib / 1024 / 1024, 1),
            "fdatasync_p50_ms": round(times[50] * 1000, 3), "fdatasync_p99_ms": round(times[98] * 1000, 3),
            "kernel": os.uname().release, "envoy": envoy_version.split("version:")[-1].strip()[:80],
            "load_before": os.getloadavg()}


# Targets (docs/performance.md#the-targets), as multiples of references measured in the same
# run, so that they read the same on every machine: at each of TARGET_RATES, c and c99 are one
# callout (S - B, p50 and p99), f and f99 the disk's fdatasync (p50, p99), e Envoy's own CPU
# per request in B; and counts per call that no clock moves. Each figure is the median of the
# rounds (median_rates).
TARGET_RATES = ("1%", "5%")


class Refs:
    """The references of one rate, in ms (e: CPU-ms per request)."""

    def __init__(self, s: dict, m: dict, rate: str):
        b = s.get("B", {})
        self.c = added_ms(s["S"], b, rate, "p50_us") if "S" in s and b else None
        self.c99 = added_ms(s["S"], b, rate, "p99_us") if "S" in s and b else None
        self.f, self.f99 = m["fdatasync_p50_ms"], m["fdatasync_p99_ms"]
        self.e = b.get("rates", {}).get(rate, {}).get("cpu_s_per_1000", {}).get("envoy")


# Latency a ledger adds over its zero (the same gateway with a decision that costs nothing):
# (setup, zero, percentile, the limit's formula, the limit from the references).
LEDGER_LATENCY_TARGETS = (
    ("Da", "D0a", "p50_us", "f + 1.0 c", lambda r: r.f + 1.0 * r.c),
    ("D", "D0", "p50_us", "f + 1.5 c", lambda r: r.f + 1.5 * r.c),
    ("Ea", "D0a", "p50_us", "f + 2.0 c", lambda r: r.f + 2.0 * r.c),
    ("E", "D0", "p50_us", "f + 3.0 c", lambda r: r.f + 3.0 * r.c),
    ("Da", "D0a", "p99_us", "2 f99 + 3 c99", lambda r: 2 * r.f99 + 3 * r.c99),
    ("Ea", "D0a", "p99_us", "2 f99 + 5 c99", lambda r: 2 * r.f99 + 5 * r.c99),
)
# The gateway's own share: its zero over plain Envoy.
GATEWAY_LATENCY_TARGETS = (("D0a", "p50_us", "2.5 c", lambda r: 2.5 * r.c),)
# Two replicas against one: (worse, better, percentile, formula, the allowance over `better`).
REPLICA_TARGETS = (("E2", "E", "p50_us", "+ 1 c", lambda r: r.c), ("E2", "E", "p99_us", "+ 1 c99", lambda r: r.c99))
# Many permits against one: the latency added over B at most this times the one-permit setup's.
MANY_PERMITS_VS_ONE = (("D1k", "D"), ("E1k", "E"))
MANY_PERMITS_FACTOR = 1.1
# CPU per governed call at 1 % of B, as a multiple of e: (setup, process, multiple).
CPU_TARGETS_E = (("D", "ledger", 1.2), ("Da", "ledger", 1.2), ("E", "ledger", 0.8), ("Ea", "ledger", 0.8),
                 ("E", "postgres", 1.5), ("Ea", "postgres", 1.5))
# Envoy's CPU per governed call at 1 % of B, at most this times Envoy's in D0 (the gateway
# with a free decision).
ENVOY_CPU_VS_D0 = (("D", 1.1), ("E", 1.1))
# Counts per call at 1 % of B: (setup, process, what, field, limit).
COUNT_TARGETS = (("D", "ledger", "context switches", "switches_per_call", 4),
                 ("E", "ledger", "context switches", "switches_per_call", 5),
                 ("E", "postgres", "context switches", "switches_per_call", 4),
                 ("E", "postgres", "statements", "pg_statements_per_call", 3))
# The ledger alone, authorize+complete pairs/s, at least this times B's ceiling, with one
# permit and with PERMITS permits (the filter's batched reports).
LEDGER_ALONE_VS_B = {"sqlite": 0.6, "postgres": 0.4}


def many_permits_row(store: str, permits: int) -> str:
    """The ledger-alone row of `store` with `permits` permits in use (written and checked)."""
    return f"{store}, {permits} permits"
PROCESS_ORDER = ("envoy", "envoy@tool", "ledger", "postgres", "loadgen", "stub")


def added_ms(setup: dict, b: dict, rate: str, key: str) -> float | None:
    """A setup's percentile minus B's at the same rate, ms; None when either is missing."""
    r, rb = setup.get("rates", {}).get(rate, {}), b.get("rates", {}).get(rate, {})
    if key not in r or key not in rb:
        return None
    return (r[key] - rb[key]) / 1000


def added_cell(setup: dict, b: dict, rate: str, key: str) -> str:
    d = added_ms(setup, b, rate, key)
    if d is None:
        return "error" if "error" in setup.get("rates", {}).get(rate, {}) else ""
    return f"{d:+.2f}" + (" (overloaded)" if setup["rates"][rate].get("overloaded") else "")


def per_process_table(s: dict, rate: str, field: str, form: str, title: str, text: str) -> list[str]:
    """A table of one per-process figure of the fixed-rate runs at `rate`, a row per setup;
    nothing when no setup measured it."""
    names = [p for p in PROCESS_ORDER if any(p in v["rates"].get(rate, {}).get(field, {}) for v in s.values())]
    if not names:
        return []
    lines = ["", f"## {title}", "", text, "", "| setup | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for k, v in s.items():
        c = v["rates"].get(rate, {}).get(field, {})
        lines.append(f"| {k} | " + " | ".join(form.format(c[p]) if p in c else "" for p in names) + " |")
    return lines


def signing_section(res: dict, labels: list[str]) -> list[str]:
    """What signing dispatches costs a call: V against D and Vp, the verifier Envoy's CPU, the
    bytes added, the micro-benchmarks of signing and checking."""
    s, sg = res["setups"], res.get("signing", {})
    crit = {k: v for k, v in res.get("criterion", {}).items() if k.startswith(("signing", "verify"))}
    cc = res.get("callcost", {})
    if not (sg or crit or "verify_instructions_per_call" in cc or any(k in s for k in AT_THE_TOOL)):
        return []
    lines = ["", "## Signed dispatches: what signing and verifying cost a call", ""]
    pairs = [(a, b) for a, b in (("V", "D"), ("V", "Vp"), ("Vp", "D")) if a in s and b in s]
    if pairs:
        lines += ["Latency one setup adds over another at the same rate (ms, p50 / p99); V − D is the "
                  "verifier at the tool with its Envoy hop, V − Vp the verifier's check alone.", "",
                  "| | " + " | ".join(f"{lb} of B: p50 | {lb}: p99" for lb in labels) + " |",
                  "|---|" + "---:|" * (2 * len(labels))]
        for a, b in pairs:
            lines.append(f"| {a} − {b} | " + " | ".join(
                f"{added_cell(s[a], s[b], lb, 'p50_us')} | {added_cell(s[a], s[b], lb, 'p99_us')}" for lb in labels) + " |")
        lines += ["", "CPU-ms per call of the Envoy at the tool, of the gateway's Envoy and of the ledger, at each rate:", ""]
        for k in ("D", "Vp", "V"):
            if k not in s:
                continue
            cells = []
            for lb in labels:
                c = s[k]["rates"].get(lb, {}).get("cpu_s_per_1000", {})
                cells.append(f"{lb}: " + ", ".join(f"{p} {c[p]:.3f}" for p in ("envoy@tool", "envoy", "ledger") if p in c))
            stats = s[k].get("tool_stats", {})
            verified = (f" (verifier: {stats.get('wasmcustom.atmost_verified', 0)} calls verified, "
                        f"{stats.get('wasmcustom.atmost_denied', 0)} refused)") if k == "V" else ""
            lines.append(f"- {k}: " + "; ".join(cells) + verified)
    up = sg.get("upstream")
    if up:
        if "error" in up:
            lines += ["", f"Bytes a signed dispatch adds upstream: not measured ({up['error']})."]
        else:
            lines += ["", f"Bytes a signed dispatch adds to the upstream request (the first request a ledger of "
                          f"the run signed, as the stub received it, {up.get('version')}): {up['name_value_bytes']} bytes of header names "
                          f"and values, {up['http1_line_bytes']} as HTTP/1.1 header lines:", ""]
            lines += [f"- `{n}: {v}` ({len(n) + len(v)} bytes)" for n, v in up["headers"].items()]
    au = sg.get("authorize")
    if au:
        if "error" in au:
            lines += ["", f"Authorize exchange: not measured ({au['error'][:300]})."]
        else:
            lines += ["", f"One authorize exchange with the bench ledger, with and without a dispatch target: the "
                          f"request grew by {au['request_grew_bytes']} bytes ({au['unsigned']['request_bytes']} → "
                          f"{au['signed']['request_bytes']}), the Dispatch answer by {au['answer_grew_bytes']} "
                          f"({au['unsigned']['answer_bytes']} → {au['signed']['answer_bytes']})."]
    if crit:
        lines += ["", "Micro-benchmarks (criterion mean, µs): " + "; ".join(f"{k} {v}" for k, v in crit.items()) + "."]
    if "verify_instructions_per_call" in cc:
        lines += ["", f"Verifier instructions per signed governed tools/call (native, callgrind, opt-level s): "
                      f"{cc['verify_instructions_per_call']:,}."]
    return lines


def write_report(res: dict) -> list[tuple[str, bool, str]]:
    s = res["setups"]
    ceil = {k: v["ceiling_rps"] for k, v in s.items()}
    B = ceil.get("B") or 1.0
    RB = res.get("rate_base_rps") or B
    b = s.get("B", {})
    labels = [rate_label(p) for p in RATES]
    m = res["machine"]
    checks: list[tuple[str, bool, str]] = []
    pending = list(res.get("pending", []))
    warnings: list[str] = []

    def check(label, ok, detail):
        checks.append((label, ok, detail))

    # ---- the targets (each with its figure, its limit in ms for this run, PASS/FAIL)
    def diff_ms(a: str, z: str, rate: str, key: str) -> float | None:
        """Setup `a`'s percentile minus setup `z`'s at `rate`, ms."""
        return added_ms(s[a], s[z], rate, key) if a in s and z in s else None

    def overloaded(rate: str, *names: str) -> bool:
        return any(s.get(n, {}).get("rates", {}).get(rate, {}).get("overloaded") for n in names)

    refs = {rate: Refs(s, m, rate) for rate in TARGET_RATES}
    for rate in TARGET_RATES:
        r = refs[rate]
        if r.c is None or r.c99 is None:
            pending.append(f"the references at {rate} of B (S and B): not measured in this run")
            continue
        if r.c <= 0 or r.c99 <= 0:
            # S faster than B: the run's noise is larger than one callout, and no limit
            # drawn from it means anything.
            warnings.append(f"the references at {rate} of B are not positive (c {r.c:.2f} ms, c99 {r.c99:.2f} ms): "
                            "the machine was too busy for a callout to show; its latency targets are not checked")
            continue
        for name, zero, key, formula, limit in LEDGER_LATENCY_TARGETS:
            label = f"({name} - {zero}) {key[:3]} <= {formula} at {rate} of B"
            d = diff_ms(name, zero, rate, key)
            if d is None:
                pending.append(f"{label}: not measured in this run")
                continue
            lim = limit(r)
            check(label, d <= lim and not overloaded(rate, name, zero),
                  f"{d:+.2f} ms, limit {lim:.2f} ms (f {r.f:.2f}, f99 {r.f99:.2f}, c {r.c:.2f}, c99 {r.c99:.2f})"
                  + (", overloaded" if overloaded(rate, name, zero) else ""))
        for name, key, formula, limit in GATEWAY_LATENCY_TARGETS:
            label = f"({name} - B) {key[:3]} <= {formula} at {rate} of B"
            d = diff_ms(name, "B", rate, key)
            if d is None:
                pending.append(f"{label}: not measured in this run")
                continue
            check(label, d <= limit(r), f"{d:+.2f} ms, limit {limit(r):.2f} ms (c {r.c:.2f})")
        for worse, better, key, formula, allowance in REPLICA_TARGETS:
            label = f"({worse} - B) {key[:3]} <= ({better} - B) {formula} at {rate} of B"
            dw, db = diff_ms(worse, "B", rate, key), diff_ms(better, "B", rate, key)
            if dw is None or db is None:
                pending.append(f"{label}: not measured in this run")
                continue
            lim = db + allowance(r)
            check(label, dw <= lim, f"{worse} {dw:+.2f} ms, limit {lim:+.2f} ms ({better} {db:+.2f})")
        for many, one in MANY_PERMITS_VS_ONE:
            for key in ("p50_us", "p99_us"):
                label = f"({many} - B) {key[:3]} <= {MANY_PERMITS_FACTOR:g} x ({one} - B) at {rate} of B"
                dm, do = diff_ms(many, "B", rate, key), diff_ms(one, "B", rate, key)
                if dm is None or do is None:
                    pending.append(f"{label}: not measured in this run")
                    continue
                lim = MANY_PERMITS_FACTOR * max(do, 0.0)
                check(label, dm <= lim, f"{many} {dm:+.2f} ms, limit {lim:+.2f} ms ({one} {do:+.2f})")
    cpu_at = "1%"
    e = refs.get(cpu_at).e if cpu_at in refs else None

    def at_cpu_rate(name: str, field: str, proc: str):
        return s.get(name, {}).get("rates", {}).get(cpu_at, {}).get(field, {}).get(proc)

    for name, proc, multiple in CPU_TARGETS_E:
        label = f"{proc} CPU per governed call in {name} at {cpu_at} of B <= {multiple:g} e"
        v = at_cpu_rate(name, "cpu_s_per_1000", proc)
        if v is None or not e:
            pending.append(f"{label}: not measured in this run")
        else:
            check(label, v <= multiple * e, f"{v:.3f} ms, limit {multiple * e:.3f} ms (e {e:.3f}): {v / e:.2f} e")
    for name, multiple in ENVOY_CPU_VS_D0:
        label = f"Envoy CPU per governed call in {name} at {cpu_at} of B <= {multiple:g} x D0's"
        v, d0 = at_cpu_rate(name, "cpu_s_per_1000", "envoy"), at_cpu_rate("D0", "cpu_s_per_1000", "envoy")
        if v is None or not d0:
            pending.append(f"{label}: not measured in this run")
        else:
            check(label, v <= multiple * d0, f"{v:.3f} ms, limit {multiple * d0:.3f} ms (D0 {d0:.3f}): {v / d0:.2f} x")
    for name, proc, what, field, limit in COUNT_TARGETS:
        label = f"{proc} {what} per call in {name} at {cpu_at} of B <= {limit}"
        if field == "pg_statements_per_call":
            v = s.get(name, {}).get("rates", {}).get(cpu_at, {}).get(field)
        else:
            v = at_cpu_rate(name, field, proc)
        if v is None:
            pending.append(f"{label}: not measured in this run")
        else:
            check(label, v <= limit, f"{v:.1f}")
    la = res.get("ledger_alone", {})
    permits_run = res.get("permits", PERMITS)
    for store, multiple in LEDGER_ALONE_VS_B.items():
        for row, which in ((store, "one permit"), (many_permits_row(store, permits_run), f"{permits_run} permits")):
            label = f"ledger alone, {store}, {which} >= {multiple:g} x B's ceiling"
            if row in la and "pairs_per_s" in la[row] and "B" in ceil:
                v = la[row]["pairs_per_s"]
                check(label, v >= multiple * B, f"{v:,.0f} pairs/s, limit {multiple * B:,.0f} ({v / B:.2f} x B)")
            else:
                pending.append(f"{label}: not measured in this run")
    size = res["wasm_bytes"]
    check("wasm module <= 1 MiB", size <= 1 << 20, f"{size / 1024:.0f} KiB")
    # A denied call is answered fast and counted like any other: a setup with denials (or
    # failed requests) measured something else than governed calls going through.
    for k, v in s.items():
        denied = v["envoy_stats"].get("wasmcustom.atmost_denied", 0)
        failed = sum(r.get("non2xx", 0) + r.get("errors", 0) for r in v["rates"].values()) + v["ceiling"].get("non2xx", 0)
        refused = v.get("tool_stats", {}).get("wasmcustom.atmost_denied", 0)
        if refused:
            warnings.append(f"{k}: the verifier at the tool refused {refused} calls (see its Envoy's log)")
        if denied or failed:
            warnings.append(f"{k}: {denied} calls denied by the gateway, {failed} requests failed; its figures "
                            "are not those of governed calls (see Envoy's log in the run directory)")
    res["warnings"] = warnings

    # ---- the report: added latency and CPU per call first
    lines = ["# atmost benchmarks", "",
             f"Machine: {m['nproc']} vCPU ({m['cpu']}), {m['memory_gib']} GiB, Linux {m['kernel']}; "
             f"Envoy {m['envoy']}, `--concurrency 1`. fdatasync on the data directory's disk: p50 "
             f"{m['fdatasync_p50_ms']} ms, p99 {m['fdatasync_p99_ms']} ms. Load average before the run: "
             f"{', '.join(f'{x:.2f}' for x in m['load_before'])}. PostgreSQL: {res['postgres']['server']}"
             + (f", {res['postgres'].get('version')}, fsync {res['postgres'].get('fsync')}, synchronous_commit "
                f"{res['postgres'].get('synchronous_commit')}" if res["postgres"].get("own_cluster") else "")
             + f". The run took {res.get('wall_seconds', 0)} s.", "",
             f"Fixed rates: bench/loadgen, open loop, {RATE_CONNECTIONS} connections, {RATE_SECONDS:g} s each, "
             "latency from each request's due time (coordinated omission corrected). "
             f"Ceilings: wrk, 1 thread, {WRK_CONNECTIONS} connections, {SECONDS:g} s runs; {REPEATS} rounds, each "
             "running every setup once in turn (ceiling, then the fixed rates), the best ceiling of each kept. "
             f"The fixed rates are the same in every round, percentages of B's first ceiling ({RB:.0f} req/s); "
             "each latency, CPU and count figure below is the median of the rounds.",
             "", "## Added latency over B (ms, this run)", ""]
    if b.get("rates"):
        lines.append("B itself: " + "; ".join(
            f"at {lb} of B ({RB * p / 100:.0f}/s) p50 {pct(b['rates'][lb], 'p50_us')}, p99 {pct(b['rates'][lb], 'p99_us')}"
            for p, lb in zip(RATES, labels) if lb in b["rates"]) + " ms.")
    lines += ["", "Each setup's p50 and p99 minus B's at the same rate. The floors of this run come first: one "
                  "HTTP/2 callout (S − B) and one fdatasync on the data directory's disk (p50), the least a "
                  "decision that is durable before the call goes on can add.", "",
              "| setup | " + " | ".join(f"{lb} of B: p50 − B | {lb}: p99 − B" for lb in labels) + " |",
              "|---|" + "---:|" * (2 * len(labels))]
    if "S" in s and b:
        lines.append("| floor: one callout (S − B) | " + " | ".join(
            f"{added_cell(s['S'], b, lb, 'p50_us')} | {added_cell(s['S'], b, lb, 'p99_us')}" for lb in labels) + " |")
    lines.append("| floor: fdatasync p50 | " + " | ".join(
        f"{m['fdatasync_p50_ms']:.2f} | {m['fdatasync_p50_ms']:.2f}" for _ in labels) + " |")
    for k, v in s.items():
        if k in ("B", "S"):
            continue
        lines.append(f"| {k} | " + " | ".join(
            f"{added_cell(v, b, lb, 'p50_us')} | {added_cell(v, b, lb, 'p99_us')}" for lb in labels) + " |")
    cpu_rate = "1%" if "1%" in labels else (labels[0] if labels else None)
    if cpu_rate:
        lines += per_process_table(
            s, cpu_rate, "cpu_s_per_1000", "{:.3f}",
            f"CPU per call at {cpu_rate} of B (CPU-ms per request, per process)",
            "Nothing is saturated at this rate. Each figure is the process's CPU over the run divided by "
            "the calls of the run, so it holds the process's fixed cost per second too (timers, health "
            "checks, PostgreSQL's background writers), as a call at this rate really pays it. The load "
            "generator shares the two cores with the rest.")
        lines += per_process_table(
            s, cpu_rate, "switches_per_call", "{:.1f}",
            f"Context switches per call at {cpu_rate} of B (per process)",
            "How often each process slept and was woken per call, every thread counted (a "
            "PostgreSQL backend that exited during the run is not): the crossings that the CPU "
            "time above pays for, counted rather than timed, so a machine where a wake-up "
            "costs more does not inflate them.")
        counted = [(k, v["rates"][cpu_rate]["pg_statements_per_call"]) for k, v in s.items()
                   if "pg_statements_per_call" in v["rates"].get(cpu_rate, {})]
        if counted:
            lines += ["", f"PostgreSQL statements per call at {cpu_rate} of B (pg_stat_statements over the run, "
                          "BEGIN, SET and COMMIT included): " + ", ".join(f"{k} {n:.1f}" for k, n in counted) + "."]
    lines += signing_section(res, labels)
    lines += ["", "## Targets", "",
              "Each latency and CPU target is a multiple of references of this run, at the same rate: c and "
              "c99, one callout (S − B, p50 and p99); f and f99, one fdatasync (p50, p99); e, Envoy's own "
              "CPU per request in B. Its limit in ms for this run is given with its figure.", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {label} ({detail})" for label, ok, detail in checks]
    lines += [f"- PENDING: {p}" for p in pending]
    lines += [f"- WARNING: {w}" for w in warnings]

    # ---- ceilings and ratios: figures only
    lines += ["", "## Ceilings and ratios (figures, not targets: on two shared cores they measure the squeeze)", "",
              "| setup | what | ceiling (req/s) | × B | × N | × S | all runs |", "|---|---|---:|---:|---:|---:|---|"]
    n, sv = ceil.get("N"), ceil.get("S")
    for k, v in s.items():
        lines.append(f"| {k} | {v['description']} | {v['ceiling_rps']:.0f} | {v['ceiling_rps'] / B:.2f} | "
                     + (f"{v['ceiling_rps'] / n:.2f}" if n else "") + " | "
                     + (f"{v['ceiling_rps'] / sv:.2f}" if sv else "") + f" | {runs(v)} |")
    ratios = [f"{a}/{d} = {ceil[a] / ceil[d]:.3f}" for a, d in (("C", "N"), ("D", "S"), ("E", "S"), ("D0", "S"),
                                                                      ("Da", "D"), ("Ea", "E"))
              if a in ceil and ceil.get(d)]
    if ratios:
        lines += ["", "Ratios: " + ", ".join(ratios) + "."]
    lines += ["", "## Latency at fixed rates (ms; p50 / p99 / p99.9)", "",
              "| setup | " + " | ".join(f"{lb} of B = {RB * p / 100:.0f}/s" for p, lb in zip(RATES, labels)) + " |",
              "|---|" + "---|" * len(labels)]
    for k, v in s.items():
        cells = []
        for lb in labels:
            r = v["rates"].get(lb, {})
            cell = f"{pct(r, 'p50_us')} / {pct(r, 'p99_us')} / {pct(r, 'p999_us')}"
            if r.get("overloaded"):
                cell += f" (overloaded: {r.get('achieved_rps', 0):.0f}/s done)"
            cells.append(cell)
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    if res.get("oha_check"):
        o = res["oha_check"]
        lines += ["", f"Cross-check, B at {labels[0]} with oha `-q --latency-correction`: p50 {pct(o, 'p50_us')} ms, "
                      f"p99 {pct(o, 'p99_us')} ms, p99.9 {pct(o, 'p999_us')} ms."]
    names = [p for p in PROCESS_ORDER if any(p in v["cpu_s_per_1000"] for v in s.values())]
    lines += ["", "## CPU-ms per request over the ceiling run, and peak RSS (MiB)", "",
              "| setup | " + " | ".join(f"{p} CPU" for p in names) + " | " + " | ".join(f"{p} RSS" for p in names)
              + " |", "|---|" + "---:|" * (2 * len(names))]
    for k, v in s.items():
        lines.append(f"| {k} | " + " | ".join(str(v["cpu_s_per_1000"].get(p, "")) for p in names) + " | "
                     + " | ".join(str(v["peak_rss_mib"].get(p, "")) for p in names) + " |")
    for k in FLOODED:
        if "flood" in s.get(k, {}):
            f = s[k]["flood"]
            lines += ["", f"{k}'s flood while it ran: {f['answered_429']:.0f} wrong tokens answered 429, "
                          f"{f['store_checks']:.0f} store reads for /readyz (the background check's, once a "
                          "second); compare its latency with D's above."]
    for lb in labels[1:]:
        lines += ["", f"CPU-ms per request at {lb} of B: " + "; ".join(
            f"{k} " + ", ".join(f"{p} {c:.3f}" for p, c in v["rates"].get(lb, {}).get("cpu_s_per_1000", {}).items())
            for k, v in s.items()) + "."]

    # ---- the ledger alone
    lines += ["", f"## Ledger alone (authorize + completed report pairs, h2c, {LEDGER_CONCURRENCY} in flight)", "",
              "Completions are sent as the filter sends them by default (`completion_reports: batched`: "
              "what waits goes in one request once the previous one is answered), or one report per "
              "request. On one permit every decision waits for the one before it; with "
              f"{res.get('permits', PERMITS)} permits pair n goes under permit n mod {res.get('permits', PERMITS)}, "
              "as that many agents. The targets are checked on the rows with the filter's default traffic: "
              "one permit, and that many.", "",
              "| store | pairs/s | p50 ms | p99 ms | ledger CPU-ms/pair | PostgreSQL CPU-ms/pair | loader CPU-ms/pair | failed |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k, v in la.items():
        if "error" in v:
            lines.append(f"| {k} | error: {v['error'][:200]} | | | | | | |")
            continue
        c = v.get("cpu_s_per_1000_pairs", {})
        lines.append(f"| {k} | {v['pairs_per_s']:.0f} | {v['p50_us'] / 1000:.2f} | {v['p99_us'] / 1000:.2f} | "
                     f"{c.get('ledger', '')} | {c.get('postgres', '')} | {c.get('loader', '')} | {v['failed']} |")

    # ---- where PostgreSQL's time goes
    stmts = [(k, v["pg_statements"]) for k, v in s.items() if "pg_statements" in v]
    stmts += [(f"ledger alone, {k}", v["pg_statements"]) for k, v in la.items() if "pg_statements" in v]
    if stmts:
        lines += ["", "## Where PostgreSQL's time goes (pg_stat_statements, reset before each fixed-rate run)", "",
                  "Top statements by total execution time, over the setup's last fixed-rate run "
                  "or the ledger-alone run. Execution time only: commits' WAL flushes are not in it.", "",
                  "| where | calls | total ms | mean ms | rows | statement |", "|---|---:|---:|---:|---:|---|"]
        for where, top in stmts:
            if isinstance(top, dict):
                lines.append(f"| {where} | | | | | not read: {top.get('error', '')[:200]} |")
                continue
            for st in top[:5]:
                q = str(st.get("query", "")).replace("|", "\\|")[:120]
                lines.append(f"| {where} | {st.get('calls')} | {st.get('total_ms')} | {st.get('mean_ms')} | "
                             f"{st.get('rows')} | `{q}` |")

    # ---- memory, callouts per call, the filter's own cost
    lines += ["", "## Filter memory per worker; ledger callouts per call", ""]
    b_rss = s.get("B", {}).get("peak_rss_mib", {}).get("envoy")
    for k, v in s.items():
        mem = v.get("envoy_memory", {})
        rss = v["peak_rss_mib"].get("envoy")
        extra = f", {rss - b_rss:+.1f} MiB vs B" if b_rss is not None and rss is not None else ""
        lines.append(f"- {k}: Envoy peak RSS {rss} MiB{extra}; heap allocated "
                     f"{int(mem.get('allocated', 0)) / 1048576:.1f} MiB; "
                     f"V8 VMs active: {v['envoy_stats'].get('wasm.envoy.wasm.runtime.v8.active', '-')}")
    for k, v in s.items():
        st = v["envoy_stats"]
        calls = st.get("wasmcustom.atmost_dispatched", 0) + st.get("wasmcustom.atmost_replayed", 0)
        if calls:
            lines.append(f"- {k}: ledger callouts per governed tools/call: "
                         f"{st.get('cluster.atmost_ledger.upstream_rq_total', 0) / calls:.2f} "
                         f"(dispatched {st.get('wasmcustom.atmost_dispatched', 0)}, replayed "
                         f"{st.get('wasmcustom.atmost_replayed', 0)}, denied {st.get('wasmcustom.atmost_denied', 0)})")
    lines += ["", "(With `--concurrency 1` Envoy holds two VMs of the module: the main thread's and the "
                  "worker's; the RSS difference to B is both plus V8 itself.)"]
    if res.get("criterion"):
        lines += ["", "## Criterion (mean, µs)", "", "| benchmark | µs |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in res["criterion"].items()]
    cc = res.get("callcost", {})
    if "instructions_per_call" in cc:
        lines += ["", f"Filter instructions per governed tools/call (native, callgrind, opt-level s): "
                      f"{cc['instructions_per_call']:,}."]
    elif "error" in cc:
        lines += ["", f"Filter instructions per call: not measured ({cc['error'][:200]})."]
    lines += ["", f"wasm module: {size} bytes ({size / 1024:.0f} KiB)."]
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    res["pending"] = pending
    return checks


def start_postgres(res: dict) -> tuple[OwnPostgres | None, str | None]:
    """The bench's own cluster if the binaries are there, else DATABASE_URL's server (said in
    the report), else none (the PostgreSQL setups are then pending)."""
    if (PG_BINDIR / "initdb").exists() and (PG_BINDIR / "pg_ctl").exists() and shutil.which("psql"):
        pg = OwnPostgres(PG_BINDIR)
        try:
            pg.start()
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            pg.stop()
            raise
        res["postgres"] = {"server": f"the bench's own cluster ({PG_BINDIR}, port {pg.port})",
                           "own_cluster": True,
                           "version": psql(pg.url, "SHOW server_version"),
                           "fsync": psql(pg.url, "SHOW fsync"),
                           "synchronous_commit": psql(pg.url, "SHOW synchronous_commit"),
                           "shared_buffers": psql(pg.url, "SHOW shared_buffers")}
        log(f"PostgreSQL: {res['postgres']}")
        return pg, pg.url
    url = os.environ.get("DATABASE_URL")
    if url:
        res["postgres"] = {"server": f"DATABASE_URL's server: no PostgreSQL binaries in {PG_BINDIR}, so its CPU "
                                     "is shared with whatever else uses it and pg_stat_statements may be missing",
                           "own_cluster": False}
        log(f"PostgreSQL: {res['postgres']['server']}")
    return None, url


def start_stub(running: list) -> tuple[stack.Process, int, int]:
    """The stub upstream, added to `running`: the process, its MCP port and its callout port."""
    mcp_port, callout_port = stack.free_port(), stack.free_port()
    stub = stack.Process("stub", [str(STUB), "--mcp", str(mcp_port), "--callout", str(callout_port)], RUN)
    stub.start()
    running.append(stub)
    stack.wait_until(lambda: stack.http_get(f"http://127.0.0.1:{mcp_port}/")[0] in (200, 400), 10, "stub")
    return stub, mcp_port, callout_port


def stop_all(running: list, pg: OwnPostgres | None, pg_url: str | None, schemas: list[str]) -> None:
    """Stops what a run started, the newest first, then its PostgreSQL: the bench's own
    cluster, or on DATABASE_URL's server the schemas the run made."""
    for p in reversed(running):
        p.stop()
    if pg:
        pg.stop()
    elif pg_url:
        drop_pg_schemas(pg_url, schemas)


def main() -> int:
    began = time.monotonic()
    # SIGTERM unwinds like an error, so the `finally` below still stops PostgreSQL and the rest.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    RUN.mkdir(parents=True, exist_ok=True)
    # The ledgers log at the shipped default (info: a line per decision and per report).
    os.environ.pop("RUST_LOG", None)
    wanted = [w.strip() for w in os.environ.get("BENCH_SETUPS", ",".join(SETUPS)).split(",") if w.strip()]
    unknown = [w for w in wanted if w not in SETUPS]
    if unknown:
        log(f"unknown setups {unknown}: choose among {', '.join(SETUPS)}")
        return 2
    # What the chosen setups run.
    needed = [STUB, LOAD, ATMOST_WASM]
    if LEDGER_ALONE or any(n not in ("B", "N", "S", "S2", *STUB_LEDGER) for n in wanted):
        needed.append(LEDGER_BIN)
    if "N" in wanted:
        needed.append(NOOP_WASM)
    if "S" in wanted or "S2" in wanted:
        needed.append(CALLOUT_WASM)
    for path in needed:
        if not path.exists():
            log(f"missing {path}: run `make bench`")
            return 2
    if not shutil.which("wrk"):
        log("wrk is missing (Debian: apt-get install wrk)")
        return 2
    res: dict = {"machine": machine(), "setups": {}, "ledger_alone": {}, "pending": [],
                 "wasm_bytes": ATMOST_WASM.stat().st_size, "rates_percent_of_b": list(RATES), "permits": PERMITS,
                 "postgres": {"server": "none"}, "signing": {}}
    log(f"machine: {res['machine']}")
    running: list = []
    pg: OwnPostgres | None = None
    pg_url: str | None = None
    try:
        if any(n in wanted for n in ON_POSTGRES) or LEDGER_ALONE:
            pg, pg_url = start_postgres(res)
        stub, mcp_port, callout_port = start_stub(running)
        # Rounds: each round measures every setup once, in turn, so a noisy stretch of a shared
        # machine hits all setups alike instead of all runs of one; the best round is kept.
        order = [n for n in SETUPS if n in wanted]
        for rnd, name in [(r, n) for r in range(REPEATS) for n in order]:
            last_round = rnd == REPEATS - 1
            if name in ON_POSTGRES and not pg_url:
                if last_round:
                    res["pending"].append(f"{name}: no PostgreSQL (no binaries in {PG_BINDIR}, DATABASE_URL unset)")
                continue
            ledgers: list[stack.Ledger] = []
            permit: Permit = None
            procs = Procs()
            if name in ("C", "D", "Da", "D1k", "Dr", *FLOODED, "E", "Ea", "E2", "E1k", *AT_THE_TOOL):
                store = pg_url if name in ON_POSTGRES else None
                ledgers.append(start_ledger(name, store))
                running.append(ledgers[0])
                if name == "E2":  # a second replica on the same schema, the same store
                    ledgers.append(start_ledger("E2-replica", store, schema="E2"))
                    running.append(ledgers[1])
                if name in MANY_PERMITS:
                    permit = permit_file(name, create_permits(ledgers[0], PERMITS, f"bench-{name}"))
                else:
                    permit = ledgers[0].create_permit("--tools", "*", label=f"bench-{name}")["token"]
            elif name in STUB_LEDGER:
                # The stub checks nothing, but the gateway sends a call only under the permit its
                # token names, which the stub answers: a token of the ledger's shape.
                permit = "atmp_pmt_0123456789abcdef01234567_" + "0" * 64
            wasm = {"B": None, "N": NOOP_WASM, "S": CALLOUT_WASM, "S2": CALLOUT_WASM}.get(name, ATMOST_WASM)
            overrides = {"ledger": {"service_token": SERVICE_TOKEN}}
            if name == "S2":
                overrides["two_callouts"] = True
            if wasm == ATMOST_WASM and os.environ.get("BENCH_PLUGIN"):
                # Extra atmost plugin settings, e.g. '{"completion_reports": "per_call"}'.
                overrides.update(json.loads(os.environ["BENCH_PLUGIN"]))
            if name in ANSWER_AT_ONCE:
                overrides["answer_release"] = "at_once"
            if name in ANSWER_AT_ONCE and name not in STUB_LEDGER and wasm == ATMOST_WASM:
                overrides["report_ride_ms"] = int(os.environ.get("BENCH_RIDE_MS", "0"))
            ledger_ports = [lg.port for lg in ledgers] or [callout_port]
            upstream_port = mcp_port
            # Picked first: the verifier serves the authority the gateway's calls are signed for.
            gateway_port = stack.free_port()
            tool_side: Envoy | None = None
            if name in AT_THE_TOOL:
                # The tool's side: the verifier keyed from this setup's ledger, or (Vp) a plain
                # Envoy, health-checking the static stub as B's does.
                if AT_THE_TOOL[name]:
                    tool_side = Envoy(f"{name}-tool", ATMOST_WASM, mcp_port, ledger_ports,
                                      plugin=verifier_plugin(ledgers[0], f"127.0.0.1:{gateway_port}"))
                else:
                    tool_side = Envoy(f"{name}-tool", None, mcp_port, [callout_port])
                tool_side.start()
                running.append(tool_side)
                upstream_port = tool_side.port
            envoy = Envoy(name, wasm, upstream_port, ledger_ports, overrides, port=gateway_port)
            envoy.start()
            running.append(envoy)
            procs.add("envoy", [envoy.proc.pid])
            if tool_side:
                procs.add("envoy@tool", [tool_side.proc.pid])
            procs.add("stub", [stub.proc.pid])
            if ledgers:
                procs.add("ledger", [lg.proc.pid for lg in ledgers])
            if name in ON_POSTGRES:
                watch_postgres(procs, pg, pg_url)
                reset_statements(pg_url)
            # What a signature adds, from the first setup of the last round whose ledger signs
            # (D0's stub only stands in for signatures).
            measure_signing = (name in SIGNED_BY_LEDGER and last_round and "upstream" not in res["signing"]
                               and isinstance(permit, str))
            if measure_signing:
                forget_signed(mcp_port)
            flooding = None
            if name in FLOODED:
                flooding = stack.Process(f"{name}-flood", [sys.executable, str(Path(__file__).resolve()), "flood",
                                                          ledgers[0].url], RUN)
                flooding.start()
                running.append(flooding)
                flooded_from = ledger_counters(ledgers[0])
            # Every round runs the fixed rates at the same rates: RATES of B's first ceiling.
            rate_base = res.get("rate_base_rps")
            res["setups"][name] = merge_round(res["setups"].get(name), run_setup(
                name, envoy, procs, rate_base, permit, pg_url if name in ON_POSTGRES else None))
            if name == "B" and rate_base is None:
                res["rate_base_rps"] = res["setups"]["B"]["runs"][0]["rps"]
            if flooding:
                flooding.stop()
                running.remove(flooding)
                res["setups"][name]["flood"] = {k: v - flooded_from[k]
                                                for k, v in ledger_counters(ledgers[0]).items()}
            if name in ON_POSTGRES and last_round:
                # Since the reset: this round's ceiling and fixed-rate runs.
                res["setups"][name]["pg_statements"] = top_statements(pg_url)
            if tool_side:
                res["setups"][name]["tool_stats"] = tool_side.stats("wasmcustom.", "http.mcp.downstream_rq_")
            if measure_signing:
                res["signing"]["upstream"] = upstream_bytes(mcp_port)
                res["signing"]["authorize"] = authorize_bytes(ledgers[0], permit, f"127.0.0.1:{envoy.port}")
            if name == "B" and last_round and RATES:
                res["oha_check"] = oha_fixed_rate(envoy.url, CALL_FRESH.replace("{SEQ}", "x"),
                                                  res["setups"]["B"]["ceiling_rps"] * RATES[0] / 100)
            for p in (envoy, *([tool_side] if tool_side else []), *ledgers):
                p.stop()
                running.remove(p)
        if LEDGER_ALONE:
            res["ledger_alone"]["sqlite"] = ledger_alone("sqlite", None)
            res["ledger_alone"]["sqlite, one report per request"] = ledger_alone("sqlite1", None, batched=False)
            res["ledger_alone"][many_permits_row("sqlite", PERMITS)] = ledger_alone("sqlite-many", None, PERMITS)
            if pg_url:
                res["ledger_alone"]["postgres"] = ledger_alone("postgres", pg_url, pg=pg)
                res["ledger_alone"]["postgres, one report per request"] = ledger_alone(
                    "postgres1", pg_url, batched=False, pg=pg)
                res["ledger_alone"][many_permits_row("postgres", PERMITS)] = ledger_alone("postgres-many", pg_url, PERMITS, pg=pg)
            else:
                res["pending"].append("ledger alone on PostgreSQL: no PostgreSQL")
    finally:
        stop_all(running, pg, pg_url, sorted(SCHEMAS_USED))
    res["criterion"] = criterion()
    res["callcost"] = call_instructions()
    res["wall_seconds"] = round(time.monotonic() - began)
    checks = write_report(res)
    res["targets"] = [{"target": label, "pass": ok, "measured": detail} for label, ok, detail in checks]
    (OUT / "results.json").write_text(json.dumps(res, indent=1, default=str))
    print()
    for label, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {label}  ({detail})")
    for p in res["pending"]:
        print(f"PENDING  {p}")
    for w in res.get("warnings", []):
        print(f"WARNING  {w}")
    print(f"\nwrote {OUT / 'results.md'} and {OUT / 'results.json'} ({res['wall_seconds']} s)")
    return 0

if __name__ == "__main__":
    if sys.argv[1:2] == ["flood"] and len(sys.argv) == 3:
        sys.exit(flood(sys.argv[2]))
    sys.exit(main())
