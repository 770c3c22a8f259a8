#!/usr/bin/env python3
"""`make bench`: the gateway's cost next to plain Envoy, the ledger's throughput, and targets.

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
  D   atmost + ledger on the embedded store (SQLite), tools/call with fresh keys
  Dr  D with one repeated key (replays)
  E   D with the ledger on PostgreSQL (DATABASE_URL)

Per setup: the ceiling (wrk, closed loop, 1 thread, 32 connections), then open-loop fixed
rates at 25/50/75 % of B's ceiling (bench/loadgen, latency from each request's due time),
CPU-seconds per 1000 requests of each process over the ceiling run, peak RSS (VmHWM).
Then the ledger alone (authorize + completed report pairs over h2c), criterion
micro-benchmarks, the filter's instructions per call (callgrind), the module size; writes target/bench/results.{md,json}, prints PASS/FAIL.

Environment (knobs):
  BENCH_SETUPS        setups to run, e.g. "B,N,D0,D" (default all)
  BENCH_SECONDS       one ceiling run, seconds (default 6)
  BENCH_REPEATS       rounds: each measures every setup's ceiling once, in turn; the best
                      round of each setup is kept, the fixed rates run in the last (default 3)
  BENCH_CONNECTIONS   wrk connections of the ceiling runs (default 32)
  BENCH_RATES         fixed rates as percentages of B's ceiling (default "25,50,75"; empty: none)
  BENCH_RATE_SECONDS  each fixed rate, seconds (default 5)
  BENCH_LEDGER_ALONE  0 skips the ledger-alone runs
  BENCH_LEDGER_SECONDS  each ledger-alone run, seconds (default 8)
  BENCH_LEDGER_CONCURRENCY  pairs in flight in the ledger-alone runs (default 64)
  BENCH_CRITERION     0 skips criterion
  BENCH_CALLCOST      0 skips counting the filter's instructions per call (valgrind)
  BENCH_OUT           output directory
  BENCH_LEDGER_BIN    another `atmost` build, to compare a change
  BENCH_PLUGIN        JSON merged into atmost's plugin configuration,
                      e.g. '{"completion_reports": "per_call"}'
  DATABASE_URL        E and the ledger-on-PostgreSQL numbers (skipped if unset)
"""

from __future__ import annotations

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
RATE_SECONDS = float(os.environ.get("BENCH_RATE_SECONDS", "5"))
LEDGER_SECONDS = float(os.environ.get("BENCH_LEDGER_SECONDS", "8"))
LEDGER_CONCURRENCY = int(os.environ.get("BENCH_LEDGER_CONCURRENCY", "64"))
WRK_CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "32"))
RATE_CONNECTIONS = 64
FRACTIONS = tuple(int(x) / 100 for x in os.environ.get("BENCH_RATES", "25,50,75").split(",") if x.strip())
LEDGER_ALONE = os.environ.get("BENCH_LEDGER_ALONE", "1") != "0"
CLK_TCK = os.sysconf("SC_CLK_TCK")
SERVICE_TOKEN = "bench-service-token"
ADMIN_TOKEN = "bench-admin-token"
STAMP = str(int(time.time()))

INIT = '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"bench","version":"0"}}}'
LIST = '{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{}}'
CALL_FRESH = '{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"{SEQ}"},"_meta":{"dev.atmost/idempotency-key":"{SEQ}"}}}'
CALL_REPLAY = '{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"same"},"_meta":{"dev.atmost/idempotency-key":"replay-' + STAMP + '"}}}'

BODIES = {"B": [CALL_FRESH], "N": [CALL_FRESH], "S": [CALL_FRESH], "S2": [CALL_FRESH], "C": [INIT, LIST],
          "D0": [CALL_FRESH], "D": [CALL_FRESH], "Dr": [CALL_REPLAY], "E": [CALL_FRESH]}
DESCRIPTION = {
    "B": "plain Envoy",
    "N": "Envoy + no-op wasm filter",
    "S": "Envoy + wasm filter, one HTTP/2 callout per request (static stub)",
    "S2": "Envoy + wasm filter, two callouts per request (before the request, before the last response chunk)",
    "C": "atmost, non-tool MCP traffic (initialize, tools/list)",
    "D0": "atmost, tools/call, fresh keys, ledger replaced by the static stub (no store)",
    "D": "atmost, tools/call, fresh keys, ledger on SQLite",
    "Dr": "atmost, tools/call, one repeated key (replays), SQLite",
    "E": "atmost, tools/call, fresh keys, ledger on PostgreSQL",
}


