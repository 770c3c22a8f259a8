"""The soak's stack: two ledger replicas on a PostgreSQL primary and synchronous standby, one
Envoy in front of both, a recording upstream.

    client → Envoy(filter) → upstream proxy → recording upstream
                ↓ (atmost_ledger cluster: both replicas, health-checked)
         ledger proxy 1 → ledger-1 → store proxies 1a, 1b ─┐
         ledger proxy 2 → ledger-2 → store proxies 2a, 2b ─┴→ PostgreSQL a (primary) ⇄ b (standby)

Every arrow marked proxy is a FaultProxy (tests/support/fault_proxy.py), so a fault can cut,
hold or delay one link and nothing else. Each replica reaches PostgreSQL through proxies of
its own, one per server, in one URL with `target_session_attrs=read-write`, so it follows a
failover as it would in production. Calls, warm-up and the probes after recovery are
FaultStack's (tests/faults/fault_stack.py); what differs is the topology, permit creation
(either replica's admin API) and Envoy's hot restart.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import time
import uuid
from pathlib import Path

from tests.faults.fault_stack import SECRETS, UPSTREAM_SECRET, FaultStack, set_route_timeout
from tests.support.fault_proxy import FaultProxy
from tests.support.history import History, Permit, pg_rows
from tests.support.pg_pair import DATABASE, PgPair
from tests.support.recording_upstream import RecordingUpstream
from tests.support.stack import Envoy, Ledger, http_get, wait_until

SCHEMA = "atmost_soak"
# Longer than the callout timeout plus the route's (the contract's rule, docs/design.md
# "Attempt states"), so no call still running is recorded uncertain by its lease.
LEASE_S = 6.0
ROUTE_TIMEOUT_S = 3.0
CALLOUT_TIMEOUT_S = 1.0  # the shipped config's ledger.timeout_ms
# A whole store operation is given the connect timeout plus twice the statement timeout.
PG_TIMEOUTS = ["--pg-connect-timeout", "2s", "--pg-statement-timeout", "2s", "--pg-pool-size", "8"]
# How long each tool runs at the upstream (echo: at once).
TOOL_DELAYS_S = {"pay": 0.06, "ship": 0.02, "echo": 0.0}
# Hot restart: how long the old epoch drains its listeners, and when the new one ends it.
DRAIN_TIME_S = 3
PARENT_SHUTDOWN_S = 6


class SoakStack(FaultStack):
    """Not FaultStack's topology (one SQLite ledger): its own, with FaultStack's calls."""

    def __init__(self, log_dir: Path, data_root: Path, pair: PgPair, permit_hours: int):
        self.name = "soak"
        self.log_dir = log_dir
        self.data_dir = data_root
        self.pair = pair
        self.permit_hours = permit_hours
        self.upstream = RecordingUpstream()
        self.upstream_proxy = FaultProxy(self.upstream.port, name="up-soak")
        self.ledgers: list[Ledger] = []
        self.ledger_proxies: list[FaultProxy] = []
        # Per replica, its proxies to PostgreSQL a and b.
        self.store_proxies: list[list[FaultProxy]] = []
        for i in (1, 2):
            proxies = [FaultProxy(node.port, name=f"pg-{node.name}-ledger-{i}") for node in (pair.a, pair.b)]
            hosts = ",".join(f"127.0.0.1:{p.port}" for p in proxies)
            store = f"postgres://postgres@{hosts}/{DATABASE}?target_session_attrs=read-write"
            ledger = Ledger(log_dir, data_root / f"ledger-{i}", name=f"ledger-{i}",
                            extra_args=["--lease", f"{LEASE_S:g}s", "--sweep-interval", "200ms", "--pg-schema", SCHEMA,
                                        *PG_TIMEOUTS])
            ledger.env["ATMOST_STORE"] = store  # the URL stays out of argv
            self.ledgers.append(ledger)
            self.store_proxies.append(proxies)
            self.ledger_proxies.append(FaultProxy(ledger.port, name=f"ledger-{i}"))
        self.ledger = self.ledgers[0]
        self.plugin_overrides = {
            "ledger": {"service_token": self.ledger.service_token, "timeout_ms": int(CALLOUT_TIMEOUT_S * 1000)},
            "upstream_key": {"mode": "hmac", "secret": UPSTREAM_SECRET},
            "report_interval_ms": 100,
        }
        self.route_timeout = f"{ROUTE_TIMEOUT_S:g}s"
        self.epoch = 0
        self.base_id_path = data_root / "envoy-base-id"
        self.envoy = self.new_envoy()
        self.retired_envoys: list[Envoy] = []
        self.history = History("soak")
        self.permits: list[Permit] = []
        self.read_rows = lambda: pg_rows(self.pair.primary.url, SCHEMA)
        # Processes restarted mid-run are started from this one thread, which lives as long as
        # the stack: Envoy dies with the thread that started it (seen: an epoch started from
        # the nemesis's thread got SIGTERM when that thread ended).
        self.launcher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher")

    def launch(self, start) -> None:
        """Runs a process's `start` on the launcher thread; returns when it has returned."""
        self.launcher.submit(start).result(timeout=120)

    def new_envoy(self, name: str | None = None) -> Envoy:
        envoy = Envoy(self.log_dir, self.upstream_proxy.port, [p.port for p in self.ledger_proxies],
                      plugin_overrides=self.plugin_overrides, name=name or "envoy-epoch-0")
        set_route_timeout(envoy, self.route_timeout)
        envoy.argv += ["--base-id-path", str(self.base_id_path), "--drain-time-s", str(DRAIN_TIME_S),
                       "--parent-shutdown-time-s", str(PARENT_SHUTDOWN_S)]
        return envoy

    def start(self, ledger: bool = True) -> "SoakStack":
        self.upstream.start()
        self.upstream_behaves()
        self.upstream_proxy.start()
        for proxy in [*self.ledger_proxies, *(p for ps in self.store_proxies for p in ps)]:
            proxy.start()
        for replica in self.ledgers:
            self.launch(replica.start)
        self.launch(self.envoy.start)
        self.warm()
        return self

    def upstream_behaves(self, action: str = "answer") -> None:
        """Every tool runs for its TOOL_DELAYS_S, then `action` (RecordingUpstream.behave)."""
        for tool, delay in TOOL_DELAYS_S.items():
            self.upstream.behave(tool, delay=delay, action=action)

    def hot_restart(self) -> None:
        """Starts Envoy's next epoch on the same config and ports (`--restart-epoch`): it takes
        the listeners over, the old epoch drains them for DRAIN_TIME_S and is ended after
        PARENT_SHUTDOWN_S. Returns once the new epoch is live, sees both ledgers healthy, and
        the old one has exited."""
        old = self.envoy
        self.epoch += 1
        base_id = self.base_id_path.read_text().strip()
        new = Envoy.__new__(Envoy)
        new.__dict__.update(old.__dict__)
        new.name = f"envoy-epoch-{self.epoch}"
        new.log_path = self.log_dir / f"{new.name}.log"
        new.proc = None
        argv = [a for a in old.argv if a != "--use-dynamic-base-id"]
        for flag in ("--base-id-path", "--base-id", "--restart-epoch"):
            if flag in argv:
                at = argv.index(flag)
                del argv[at:at + 2]
        new.argv = [*argv, "--base-id", base_id, "--restart-epoch", str(self.epoch)]
        # Process.start, not Envoy.start: the old epoch answers the admin port until the new
        # one takes it over, so readiness is read from the new epoch's own server_info.
        self.launch(lambda: super(Envoy, new).start())
        self.retired_envoys.append(old)

        def live() -> bool:
            if not new.alive():
                raise RuntimeError(f"Envoy epoch {self.epoch} exited:\n{new.log_text()[-3000:]}")
            info = json.loads(http_get(new.admin_url + "/server_info")[1])
            return info["command_line_options"]["restart_epoch"] == self.epoch and info["state"] == "LIVE"

        wait_until(live, 30, f"Envoy epoch {self.epoch} live")
        self.envoy = new
        wait_until(new.ledgers_healthy, 30, f"both ledgers healthy in Envoy epoch {self.epoch}")
        try:
            wait_until(lambda: not old.alive(), PARENT_SHUTDOWN_S + 20, f"Envoy epoch {self.epoch - 1} to exit")
        finally:
            old.stop()

    def healthy(self) -> bool:
        """Every replica answers ready and Envoy sees both healthy."""
        return all(r.alive() and r._ready() for r in self.ledgers) and self.envoy.ledgers_healthy()

    def permit(self, caps: dict[str, int] | None = None, *extra: str) -> Permit:
        """A permit made through whichever replica answers (each is tried, twice at most)."""
        args = ["permit", "create", "--label", f"soak-{uuid.uuid4().hex[:6]}", "--expires", f"{self.permit_hours}h"]
        for tool, n in (caps or {}).items():
            args += ["--max-calls", f"{tool}={n}"]
        last: Exception | None = None
        for replica in [*self.ledgers, *self.ledgers]:
            try:
                created = replica.cli_json(*args, *extra)
                break
            except Exception as e:  # noqa: BLE001 - the other replica may answer
                last = e
                time.sleep(0.5)
        else:
            raise RuntimeError(f"no replica created a permit: {last}")
        SECRETS["token"].add(created["token"])
        p = Permit(id=created["id"], token=created["token"], caps=dict(caps or {}))
        self.permits.append(p)
        return p

    def ledger_logs(self) -> list[Path]:
        return [r.log_path for r in self.ledgers]

    def stop(self) -> None:
        for envoy in [self.envoy, *self.retired_envoys]:
            try:
                envoy.stop()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        shutil.rmtree(self.envoy.config_path.parent, ignore_errors=True)
        stops = [r.stop for r in self.ledgers] + [self.upstream_proxy.stop] + [p.stop for p in self.ledger_proxies]
        stops += [p.stop for ps in self.store_proxies for p in ps] + [self.upstream.stop]
        for stop in stops:
            try:
                stop()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.launcher.shutdown(wait=False, cancel_futures=True)
