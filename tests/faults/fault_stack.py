"""The fault suite: real ledger, real Envoy with the filter, a recording upstream, and
fault-injecting TCP proxies in front of the ledger and the upstream.

Each scenario builds its own small stack (`fault_stack`), so a fault never leaks into the
next scenario. The ledger runs with a short lease (2 s) and a fast sweeper (200 ms); the
filter's callout timeout is 500 ms; the MCP route times out after 3 s.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.history import (History, Permit, acked_completions, assert_invariants, check,  # noqa: E402
                                  row_owners, sqlite_rows, wait_settled)
from tests.support.fault_proxy import FaultProxy  # noqa: E402
from tests.support.recording_upstream import RecordingUpstream  # noqa: E402
from tests.support.stack import Envoy, Ledger  # noqa: E402

UPSTREAM_SECRET = "faults-upstream-secret-0123456789"
LEASE = "2s"
SWEEP = "200ms"
CALLOUT_TIMEOUT_MS = 500
ROUTE_TIMEOUT = "3s"

# Everything secret the suite used, for the log scan at the end (test_zz_security.py).
SECRETS: dict[str, set[str]] = {"token": set(), "key": set(), "receipt": set()}
HISTORIES: list[History] = []
# The histories each fault scenario (a test using the `fault_stack` fixture, by node id)
# built, for `test_every_history_was_checked`.
SCENARIOS: dict[str, list[History]] = {}


def set_route_timeout(envoy: Envoy, timeout: str) -> None:
    """Rewrites the MCP POST route's timeout in the config Envoy is about to load."""
    config = yaml.safe_load(envoy.config_path.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        if route["route"].get("timeout") != "0s":
            route["route"]["timeout"] = timeout
    envoy.config_path.write_text(yaml.safe_dump(config))


class FaultStack:
    """ledger ← ledger_proxy ← Envoy(filter) → upstream_proxy → recording upstream."""

    def __init__(self, name: str, log_dir: Path, data_root: Path, ledger_args: list[str] | None = None,
                 plugin: dict | None = None, route_timeout: str = ROUTE_TIMEOUT, data_dir: Path | None = None):
        self.name = name
        self.log_dir = log_dir
        self.data_dir = data_dir or (data_root / f"{name}-{uuid.uuid4().hex[:6]}")
        self.ledger = Ledger(log_dir, self.data_dir, name=f"ledger-{name}",
                             extra_args=["--lease", LEASE, "--sweep-interval", SWEEP, *(ledger_args or [])])
        self.upstream = RecordingUpstream()
        self.upstream_proxy = FaultProxy(self.upstream.port, name=f"up-{name}")
        self.ledger_proxy = FaultProxy(self.ledger.port, name=f"ledger-{name}")
        overrides = {
            "ledger": {"service_token": self.ledger.service_token, "timeout_ms": CALLOUT_TIMEOUT_MS},
            "upstream_key": {"mode": "hmac", "secret": UPSTREAM_SECRET},
            "report_interval_ms": 100,
            **(plugin or {}),
        }
        self.plugin_overrides = overrides
        self.route_timeout = route_timeout
        self.envoy = self.new_envoy()
        self.history = History(name)
        HISTORIES.append(self.history)
        self.permits: list[Permit] = []
        # How the checker reads the store's attempt rows: the embedded store's file by
        # default; a PostgreSQL scenario points it at its schema.
        self.read_rows = lambda: sqlite_rows(self.data_dir)

    def new_envoy(self, name: str | None = None) -> Envoy:
        envoy = Envoy(self.log_dir, self.upstream_proxy.port, [self.ledger_proxy.port],
                      plugin_overrides=self.plugin_overrides, name=name or f"envoy-{self.name}")
        set_route_timeout(envoy, self.route_timeout)
        return envoy

    def start(self, ledger: bool = True) -> "FaultStack":
        self.upstream.start()
        self.upstream_proxy.start()
        self.ledger_proxy.start()
        if ledger:
            self.ledger.start()
        self.envoy.start(wait_for_ledger=ledger)
        if ledger:
            self.warm()
        return self

    def warm(self, within: float = 15.0) -> None:
        """Right after Envoy says ready, a callout can still fail (seen: `InternalFailure`,
        denied gateway_unavailable: fail closed). Calls until both workers pass governed calls:
        four in a row, and every worker's callout connection open (its TLS handshake done), so a
        scenario that holds the ledger's traffic later holds requests, not a handshake."""
        permit = self.permit()
        deadline = time.monotonic() + within
        streak = 0
        while streak < 4 or not self.callout_connections_open():
            r = self.call(permit, "echo", {"warm": True}, phase="warmup")
            streak = streak + 1 if r.outcome == "ok" else 0
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway did not pass governed calls within {within}s: {r}")
            if streak == 0:
                time.sleep(0.1)

    def callout_connections_open(self) -> bool:
        """Every Envoy worker holds a connection to the ledger and no callout waits for one: the
        TLS handshakes are done. A scenario that then holds or delays the ledger's traffic holds
        requests; a handshake held instead would keep every request from the ledger."""
        stats = self.envoy.stats()
        return (stats.get("cluster.atmost_ledger.upstream_cx_active", 0) >= self.envoy.concurrency
                and stats.get("cluster.atmost_ledger.upstream_rq_pending_active", 0) == 0)

    def stop(self) -> None:
        for stop in (self.envoy.stop, self.ledger.stop, self.upstream_proxy.stop, self.ledger_proxy.stop,
                     self.upstream.stop):
            try:
                stop()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass

    @property
    def url(self) -> str:
        return self.envoy.url

    def permit(self, caps: dict[str, int] | None = None, *extra: str) -> Permit:
        args = []
        for tool, n in (caps or {}).items():
            args += ["--max-calls", f"{tool}={n}"]
        created = self.ledger.create_permit(*args, *extra, label=f"{self.name}-{uuid.uuid4().hex[:6]}")
        SECRETS["token"].add(created["token"])
        p = Permit(id=created["id"], token=created["token"], caps=dict(caps or {}))
        self.permits.append(p)
        return p

    def call(self, permit: Permit, tool: str, arguments: dict | None = None, key: str | None = None,
             phase: str = "load", timeout: float = 10.0):
        key = key if key is not None else new_key()
        SECRETS["key"].add(key)
        record = self.history.call(self.url, permit, tool, arguments or {"ref": key[-8:]}, key, phase, timeout)
        if record.text:
            SECRETS["receipt"].add(record.text)
        return record


    def probe_all(self, rows: list[dict] | None = None, workers: int = 1) -> list:
        """After recovery: calls every key that was ever let through (ok or unknown) once
        more, and with `rows` every key that holds an attempt in them (a reservation whose
        answer was lost was denied to its client, yet it is the key's state). `workers`
        probes at once (each key by one of them)."""
        owners = set(row_owners(self.history, rows).values()) if rows is not None else set()
        seen, targets = set(), []
        by_id = {p.id: p for p in self.permits}
        for r in list(self.history.calls):
            k = (r.permit_id, r.key)
            if r.key and (r.outcome in ("ok", "unknown") or k in owners) and k not in seen:
                seen.add(k)
                targets.append(r)

        def probe(r):
            deadline = time.monotonic() + 5
            while True:  # a connection Envoy has not yet seen die may fail once: same key, try again
                answer = self.call(by_id[r.permit_id], r.tool, r.arguments, r.key, phase="probe")
                if answer.code != "gateway_unavailable" or time.monotonic() > deadline:
                    return answer
                time.sleep(0.2)

        if workers <= 1:
            return [probe(r) for r in targets]
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(probe, targets))

    def rows(self) -> list[dict]:
        return self.read_rows()

    def attempts_of(self, permit: Permit, state: str | None = None) -> list[dict]:
        return [r for r in self.rows() if r["permit_id"] == permit.id and (state is None or r["state"] == state)]

    def verify(self, settle: float = 15.0, **kwargs) -> list[dict]:
        """Waits for in_flight attempts to settle, then checks every invariant over the
        history, the upstream's executions, the store's rows and the ledger's log."""
        rows = wait_settled(self.rows, {p.id for p in self.permits}, settle)
        acked = acked_completions([self.ledger.log_path])
        assert_invariants(self.history, self.upstream.snapshot(), self.permits, UPSTREAM_SECRET,
                          store_rows=rows, acked=acked, **kwargs)
        return rows

    def check_calls(self) -> list[str]:
        """The per-call invariants alone (no store view): what the `fault_stack` fixture runs
        at the end of a scenario that did not call `verify`."""
        return check(self.history, self.upstream.snapshot(), self.permits, UPSTREAM_SECRET)


def new_key() -> str:
    return f"fk-{uuid.uuid4().hex}"