def log(msg: str) -> None:
    print(f"bench: {msg}", flush=True)


# ---------------------------------------------------------------- processes and /proc

def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


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


class Procs:
    """Named groups of pids whose CPU time and peak RSS are reported."""

    def __init__(self):
        self.groups: dict[str, callable] = {}

    def add(self, name: str, pids) -> None:
        self.groups[name] = pids if callable(pids) else (lambda p=pids: p)

    def cpu(self) -> dict[str, float]:
        return {n: sum(cpu_seconds(p) for p in f()) for n, f in self.groups.items()}

    def hwm_mib(self) -> dict[str, float]:
        return {n: round(sum(hwm_kib(p) for p in f()) / 1024, 1) for n, f in self.groups.items()}


class Envoy(stack.Process):
    def __init__(self, name: str, wasm: Path | None, upstream_port: int, ledger_port: int,
                 plugin_overrides: dict | None = None):
        self.port = stack.free_port()
        self.admin_port = stack.free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        config = stack.sidecar_config(self.port, self.admin_port, upstream_port, [ledger_port], plugin_overrides,
                                      wasm=wasm or ATMOST_WASM, plain=wasm is None)
        path = RUN / f"envoy-{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        # One worker, so runs compare; warning level: a production log level, and the same
        # for every setup.
        super().__init__(f"envoy-{name}", [str(ENVOY), "-c", str(path), "--concurrency", "1",
                                           "--use-dynamic-base-id", "-l", "warning"], RUN)

    def start(self) -> None:
        super().start()
        stack.wait_until(lambda: self.alive() and stack.http_get(self.admin + "/ready")[0] == 200, 30,
                         f"envoy {self.name} (log: {self.log_path})")

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


def start_ledger(name: str, store: str | None) -> stack.Ledger:
    data = RUN / f"data-{name}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    # PostgreSQL: a fresh schema per ledger, like the fresh SQLite file (dropped at the end).
    extra = ["--store", store, "--pg-schema", pg_schema(name)] if store else []
    os.environ["ATMOST_BIN"] = str(LEDGER_BIN)
    ledger = stack.Ledger(RUN, data, service_token=SERVICE_TOKEN, admin_token=ADMIN_TOKEN,
                          extra_args=extra, name=f"ledger-{name}")
    ledger.start()
    return ledger


def pg_schema(name: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", f"atmost_bench_{STAMP}_{name}".lower())


def drop_pg_schemas(url: str, names: list[str]) -> None:
    if not shutil.which("psql"):
        return
    for n in names:
        subprocess.run(["psql", url, "-qc", f"DROP SCHEMA IF EXISTS {pg_schema(n)} CASCADE"],
                       capture_output=True, timeout=60)


# ---------------------------------------------------------------- load

def body_file(name: str, lines: list[str]) -> Path:
    path = RUN / f"bodies-{name}.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def wrk(url: str, bodies: Path, seconds: float, prefix: str, permit: str | None) -> dict:
    env = {**os.environ, "BODY_FILE": str(bodies), "KEY_PREFIX": prefix, "PERMIT": permit or ""}
    argv = ["wrk", "-t1", f"-c{WRK_CONNECTIONS}", f"-d{seconds:g}s", "--latency", "-s", str(LUA), url]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=seconds + 60).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": float(rps.group(1)) if rps else 0.0, "requests": int(total.group(1)) if total else 0,
            "non2xx": int(bad.group(1)) if bad else 0, "socket_errors": errors.group(1) if errors else "",
            "raw": out}


def fixed_rate(url: str, bodies: Path, rate: float, prefix: str, permit: str | None) -> dict:
    argv = [str(LOAD), "rate", "--url", url, "--rate", f"{rate:.0f}", "--duration", f"{RATE_SECONDS:g}",
            "--connections", str(RATE_CONNECTIONS), "--body-file", str(bodies), "--key-prefix", prefix]
    if permit:
        argv += ["--header", f"atmost-permit: {permit}"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=RATE_SECONDS + 60)
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    return json.loads(r.stdout)


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

