"""The soak's nemesis: at random times, a fault picked at random, held for a random while, then
healed. Each injected fault is a window (kind, start, end, what exactly was done).

The kinds are one table (KINDS): how each is injected, and which ways of turning an attempt
`uncertain` it can cause — the checker accepts an `uncertain` attempt only when a fault of a
kind that can cause its reason was active during the attempt's life (verdicts.py). The
reasons: `lease` (the sweeper's `lease_expired`: the ledger never heard how the call ended)
and the Envoy response flags of the filter's own report (`DC` the client went away, `UC`/`UR`
the upstream's connection or stream was cut; docs/design.md, "What `on_log` tells").

Kinds are drawn from a shuffled deck (every kind once, in random order, then a new deck), so a
short run still meets each. A process is restarted (kill -9 of a ledger, Envoy's hot restart)
no sooner than `min_life` after its last start, so each lives long enough for its memory to
be judged; a restart that must wait stays at the front of the deck while the other kinds are
shuffled in behind it and drawn meanwhile.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
import traceback
from typing import Callable

from tests.soak.stack import SoakStack
from tests.soak.slow_disk import SlowDisk

# How long a fault is held, and the quiet time before the next, in seconds (uniform).
HOLD_S = (3.0, 10.0)
GAP_S = (4.0, 16.0)
# No new fault this close to the end: the last one heals before the load stops.
TAIL_S = 15.0


@dataclasses.dataclass
class FaultWindow:
    kind: str
    start: float  # time.monotonic()
    start_wall_ms: int
    end: float | None = None
    end_wall_ms: int | None = None
    detail: dict = dataclasses.field(default_factory=dict)

    def close(self) -> None:
        self.end, self.end_wall_ms = time.monotonic(), int(time.time() * 1000)


@dataclasses.dataclass(frozen=True)
class Kind:
    inject: str  # the Faults method
    causes: frozenset[str]  # the uncertain reasons it can cause
    restarts: str | None = None  # "ledger" or "envoy": bound by min_life
    what: str = ""


KINDS: dict[str, Kind] = {
    "ledger_kill": Kind("ledger_kill", frozenset({"lease"}), "ledger",
                        "kill -9 of one ledger replica, restarted on the same port after a while"),
    "envoy_hot_restart": Kind("envoy_hot_restart", frozenset({"lease", "DC"}), "envoy",
                              "Envoy's next epoch (--restart-epoch) takes the listeners; the old one drains, "
                              "then exits"),
    "pg_failover": Kind("pg_failover", frozenset({"lease"}), None,
                        "kill -9 of the PostgreSQL primary, the synchronous standby promoted, the old primary "
                        "rebuilt as the new standby"),
    "store_partition": Kind("store_partition", frozenset({"lease"}), None,
                            "the link between one or both replicas and PostgreSQL stops carrying data"),
    "upstream_cut": Kind("upstream_cut", frozenset({"UC", "UR"}), None,
                         "the upstream runs the tool, then its connection is reset or closed without the answer"),
    "client_hangup": Kind("client_hangup", frozenset({"DC", "lease"}), None,
                          "half of the clients hang up mid-call, while the ledger decides or while the tool runs"),
    "slow_disk": Kind("slow_disk", frozenset({"lease"}), None,
                      "PostgreSQL's disk throttled to a few write operations per second"),
}


class Faults:
    """How each kind is injected and healed on this stack."""

    def __init__(self, stack: SoakStack, disk: SlowDisk | None, set_hangup_share: Callable[[float], None],
                 stop: threading.Event):
        self.stack = stack
        self.disk = disk
        self.set_hangup_share = set_hangup_share
        self.stop = stop
        now = time.monotonic()
        self.started = {"envoy": now, "ledger-1": now, "ledger-2": now}

    def hold(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def ledger_kill(self, rng: random.Random, w: FaultWindow, min_life: float) -> None:
        now = time.monotonic()
        eligible = [i for i, r in enumerate(self.stack.ledgers) if now - self.started[r.name] >= min_life]
        i = rng.choice(eligible)
        replica = self.stack.ledgers[i]
        down = rng.uniform(1.0, 6.0)
        w.detail.update(replica=replica.name, down_s=round(down, 1))
        replica.kill9()
        self.stack.ledger_proxies[i].cut_all()
        self.hold(down)
        self.stack.launch(replica.start)
        self.started[replica.name] = time.monotonic()

    def envoy_hot_restart(self, rng: random.Random, w: FaultWindow, min_life: float) -> None:
        w.detail.update(epoch=self.stack.epoch + 1)
        self.stack.hot_restart()
        self.started["envoy"] = time.monotonic()

    def pg_failover(self, rng: random.Random, w: FaultWindow, min_life: float) -> None:
        pair = self.stack.pair
        old = pair.primary
        new, _ = pair.fail_over()
        alone = rng.uniform(1.0, 6.0)
        w.detail.update(killed=old.name, promoted=new.name, alone_s=round(alone, 1))
        self.hold(alone)
        pair.attach_standby(old, new)

    def store_partition(self, rng: random.Random, w: FaultWindow, min_life: float) -> None:
        replicas = rng.choice([[0], [1], [0, 1]])
        # `hold`: nothing goes through until it heals, then what waited does (a partition TCP
        # outlives); `blackhole`: what was sent is lost, and at the heal every connection is
        # reset (one it does not outlive).
        mode = rng.choice(["hold", "blackhole"])
        seconds = rng.uniform(*HOLD_S)
        w.detail.update(replicas=[self.stack.ledgers[i].name for i in replicas], mode=mode, seconds=round(seconds, 1))
        proxies = [p for i in replicas for p in self.stack.store_proxies[i]]
        for p in proxies:
            p.set_mode(mode)
        try:
            self.hold(seconds)
        finally:
            for p in proxies:
                p.set_mode("pass", cut=mode == "blackhole")

    def upstream_cut(self, rng: random.Random, w: FaultWindow, min_life: float) -> None:
        # The tool runs, then its server resets the connection or closes it without an answer;
        # or the answer comes and a middlebox resets the connection instead of passing it on.
        how = rng.choice(["server_reset", "server_close", "reset_on_reply"])
        seconds = rng.uniform(*HOLD_S)
        w.detail.update(how=how, seconds=round(seconds, 1))
        if how == "reset_on_reply":
            self.stack.upstream_proxy.set_mode("reset_on_reply")
        else:
            self.stack.upstream_behaves(how.removeprefix("server_"))
        try:
            self.hold(seconds)
        finally:
            self.stack.upstream_proxy.set_mode("pass", cut=True)
            self.stack.upstream_behaves()

    def client_hangup(self, rng: random.Random, w: FaultWindow, min_life: float) -> None:
        seconds = rng.uniform(*HOLD_S)
        w.detail.update(share=0.5, seconds=round(seconds, 1))
        self.set_hangup_share(0.5)
        try:
            self.hold(seconds)
        finally:
            self.set_hangup_share(0.0)

    def slow_disk(self, rng: random.Random, w: FaultWindow, min_life: float) -> None:
        seconds = rng.uniform(*HOLD_S)
        if self.disk is not None:
            iops = rng.choice([5, 15, 40])
            w.detail.update(write_iops=iops, seconds=round(seconds, 1))
            self.disk.slow(iops)
            try:
                self.hold(seconds)
            finally:
                self.disk.heal()
            return
        # The stand-in (no throttled disk on this machine): every store link delayed.
        delay = rng.choice([0.2, 0.5, 1.0])
        w.detail.update(stand_in="store links delayed", delay_s=delay, seconds=round(seconds, 1))
        proxies = [p for ps in self.stack.store_proxies for p in ps]
        for p in proxies:
            p.set_mode("delay", delay=delay)
        try:
            self.hold(seconds)
        finally:
            for p in proxies:
                p.set_mode("pass")

    def eligible(self, kind: str, min_life: float) -> bool:
        restarts = KINDS[kind].restarts
        now = time.monotonic()
        if restarts == "envoy":
            return now - self.started["envoy"] >= min_life
        if restarts == "ledger":
            return any(now - self.started[r.name] >= min_life for r in self.stack.ledgers)
        return True


class Nemesis(threading.Thread):
    def __init__(self, faults: Faults, seed: int, end_at: float, min_life: float, log: Callable[[str], None]):
        super().__init__(daemon=True, name="nemesis")
        self.faults = faults
        self.rng = random.Random(seed)
        self.end_at = end_at
        self.min_life = min_life
        self.log = log
        self.windows: list[FaultWindow] = []
        self.errors: list[str] = []
        self.stop = faults.stop
        self._deck: list[str] = []

    def draw(self) -> str | None:
        """The first eligible kind of the deck. When none is (the restarts wait for their
        processes to age), the kinds the deck no longer holds are shuffled in behind it, so
        the other faults go on meanwhile and a waiting kind comes first once eligible."""
        if not self._deck:
            self._deck = self.rng.sample(list(KINDS), len(KINDS))
        for attempt in range(2):
            for kind in self._deck:
                if self.faults.eligible(kind, self.min_life):
                    self._deck.remove(kind)
                    return kind
            if attempt == 0:
                missing = [k for k in KINDS if k not in self._deck]
                self._deck += self.rng.sample(missing, len(missing))
        return None

    def run(self) -> None:
        while not self.stop.is_set():
            self.stop.wait(self.rng.uniform(*GAP_S))
            if self.stop.is_set() or time.monotonic() > self.end_at - TAIL_S:
                return
            kind = self.draw()
            if kind is None:
                continue
            w = FaultWindow(kind, time.monotonic(), int(time.time() * 1000))
            self.windows.append(w)
            self.log(f"fault {len(self.windows)}: {kind} ...")
            try:
                getattr(self.faults, KINDS[kind].inject)(self.rng, w, self.min_life)
            except Exception as e:  # noqa: BLE001 - reported as a harness error, the run stops
                self.errors.append(f"{kind}: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
                self.stop.set()
            finally:
                w.close()
                self.log(f"fault {len(self.windows)}: {kind} {w.detail} healed after {w.end - w.start:.1f} s")
