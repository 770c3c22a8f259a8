#!/usr/bin/env python3
"""`make bench-held`: what a call held open for a person's approval (`approval_hold_ms`,
docs/approvals.md#holding-the-call-open) costs the gateway, next to what a governed call costs
it, both measured in this run on this machine.

One gateway (Envoy with the filter, one worker, as `make bench` runs it; its tick at 200 ms)
in front of the example MCP server, one ledger on SQLite. Three windows of BENCH_HELD_SECONDS
each (default 20):

  idle     nothing is sent: Envoy's own timers and the filter's tick;
  held     BENCH_HELD_CALLS calls (default 200), each under a permit that asks a person first,
           held open for the whole window (nobody decides): Envoy's CPU over the idle window's,
           per held call and second, and the ledger's authorize answers `approval_required`
           per held call and second (the filter's re-asks);
  governed BENCH_HELD_REFERENCE calls (default 400), one after another, each a governed
           tools/call with a fresh key that is dispatched and completes (authorize, the call,
           the completion report): Envoy's CPU per call, the reference.

The result is the ratio of the first to the last: how many governed calls' worth of Envoy's CPU
one held call costs per second. Counts, not milliseconds, carry across machines. Writes
target/bench/held/results.json and results.md; no PASS/FAIL (no target is set for it).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from atmost_stack import Envoy, ExampleServer, Ledger, wait_until  # noqa: E402
from tests.support.mcp_raw import RawMcp, denial_code  # noqa: E402

HELD = int(os.environ.get("BENCH_HELD_CALLS", "200"))
SECONDS = float(os.environ.get("BENCH_HELD_SECONDS", "30"))
REFERENCE = int(os.environ.get("BENCH_HELD_REFERENCE", "400"))
OUT = ROOT / "target" / "bench" / "held"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (every thread), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def approval_asks(ledger: Ledger) -> int:
    found = re.search(r'^atmost_authorize_total\{code="approval_required",decision="deny"\} (\d+)$',
                      ledger.metrics(), re.M)
    return int(found.group(1)) if found else 0


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    logs = OUT / "logs"
    logs.mkdir(exist_ok=True)
    server = ExampleServer(logs, json_response=True, name="mcp-server-held")
    ledger = Ledger(logs, OUT / f"ledger-{uuid.uuid4().hex[:6]}", name="ledger-held",
                    extra_args=["--approval-wait", "1h"])
    envoy = None
    started = []
    try:
        for p in (server, ledger):
            p.start()
            started.append(p)
        envoy = Envoy(logs, server.port, [ledger.port], concurrency=1, name="envoy-held",
                      plugin_overrides={"ledger": {"service_token": ledger.service_token},
                                        "approval_hold_ms": 240_000, "report_interval_ms": 200})
        envoy.start()
        started.append(envoy)
        pid = envoy.proc.pid
        plain = ledger.create_permit("--tools", "echo", label="bench-held-reference")
        asks_first = ledger.create_permit("--approval-default", "always", label="bench-held")

        time.sleep(2)
        c0 = cpu_seconds(pid)
        time.sleep(SECONDS)
        idle = cpu_seconds(pid) - c0

        def held_call(i: int) -> str | None:
            c = RawMcp(envoy.url)
            c.http.timeout = SECONDS * 4 + 60
            try:
                return denial_code(c.call("echo", {"text": f"held-{i}"}, asks_first["token"], f"held-{i}"))
            finally:
                c.close()

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=HELD)
        answers = [pool.submit(held_call, i) for i in range(HELD)]
        wait_until(lambda: approval_asks(ledger) >= HELD, 60, f"{HELD} calls held")
        time.sleep(2)
        a0, c0 = approval_asks(ledger), cpu_seconds(pid)
        time.sleep(SECONDS)
        held_cpu = cpu_seconds(pid) - c0 - idle
        asks = approval_asks(ledger) - a0
        assert not any(a.done() for a in answers), "a held call was answered during the window"
        # Release them: each one's next re-ask is answered approval_rejected.
        for a in ledger.cli_json("approval", "list", "--permit", asks_first["id"])["approvals"]:
            ledger.cli("approval", "reject", a["id"])
        codes = [a.result(timeout=60) for a in answers]
        pool.shutdown()

        c = RawMcp(envoy.url)
        c0 = cpu_seconds(pid)
        for i in range(REFERENCE):
            r = c.call("echo", {"text": f"ref-{i}"}, plain["token"], f"ref-{uuid.uuid4()}")
            assert r.status_code == 200 and denial_code(r) is None, r.text
        per_call = (cpu_seconds(pid) - c0) / REFERENCE
        c.close()
    finally:
        for p in reversed(started):
            p.stop()

    per_held_second = held_cpu / (HELD * SECONDS)
    results = {
        "held_calls": HELD, "seconds": SECONDS, "reference_calls": REFERENCE,
        "envoy_idle_cpu_ms_per_s": round(idle / SECONDS * 1000, 3),
        "envoy_cpu_ms_per_held_call_second": round(per_held_second * 1000, 4),
        "authorize_asks_per_held_call_second": round(asks / (HELD * SECONDS), 3),
        "envoy_cpu_ms_per_governed_call": round(per_call * 1000, 4),
        "held_call_second_in_governed_calls": round(per_held_second / per_call, 3) if per_call else None,
        "released_with": sorted(set(map(str, codes))),
    }
    (OUT / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["# What a held call costs the gateway", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in results.items()]
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