def run_setup(name: str, envoy: Envoy, procs: Procs, b_ceiling: float | None, permit: str | None,
              with_rates: bool) -> dict:
    """One ceiling run of a setup (one round), and its fixed-rate runs when `with_rates`."""
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
    base = b_ceiling or run["rps"]
    for f in FRACTIONS if with_rates else ():
        # CPU per request at a fixed rate: the cost of a request when nothing is saturated
        # (at the ceiling, time slices fight for 2 cores and the per-request cost grows).
        before = procs.cpu()
        r = fixed_rate(envoy.url, bodies, base * f, f"{prefix}-r{int(f * 100)}", permit)
        after = procs.cpu()
        done = max(r.get("completed", 0), 1)
        r["cpu_s_per_1000"] = {p: round((after[p] - before[p]) / done * 1000, 4) for p in after}
        rates[f"{int(f * 100)}%"] = r
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
    CPU); the fixed rates and Envoy's stats are from the round that ran them (the last)."""
    runs = (prev["runs"] if prev else []) + new["runs"]
    best = max(runs, key=lambda r: r["rps"])
    merged = {**new, "runs": runs, "ceiling_rps": best["rps"],
              "ceiling": {k: v for k, v in best.items() if k != "cpu"},
              "ceiling_runs_rps": [r["rps"] for r in runs], "cpu_s_per_1000": best["cpu"]}
    if prev:
        if not new["rates"]:
            merged["rates"] = prev["rates"]
        merged["peak_rss_mib"] = {k: max(v, prev["peak_rss_mib"].get(k, 0)) for k, v in new["peak_rss_mib"].items()}
    return merged


