"""The soak's workload: agents making governed `tools/call`s at a pod's rate.

Each agent calls at random times (exponential gaps; together `rate` calls per second) and
moves as an agent does: mostly new keys; sometimes the same key again (a retry of an earlier
call, same tool and arguments); right after a call that ended without a usable answer (a
reset, a timeout, `gateway_unavailable`, `idempotency_in_progress`) often the same key at
once. Calls go under free permits and under a capped permit that changes every `rotate_s`
seconds (a new task, a new permit): its small per-tool caps fill up, so denials happen all
along. While the nemesis says so, a share of the calls is made by clients that hang up
mid-call.
"""

from __future__ import annotations

import collections
import random
import threading
import time
import uuid

from tests.faults.fault_stack import new_key
from tests.soak.stack import CALLOUT_TIMEOUT_S, ROUTE_TIMEOUT_S, SoakStack
from tests.support.history import CallRecord, Permit
from tests.support.mcp_raw import OpenCall

TOOLS = ("pay", "ship", "echo")
TOOL_WEIGHTS = (0.4, 0.4, 0.2)
CAPS = {"pay": 30, "ship": 60}
CAPPED_SHARE = 0.4
RETRY_SHARE = 0.25
RETRY_AFTER_FAILURE = 0.6
# A client waits this long for an answer: the callout and the route, and a margin.
CALL_TIMEOUT_S = CALLOUT_TIMEOUT_S + ROUTE_TIMEOUT_S + 2.0
RETRY_CODES = {"gateway_unavailable", "idempotency_in_progress"}


class Load:
    def __init__(self, stack: SoakStack, seed: int, rate: float, agents: int, free: list[Permit],
                 capped: list[Permit], rotate_s: float):
        self.stack = stack
        self.seed = seed
        self.rate = rate
        self.agents = agents
        self.free = free
        self.capped = capped
        self.rotate_s = rotate_s
        self.hangup_share = 0.0
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.started = time.monotonic()
        self.threads = [threading.Thread(target=self._agent, args=(i,), daemon=True, name=f"agent-{i}")
                        for i in range(agents)]

    def set_hangup_share(self, share: float) -> None:
        self.hangup_share = share

    def start(self) -> None:
        self.started = time.monotonic()
        for t in self.threads:
            t.start()

    def finish(self, within: float = 30.0) -> bool:
        """Stops the agents; True when every one has returned within `within` seconds."""
        self.stop.set()
        deadline = time.monotonic() + within
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0.1))
        return not any(t.is_alive() for t in self.threads)

    def capped_now(self) -> Permit:
        return self.capped[min(int((time.monotonic() - self.started) / self.rotate_s), len(self.capped) - 1)]

    def _agent(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        mine: collections.deque = collections.deque(maxlen=50)
        again = None
        next_at = time.monotonic()
        while not self.stop.is_set():
            next_at += rng.expovariate(self.rate / self.agents)
            now = time.monotonic()
            if next_at > now:
                self.stop.wait(next_at - now)
            else:
                next_at = max(next_at, now - 1.0)  # behind: catch up a little, never in a burst
            if self.stop.is_set():
                return
            if again is not None and rng.random() < RETRY_AFTER_FAILURE:
                call = again
            elif mine and rng.random() < RETRY_SHARE:
                call = rng.choice(list(mine)[-20:])
            else:
                permit = self.capped_now() if rng.random() < CAPPED_SHARE else rng.choice(self.free)
                tool = rng.choices(TOOLS, TOOL_WEIGHTS)[0]
                key = new_key()
                call = (permit, tool, {"ref": key[-8:], "amount": rng.randint(1, 9)}, key)
                mine.append(call)
            again = None
            try:
                if rng.random() < self.hangup_share:
                    self._hang_up(rng, *call)
                    continue
                r = self.stack.call(*call, timeout=CALL_TIMEOUT_S)
                if r.outcome == "unknown" or r.code in RETRY_CODES:
                    again = call
            except Exception as e:  # noqa: BLE001 - a harness error, reported; the agent goes on
                self.errors.append(f"agent {i}: {type(e).__name__}: {e}")

    def _hang_up(self, rng: random.Random, permit: Permit, tool: str, args: dict, key: str) -> None:
        """A client that sends the call and leaves before the answer: at once, while the ledger
        decides, or while the tool runs. Recorded as an unknown outcome."""
        started = time.monotonic()
        rpc_id = f"call-{uuid.uuid4().hex}"  # the upstream's record of it names this call
        error = "the client hung up"
        try:
            call = OpenCall(self.stack.url, tool, args, permit.token, key, request_id=rpc_id)
            self.stop.wait(rng.uniform(0.0, 0.3))
            call.hang_up()
        except OSError as e:  # the gateway could not be reached, or closed first
            error = repr(e)
        self.stack.history.add(CallRecord(permit_id=permit.id, key=key, tool=tool, arguments=args, phase="load",
                                          outcome="unknown", error=error, started=started, ended=time.monotonic(),
                                          rpc_id=rpc_id))
