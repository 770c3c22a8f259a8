"""`make soak`: governed calls at a pod's rate for SOAK_SECONDS (default 3600) while a nemesis
injects faults at random; then every promise is checked over the whole run. docs/soak.md
says what runs, the faults, the checks and how to read the report.

    SOAK_SECONDS  how long the load and the faults last (default 3600; `make soak-ci`: 300)
    SOAK_SEED     the seed of every random draw (default: a new one, printed)
    SOAK_RATE     governed calls per second, all agents together (default 10)
    SOAK_OUT      where report.json, report.md, rss.png and the logs go (default target/soak)

Exit status: 0 no violation; 1 violations (listed in the report); 2 the harness failed (a
fault could not be injected or healed, the stack did not start): no verdict.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.faults.fault_stack import UPSTREAM_SECRET  # noqa: E402
from tests.faults.test_ledger_faults import LOAD_CODES  # noqa: E402
from tests.soak import report as report_mod  # noqa: E402
from tests.soak.load import CAPS, CALL_TIMEOUT_S, Load  # noqa: E402
from tests.soak.nemesis import KINDS, Faults, Nemesis  # noqa: E402
from tests.soak.slow_disk import SlowDisk  # noqa: E402
from tests.soak.stack import CALLOUT_TIMEOUT_S, LEASE_S, ROUTE_TIMEOUT_S, SCHEMA, SoakStack  # noqa: E402
from tests.soak.verdicts import explain_uncertain, rss_flat, stuck_in_flight, sweep_lateness  # noqa: E402
from tests.support.history import (acked_completions, check, recount_mismatches, row_owners,  # noqa: E402
                                  wait_settled)
from tests.support.pg_pair import PgPair  # noqa: E402
from tests.support.stack import ROOT, wait_until  # noqa: E402

AGENTS = 6
ROTATE_S = 60.0  # a new capped permit (a new task) this often
RSS_INTERVAL_S = 2.0
PROBE_WORKERS = 8
RECOVERY_S = 90.0  # after the last fault healed: both replicas ready, Envoy sees them healthy
SETTLE_S = LEASE_S + 30.0  # then no attempt in_flight
# Beyond SOAK_SECONDS: start-up, recovery, settling, probes, checks; past it the run is ended.
OVERRUN_S = 1200.0


def min_life(seconds: float) -> float:
    """How long a process lives at least before the nemesis restarts it (nemesis.py)."""
    return min(seconds / 3, 600.0)


class Sampler(threading.Thread):
    """Resident memory (VmRSS) of Envoy's current epoch and of each replica, from /proc."""

    def __init__(self, stack: SoakStack, t0: float):
        super().__init__(daemon=True, name="rss")
        self.stack, self.t0 = stack, t0
        self.samples: list[tuple[float, str, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(RSS_INTERVAL_S):
            for name, process in [("envoy", self.stack.envoy), *((r.name, r) for r in self.stack.ledgers)]:
                proc = process.proc
                if proc is None or proc.poll() is not None:
                    continue
                try:
                    status = Path(f"/proc/{proc.pid}/status").read_text()
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("VmRSS:"):
                        self.samples.append((time.monotonic() - self.t0, name, proc.pid, int(line.split()[1])))


def main() -> int:
    seconds = float(os.environ.get("SOAK_SECONDS") or 3600)
    seed = int(os.environ["SOAK_SEED"]) if os.environ.get("SOAK_SEED") else random.SystemRandom().randrange(2**31)
    rate = float(os.environ.get("SOAK_RATE") or 10)
    out = Path(os.environ.get("SOAK_OUT") or ROOT / "target" / "soak").resolve()
    log_dir = out / "logs"
    shutil.rmtree(out, ignore_errors=True)  # a ledger log of an earlier run would be read as this one's
    log_dir.mkdir(parents=True)
    log_file = open(out / "soak.log", "a")

    def log(message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    log(f"soak: {seconds:.0f} s at {rate:g} calls/s, seed {seed} (SOAK_SEED={seed} repeats every draw), "
        f"output {out}")

    def overrun(*_):
        log(f"soak: ended after {seconds + OVERRUN_S:.0f} s (SOAK_SECONDS + {OVERRUN_S:.0f}): no verdict")
        raise SystemExit(2)

    def interrupted(signum, _frame):
        log(f"soak: signal {signum}: no verdict")
        raise SystemExit(2)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGALRM, overrun)
    signal.alarm(int(seconds + OVERRUN_S))
    wall_started = time.monotonic()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(log_file.close)
        cleanup.callback(signal.alarm, 0)
        disk, how = SlowDisk.open()
        if disk is not None:
            cleanup.callback(disk.close)
            slow_disk = f"a real one: PostgreSQL on a loop device, writes throttled by a cgroup ({how})"
        else:
            slow_disk = f"stand-in: the store links delayed (no throttled disk here: {how})"
        log(f"slow disk: {slow_disk}")
        pair = PgPair(synchronous_commit="on", name="soak", fsync=disk is not None,
                      parent=disk.mount_point if disk else None,
                      after_start=(lambda node: disk.confine_tree(node.postmaster_pid())) if disk else None)
        cleanup.callback(pair.stop)
        # Before the pair's directory goes: PostgreSQL's own logs, beside the others.
        cleanup.callback(lambda: [shutil.copyfile(f, log_dir / f"postgres-{f.name}")
                                  for f in pair.root.glob("*.log")])
        pair.start()
        data_root = Path(tempfile.mkdtemp(prefix="atmost-soak-"))
        cleanup.callback(shutil.rmtree, data_root, True)
        stack = SoakStack(log_dir, data_root, pair, permit_hours=math.ceil((seconds + OVERRUN_S) / 3600) + 1)
        cleanup.callback(stack.stop)
        t0 = time.monotonic()
        t0_wall_ms = int(time.time() * 1000)
        sampler = Sampler(stack, t0)
        sampler.start()
        cleanup.callback(sampler.stop.set)
        stack.start()
        free = [stack.permit() for _ in range(2)]
        capped = [stack.permit(CAPS) for _ in range(math.ceil(seconds / ROTATE_S) + 1)]
        log(f"stack up in {time.monotonic() - t0:.1f} s; {len(stack.permits)} permits")

        load = Load(stack, seed, rate, AGENTS, free, capped, ROTATE_S)
        cleanup.callback(load.finish)
        stop = threading.Event()
        cleanup.callback(stop.set)
        faults = Faults(stack, disk, load.set_hangup_share, stop)
        started = time.monotonic()
        nemesis = Nemesis(faults, seed, started + seconds, min_life(seconds), log)
        load.start()
        nemesis.start()
        next_note = started + 30
        while time.monotonic() < started + seconds and not stop.is_set():
            stop.wait(1.0)
            if time.monotonic() >= next_note:
                next_note += 30
                log(f"+{time.monotonic() - started:.0f} s: {len(stack.history.calls)} calls, "
                    f"{len(nemesis.windows)} faults, {stack.history.summary()}")
        stop.set()
        nemesis.join(180)
        harness_errors = list(nemesis.errors)
        if nemesis.is_alive():
            harness_errors.append("the nemesis did not heal its last fault within 180 s")
        if not load.finish(CALL_TIMEOUT_S + 20):
            harness_errors.append("the agents did not stop")
        harness_errors += load.errors[:20]
        log(f"load stopped: {len(stack.history.calls)} calls; recovering")

        violations: list[str] = []
        try:
            wait_until(stack.healthy, RECOVERY_S, "both replicas ready and healthy in Envoy")
        except TimeoutError as e:
            violations.append(f"the stack did not recover within {RECOVERY_S:.0f} s after the last fault: {e}")
        permit_ids = {p.id for p in stack.permits}
        rows = wait_settled(stack.rows, permit_ids, SETTLE_S)
        probes = stack.probe_all(rows, workers=PROBE_WORKERS)
        rows = wait_settled(stack.rows, permit_ids, SETTLE_S)
        read_at_ms = int(time.time() * 1000)
        sampler.stop.set()
        log(f"settled; {len(probes)} probes; checking {len(stack.history.calls)} calls, {len(rows)} attempts")

        violations += check(stack.history, stack.upstream.snapshot(), stack.permits, UPSTREAM_SECRET,
                            store_rows=rows, acked=acked_completions(stack.ledger_logs()),
                            allowed_codes=LOAD_CODES, require_probes=True,
                            # pg_failover kills the primary: an acknowledged report's
                            # asynchronous commit may go with it (its attempt then uncertain by
                            # its lease, which explain_uncertain below must tie to the failover).
                            reports_may_be_lost=True)
        violations += [f"counter: {m}" for m in recount_mismatches(pair.primary.url, SCHEMA)]
        violations += stuck_in_flight(rows, read_at_ms)
        call_bound_ms = int((CALLOUT_TIMEOUT_S + ROUTE_TIMEOUT_S + 1.0) * 1000)
        owners = row_owners(stack.history, rows)
        denied_keys = {(r.permit_id, r.key) for r in stack.history.calls if r.code == "gateway_unavailable"}
        given_up = frozenset(a for a, owner in owners.items() if owner in denied_keys)
        uncertain, unexplained = explain_uncertain(rows, nemesis.windows, call_bound_ms, t0_wall_ms, given_up)
        violations += unexplained
        rss, rss_violations = rss_flat(sampler.samples, ["envoy", *(r.name for r in stack.ledgers)],
                                       min_life(seconds))
        violations += rss_violations

        calls = [r for r in stack.history.calls if r.phase == "load"]
        faults_by_kind = {k: {"count": 0, "seconds": 0.0} for k in KINDS}
        for w in nemesis.windows:
            faults_by_kind[w.kind]["count"] += 1
            faults_by_kind[w.kind]["seconds"] += (w.end or w.start) - w.start
        outcomes = Counter(r.outcome if r.outcome != "denied" else f"denied:{r.code}" for r in calls)
        outcomes["ok (of which replays)"] = sum(1 for r in calls if r.outcome == "ok" and r.replayed)
        outcomes["unknown (of which the client hung up)"] = sum(1 for r in calls if r.error == "the client hung up")
        doc = {
            "seed": seed, "seconds": seconds, "load_from_s": started - t0, "rate": rate,
            "wall_seconds": time.monotonic() - wall_started,
            "slow_disk": slow_disk, "calls": len(calls), "calls_per_second": len(calls) / seconds,
            "probes": len(probes), "permits": len(stack.permits),
            "faults_by_kind": faults_by_kind,
            "faults": [{"kind": w.kind, "start_s": round(w.start - t0, 1),
                        "end_s": round((w.end or w.start) - t0, 1), **w.detail} for w in nemesis.windows],
            "outcomes": dict(sorted(outcomes.items())),
            "attempt_states": dict(sorted(Counter(r["state"] for r in rows if r["permit_id"] in permit_ids).items())),
            "uncertain": uncertain, "sweep_lateness": sweep_lateness(rows),
            "executions": len(stack.upstream.snapshot()),
            "rss": rss, "rss_rule": {"min_span_s": min_life(seconds)},
            "settings": {"lease_s": LEASE_S, "callout_timeout_s": CALLOUT_TIMEOUT_S,
                         "route_timeout_s": ROUTE_TIMEOUT_S, "agents": AGENTS, "caps": CAPS, "rotate_s": ROTATE_S},
            "violations": violations, "harness_errors": harness_errors,
        }
        report_mod.write(out, doc, sampler.samples, calls, nemesis.windows, t0)
        log(f"{len(calls)} calls, faults {({k: v['count'] for k, v in faults_by_kind.items()})}, "
            f"outcomes {doc['outcomes']}")
        log(f"violations: {len(violations)}; harness errors: {len(harness_errors)}; report: {out / 'report.md'}, "
            f"plot: {out / 'rss.png'}")
        for v in violations[:30]:
            log(f"VIOLATION: {v}")
        for e in harness_errors[:10]:
            log(f"HARNESS ERROR: {e}")
        if harness_errors:
            return 2
        return 1 if violations else 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # noqa: BLE001 - the harness failed: no verdict
        traceback.print_exc()
        status = 2
    sys.exit(status)