def ledger_alone(name: str, store: str | None, permits: int = 1, batched: bool = True) -> dict:
    """Authorize + completed-report pairs. `batched`: the completions are sent the way the
    filter sends them by default (`completion_reports: batched`: whatever waits goes in one
    request when the previous one is answered); otherwise one report per request. On one
    permit every decision is serialized on it; several permits are several agents."""
    ledger = start_ledger(f"alone-{name}", store)
    try:
        permit = ",".join(ledger.create_permit("--tools", "*", label=f"bench-{name}-{i}")["token"]
                          for i in range(permits))
        procs = Procs()
        procs.add("ledger", [ledger.proc.pid])
        if store:
            procs.add("postgres", lambda: postgres_pids(store))
        before = procs.cpu()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run([str(LOAD), "ledger", "--url", ledger.url, "--service-token", SERVICE_TOKEN,
                            "--permit", permit, "--concurrency", str(LEDGER_CONCURRENCY), "--connections", "2",
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
        log(f"ledger alone ({name}, {permits} permit(s)): {out['pairs_per_s']:.0f} authorize+complete pairs/s, "
            f"p50 {out['p50_us'] / 1000:.2f} ms, failed {out['failed']}")
        return out
    finally:
        ledger.stop()


def call_instructions() -> dict:
    """Instructions per governed tools/call through the filter's state machine (natively,
    callgrind): the difference between N and N + 1000 calls, over 1000. Deterministic, so it
    shows a change to the filter's own work that timings on a shared machine would bury."""
    if os.environ.get("BENCH_CALLCOST", "1") == "0":
        return {}
    if not shutil.which("valgrind") or not CALLCOST.exists():
        return {"error": "valgrind or the call-cost driver is missing (make bench-tools)"}
    counts = []
    for n in (100, 1100):
        r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", str(CALLCOST), str(n)],
                           capture_output=True, text=True, timeout=600)
        m = re.search(r"Collected\s*:\s*(\d+)", r.stderr) or re.search(r"I\s+refs:\s+([\d,]+)", r.stderr)
        if r.returncode != 0 or not m:
            return {"error": (r.stderr or r.stdout)[-500:]}
        counts.append(int(m.group(1).replace(",", "")))
    return {"instructions_per_call": round((counts[1] - counts[0]) / 1000)}


def criterion() -> dict:
    """Runs the criterion benches (short) and reads their estimates."""
    if os.environ.get("BENCH_CRITERION", "1") == "0":
        return {}
    args = ["--", "--warm-up-time", "1", "--measurement-time", "3", "--noplot"]
    for pkg, bench in (("atmost-filter", "filter"), ("atmost-ledger", "store")):
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


def write_report(res: dict) -> list[tuple[str, bool, str]]:
    s = res["setups"]
    ceil = {k: v["ceiling_rps"] for k, v in s.items()}
    B = ceil.get("B") or 1.0
    checks: list[tuple[str, bool, str]] = []

    def check(label, ok, detail):
        checks.append((label, ok, detail))

    if "C" in ceil and "N" in ceil:
        check("C >= 0.97 x N throughput", ceil["C"] >= 0.97 * ceil["N"], f"{ceil['C'] / ceil['N']:.3f} x N")
    if "D" in ceil and "S" in ceil:
        check("D >= 0.80 x S throughput", ceil["D"] >= 0.80 * ceil["S"], f"{ceil['D'] / ceil['S']:.3f} x S")
    if "D" in s and "B" in s and "25%" in s["D"]["rates"] and "25%" in s["B"]["rates"]:
        d50, b50 = s["D"]["rates"]["25%"].get("p50_us", 1e12), s["B"]["rates"]["25%"].get("p50_us", 0)
        check("D p50 <= B p50 + 0.5 ms at 25% of B", d50 - b50 <= 500,
              f"D {d50 / 1000:.2f} ms vs B {b50 / 1000:.2f} ms (+{(d50 - b50) / 1000:.2f} ms)")
    la = res.get("ledger_alone", {})
    if "sqlite" in la:
        v = la["sqlite"].get("pairs_per_s", 0)
        check("ledger alone, SQLite >= 10,000 pairs/s", v >= 10000, f"{v:.0f} pairs/s")
    if "postgres" in la:
        v = la["postgres"].get("pairs_per_s", 0)
        check("ledger alone, PostgreSQL >= 2,000 pairs/s", v >= 2000, f"{v:.0f} pairs/s")
    size = res["wasm_bytes"]
    check("wasm module <= 1 MiB", size <= 1 << 20, f"{size / 1024:.0f} KiB")

    m = res["machine"]
    lines = ["# atmost benchmarks", "",
             f"Machine: {m['nproc']} vCPU ({m['cpu']}), {m['memory_gib']} GiB, Linux {m['kernel']}; "
             f"Envoy {m['envoy']}, `--concurrency 1`. fdatasync on the data directory's disk: p50 "
             f"{m['fdatasync_p50_ms']} ms, p99 {m['fdatasync_p99_ms']} ms. Load average before the run: "
             f"{', '.join(f'{x:.2f}' for x in m['load_before'])}.", "",
             f"Ceiling: wrk, 1 thread, {WRK_CONNECTIONS} connections, {SECONDS:g} s runs; {REPEATS} rounds, each running "
             "every setup once in turn (a noisy stretch hits all setups alike), the best round of each kept. Fixed rates: bench/loadgen, "
             f"open loop, {RATE_CONNECTIONS} connections, {RATE_SECONDS:g} s each, latency from each request's due "
             "time (coordinated omission corrected). CPU over the best ceiling run.", "",
             "## Throughput", "",
             "| setup | what | ceiling (req/s) | × B | × N | × S | all runs |", "|---|---|---:|---:|---:|---:|---|"]
    for k, v in s.items():
        n, sv = ceil.get("N"), ceil.get("S")
        lines.append(f"| {k} | {v['description']} | {v['ceiling_rps']:.0f} | {v['ceiling_rps'] / B:.2f} | "
                     f"{v['ceiling_rps'] / n:.2f} | {v['ceiling_rps'] / sv:.2f} | {runs(v)} |" if n and sv else
                     f"| {k} | {v['description']} | {v['ceiling_rps']:.0f} | {v['ceiling_rps'] / B:.2f} | | | {runs(v)} |")
    lines += ["", "## Latency at fixed rates (ms; p50 / p99 / p99.9)", "",
              "| setup | " + " | ".join(f"{int(f * 100)}% of B = {B * f:.0f}/s" for f in FRACTIONS) + " |",
              "|---|" + "---|" * len(FRACTIONS)]
    for k, v in s.items():
        cells = []
        for f in FRACTIONS:
            r = v["rates"][f"{int(f * 100)}%"]
            cell = f"{pct(r, 'p50_us')} / {pct(r, 'p99_us')} / {pct(r, 'p999_us')}"
            if r.get("overloaded"):
                cell += f" (overloaded: {r.get('achieved_rps', 0):.0f}/s done)"
            cells.append(cell)
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    if res.get("oha_check"):
        o = res["oha_check"]
        lines += ["", f"Cross-check, B at 25% with oha `-q --latency-correction`: p50 {pct(o, 'p50_us')} ms, "
                      f"p99 {pct(o, 'p99_us')} ms, p99.9 {pct(o, 'p999_us')} ms."]
    names = sorted({p for v in s.values() for p in v["cpu_s_per_1000"]})
    lines += ["", "## CPU-seconds per 1000 requests (ceiling run) and peak RSS (MiB)", "",
              "| setup | " + " | ".join(f"{p} CPU" for p in names) + " | " + " | ".join(f"{p} RSS" for p in names)
              + " |", "|---|" + "---:|" * (2 * len(names))]
    for k, v in s.items():
        lines.append(f"| {k} | " + " | ".join(str(v["cpu_s_per_1000"].get(p, "")) for p in names) + " | "
                     + " | ".join(str(v["peak_rss_mib"].get(p, "")) for p in names) + " |")
    if FRACTIONS:
        f0 = f"{int(FRACTIONS[0] * 100)}%"
        lines += ["", f"## CPU-seconds per 1000 requests at {f0} of B's ceiling (nothing saturated)", "",
                  "| setup | " + " | ".join(f"{p} CPU" for p in names) + " |", "|---|" + "---:|" * len(names)]
        for k, v in s.items():
            c = v["rates"].get(f0, {}).get("cpu_s_per_1000", {})
            lines.append(f"| {k} | " + " | ".join(str(c.get(p, "")) for p in names) + " |")
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
    lines += ["", "## Ledger alone (authorize + completed report pairs, h2c, 64 in flight)", "",
              "Completions are sent as the filter sends them by default (`completion_reports: batched`: "
              "what waits goes in one request once the previous one is answered), or one report per "
              "request. On one permit every decision waits for the one before it; 16 permits are 16 "
              "agents. The targets are checked on the first row of each store: one permit, the "
              "filter's default traffic.", "",
              "| store | pairs/s | p50 ms | p99 ms | ledger CPU-s/1000 | store CPU-s/1000 | loader CPU-s/1000 | failed |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k, v in la.items():
        if "error" in v:
            lines.append(f"| {k} | error: {v['error'][:200]} | | | | | | |")
            continue
        c = v.get("cpu_s_per_1000_pairs", {})
        lines.append(f"| {k} | {v['pairs_per_s']:.0f} | {v['p50_us'] / 1000:.2f} | {v['p99_us'] / 1000:.2f} | "
                     f"{c.get('ledger', '')} | {c.get('postgres', '')} | {c.get('loader', '')} | {v['failed']} |")
    if res.get("criterion"):
        lines += ["", "## Criterion (mean, µs)", "", "| benchmark | µs |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in res["criterion"].items()]
    cc = res.get("callcost", {})
    if "instructions_per_call" in cc:
        lines += ["", f"Filter instructions per governed tools/call (native, callgrind, opt-level s): "
                      f"{cc['instructions_per_call']:,}."]
    elif "error" in cc:
        lines += ["", f"Filter instructions per call: not measured ({cc['error'][:200]})."]
    lines += ["", f"wasm module: {size} bytes ({size / 1024:.0f} KiB).", "", "## Targets", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {label} ({detail})" for label, ok, detail in checks]
    pending = [x for x in res.get("pending", [])]
    lines += [f"- PENDING: {p}" for p in pending]
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    return checks


def main() -> int:
    RUN.mkdir(parents=True, exist_ok=True)
    os.environ["RUST_LOG"] = "warn"
    for path in (STUB, LOAD, NOOP_WASM, CALLOUT_WASM, ATMOST_WASM, LEDGER_BIN):
        if not path.exists():
            log(f"missing {path}: run `make bench`")
            return 2
    if not shutil.which("wrk"):
        log("wrk is missing (Debian: apt-get install wrk)")
        return 2
    wanted = os.environ.get("BENCH_SETUPS", "B,N,S,S2,C,D0,D,Dr,E").split(",")
    pg_url = os.environ.get("DATABASE_URL")
    res: dict = {"machine": machine(), "setups": {}, "ledger_alone": {}, "pending": [],
                 "wasm_bytes": ATMOST_WASM.stat().st_size}
    log(f"machine: {res['machine']}")
    mcp_port, callout_port = stack.free_port(), stack.free_port()
    stub = stack.Process("stub", [str(STUB), "--mcp", str(mcp_port), "--callout", str(callout_port)], RUN)
    stub.start()
    stack.wait_until(lambda: stack.http_get(f"http://127.0.0.1:{mcp_port}/")[0] in (200, 400), 10, "stub")
    running: list[stack.Process] = [stub]
    try:
        # Rounds: each round measures every setup once, in turn, so a noisy stretch of a shared
        # machine hits all setups alike instead of all runs of one; the best round is kept.
        order = [n for n in ("B", "N", "S", "S2", "C", "D0", "D", "Dr", "E") if n in wanted]
        for rnd, name in [(r, n) for r in range(REPEATS) for n in order]:
            last_round = rnd == REPEATS - 1
            if name == "E" and not pg_url:
                if last_round:
                    res["pending"].append("E: DATABASE_URL is not set")
                continue
            ledger = None
            permit = None
            procs = Procs()
            if name in ("C", "D", "Dr", "E"):
                ledger = start_ledger(name, pg_url if name == "E" else None)
                running.append(ledger)
                permit = ledger.create_permit("--tools", "*", label=f"bench-{name}")["token"]
            elif name == "D0":
                permit = "bench-d0-permit"  # the stub checks nothing
            wasm = {"B": None, "N": NOOP_WASM, "S": CALLOUT_WASM, "S2": CALLOUT_WASM}.get(name, ATMOST_WASM)
            overrides = {"ledger": {"service_token": SERVICE_TOKEN}}
            if name == "S2":
                overrides["two_callouts"] = True
            if wasm == ATMOST_WASM and os.environ.get("BENCH_PLUGIN"):
                # Extra atmost plugin settings, e.g. '{"completion_reports": "per_call"}'.
                overrides.update(json.loads(os.environ["BENCH_PLUGIN"]))
            envoy = Envoy(name, wasm, mcp_port, ledger.port if ledger else callout_port, overrides)
            envoy.start()
            running.append(envoy)
            procs.add("envoy", [envoy.proc.pid])
            procs.add("stub", [stub.proc.pid])
            if ledger:
                procs.add("ledger", [ledger.proc.pid])
            if name == "E":
                procs.add("postgres", lambda: postgres_pids(pg_url))
            b = res["setups"].get("B", {}).get("ceiling_rps")
            res["setups"][name] = merge_round(res["setups"].get(name),
                                              run_setup(name, envoy, procs, b, permit, last_round))
            if name == "B" and last_round:
                res["oha_check"] = oha_fixed_rate(envoy.url, CALL_FRESH.replace("{SEQ}", "x"),
                                                  res["setups"]["B"]["ceiling_rps"] * 0.25)
            for p in (envoy, ledger):
                if p:
                    p.stop()
                    running.remove(p)
        if LEDGER_ALONE:
            res["ledger_alone"]["sqlite"] = ledger_alone("sqlite", None)
            res["ledger_alone"]["sqlite, one report per request"] = ledger_alone("sqlite1", None, batched=False)
            res["ledger_alone"]["sqlite, 16 permits"] = ledger_alone("sqlite16", None, 16)
            if pg_url:
                res["ledger_alone"]["postgres"] = ledger_alone("postgres", pg_url)
                res["ledger_alone"]["postgres, one report per request"] = ledger_alone("postgres1", pg_url,
                                                                                       batched=False)
                res["ledger_alone"]["postgres, 16 permits"] = ledger_alone("postgres16", pg_url, 16)
            else:
                res["pending"].append("ledger alone on PostgreSQL: DATABASE_URL is not set")
    finally:
        for p in reversed(running):
            p.stop()
        if pg_url:
            drop_pg_schemas(pg_url, ["E", "alone-postgres", "alone-postgres1", "alone-postgres16"])
    res["criterion"] = criterion()
    res["callcost"] = call_instructions()
    (OUT / "results.json").write_text(json.dumps(res, indent=1, default=str))
    checks = write_report(res)
    print()
    for label, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {label}  ({detail})")
    for p in res["pending"]:
        print(f"PENDING  {p}")
    print(f"\nwrote {OUT / 'results.md'} and {OUT / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
