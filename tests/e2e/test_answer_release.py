"""`answer_release: "at_once"` end to end: real Envoy, the real ledger (embedded SQLite and
PostgreSQL), the example MCP server, and a fault proxy in front of the ledger.

The answer of a completed call goes to the client as soon as it is whole; its `completed`
report follows through the root's batch. The ledger records it shortly after; a same-key
retry in between gets `idempotency_in_progress` with `retry_after`, and one after gets the
replay. An Envoy that dies before the report lands leaves the attempt to its lease, which
turns it `uncertain`: never released, never sent again (docs/design.md#releasing-the-answer-before-its-report).

The PostgreSQL stack needs DATABASE_URL (`make test` provides it, see scripts/with-postgres);
without it that stack fails, it never skips.
"""

from __future__ import annotations

import json
import os
import threading
import uuid

import pytest

from tests.e2e.conftest import UPSTREAM_SECRET, new_key
from tests.e2e.test_replicas import drop_schema
from tests.support.fault_proxy import FaultProxy
from tests.support.mcp_raw import RawMcp, denial, denial_code, result_text
from tests.support.stack import Envoy, Ledger, wait_until

# Short, so the lease decides within the test; long enough for a call held at the proxies.
LEASE = "10s"
# The report's callout outlives the scenario: while it is held, its batch neither succeeds
# nor fails, so whatever the client got, it got before the ledger's acknowledgement.
CALLOUT_TIMEOUT_MS = 30000


class ReleaseFirstStack:
    """ledger ← ledger_proxy ← Envoy(filter, answer_release at_once) → upstream_proxy → example server."""

    # What names this stack's Envoys, and what a variant adds to their plugin configuration.
    NAME = "release"
    PLUGIN: dict = {}

    def __init__(self, log_dir, data_root, upstream_port: int, store: str, database_url: str | None):
        tag = f"{store}-{uuid.uuid4().hex[:6]}"
        self.log_dir = log_dir
        self.schema = f"atmost_release_{uuid.uuid4().hex[:10]}" if store == "postgres" else None
        self.database_url = database_url
        extra = ["--lease", LEASE, "--sweep-interval", "200ms"]
        if self.schema:
            extra += ["--pg-schema", self.schema]
        self.ledger = Ledger(log_dir, data_root / f"ledger-release-{tag}", name=f"ledger-release-{tag}",
                             extra_args=extra)
        if self.schema:
            self.ledger.env["ATMOST_STORE"] = database_url  # the URL stays out of argv
        self.ledger_proxy = FaultProxy(self.ledger.port, name=f"ledger-release-{tag}")
        self.upstream_proxy = FaultProxy(upstream_port, name=f"up-release-{tag}")
        self.tag = tag
        self.envoy = self.new_envoy()

    def new_envoy(self) -> Envoy:
        return Envoy(self.log_dir, self.upstream_proxy.port, [self.ledger_proxy.port],
                     name=f"envoy-{self.NAME}-{self.tag}-{uuid.uuid4().hex[:4]}", plugin_overrides={
                         "ledger": {"service_token": self.ledger.service_token, "timeout_ms": CALLOUT_TIMEOUT_MS},
                         "upstream_key": {"mode": "hmac", "secret": UPSTREAM_SECRET},
                         "answer_release": "at_once",
                         "report_interval_ms": 100,
                         **self.PLUGIN,
                     })

    def start(self) -> "ReleaseFirstStack":
        self.ledger_proxy.start()
        self.upstream_proxy.start()
        self.ledger.start()
        self.start_envoy()
        return self

    def start_envoy(self) -> None:
        self.envoy.start()
        # Right after Envoy says ready a callout can still fail (fail closed): call until
        # governed calls pass and every worker holds its connection to the ledger.
        permit = self.ledger.create_permit(label="warm")
        streak = 0

        def warm() -> bool:
            nonlocal streak
            client = RawMcp(self.envoy.url)  # a connection of its own: any worker may take it
            try:
                r = client.call("echo", {"text": "warm"}, permit["token"], new_key())
            finally:
                client.close()
            streak = streak + 1 if r.status_code == 200 and denial(r) is None else 0
            stats = self.envoy.stats()
            return (streak >= 4
                    and stats.get("cluster.atmost_ledger.upstream_cx_active", 0) >= self.envoy.concurrency
                    and stats.get("cluster.atmost_ledger.upstream_rq_pending_active", 0) == 0)

        wait_until(warm, 30, "the gateway to pass governed calls")

    def stop(self) -> None:
        for stop in (self.envoy.stop, self.ledger.stop, self.ledger_proxy.stop, self.upstream_proxy.stop):
            try:
                stop()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        if self.schema and self.database_url:
            drop_schema(self.database_url, self.schema)

    def attempts(self, permit: dict) -> list[dict]:
        return self.ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]

    def shown(self, attempt_id: str) -> dict:
        return self.ledger.cli_json("attempts", "show", attempt_id)["attempt"]


def started(kind: type[ReleaseFirstStack], request, log_dir, data_root, mcp_server):
    """A stack of `kind` on the store `request.param` names, stopped when its user is done."""
    url = os.environ.get("DATABASE_URL", "").strip() or None
    if request.param == "postgres" and not url:
        pytest.fail("DATABASE_URL is not set: the PostgreSQL stack never skips. "
                    "`make test` provides it (scripts/with-postgres); or export DATABASE_URL=postgres://…")
    s = kind(log_dir, data_root, mcp_server.port, request.param, url)
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(request, log_dir, data_root, mcp_server):
    yield from started(ReleaseFirstStack, request, log_dir, data_root, mcp_server)


@pytest.fixture
def release_server(mcp_server, stack):
    """The example server, counters zeroed, both proxies passing traffic."""
    mcp_server.reset()
    stack.ledger_proxy.set_mode("pass")
    stack.upstream_proxy.set_mode("pass")
    return mcp_server


def test_answers_arrive_and_the_ledger_records_each_receipt_after_them(stack, release_server):
    server = release_server
    permit = stack.ledger.create_permit(label=f"release-{uuid.uuid4().hex[:6]}")
    client = RawMcp(stack.envoy.url)
    try:
        for n in range(1, 4):
            key = new_key()
            args = {"invoice": f"inv-at-once-{n}", "amount": n}
            first = client.call("pay_invoice", args, permit["token"], key)
            assert first.status_code == 200 and denial(first) is None, first.text
            assert f"executions={n}" in result_text(first)

            # At once: the ledger may not have the report yet. Either way, never a second run.
            retry = client.call("pay_invoice", args, permit["token"], key)
            if denial_code(retry) is None:
                assert retry.headers.get("idempotent-replayed") == "true", retry.text
                assert result_text(retry) == result_text(first)
            else:
                in_progress = denial(retry)
                assert in_progress["code"] == "idempotency_in_progress", retry.text
                assert isinstance(in_progress["retry_after"], int) and in_progress["retry_after"] >= 1

            # Shortly after, the attempt is completed with its receipt.
            def completed():
                rows = [a for a in stack.attempts(permit) if a["state"] == "completed"]
                return rows if len(rows) == n else None

            wait_until(completed, 15, f"the ledger to record {n} completed calls")
            assert all(stack.shown(a["id"])["has_receipt"] for a in stack.attempts(permit))

            # The receipt is the answer the client got: the replay is it, marked, under a new id.
            replay = client.call("pay_invoice", args, permit["token"], key, request_id=f"replay-{n}")
            assert replay.headers.get("idempotent-replayed") == "true", replay.text
            replayed, original = replay.json(), first.json()
            assert replayed["id"] == f"replay-{n}"
            assert replayed["result"]["_meta"].pop("dev.atmost/replayed") is True
            for answer in (replayed, original):  # the permit's figures are each answer's own
                answer["result"].get("_meta", {}).pop("dev.atmost/permit", None)
                if answer["result"].get("_meta") == {}:
                    del answer["result"]["_meta"]
            assert replayed["result"] == original["result"]
            assert server.executions("pay_invoice") == n
    finally:
        client.close()


def test_envoy_killed_before_the_report_lands_leaves_the_attempt_to_its_lease(stack, release_server):
    server = release_server
    permit = stack.ledger.create_permit(label=f"release-kill-{uuid.uuid4().hex[:6]}")
    key = new_key()
    args = {"invoice": "inv-killed", "amount": 9}
    stats_before = stack.envoy.stats()
    answers: list = []

    def call() -> None:
        client = RawMcp(stack.envoy.url)
        try:
            answers.append(client.call("pay_invoice", args, permit["token"], key))
        finally:
            client.close()

    # The upstream's answer waits at its proxy until the ledger's side is held too.
    stack.upstream_proxy.set_mode("hold_reply")
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    wait_until(lambda: server.executions("pay_invoice") == 1, 20, "the call to run at the server")
    [attempt] = stack.attempts(permit)
    assert attempt["state"] == "in_flight", attempt
    stack.ledger_proxy.set_mode("hold")
    stack.upstream_proxy.set_mode("pass")
    caller.join(60)
    assert answers, "the client got no answer while the ledger was held"
    [answer] = answers
    assert answer.status_code == 200 and "executions=1" in result_text(answer), answer.text

    # The client has the answer; the report's batch has neither been acknowledged nor failed,
    # and the ledger still holds the attempt in flight.
    stats = stack.envoy.stats()
    for name in ("wasmcustom.atmost_report_batch_sent", "wasmcustom.atmost_report_batch_failed",
                 "wasmcustom.atmost_report_deferred"):
        assert stats.get(name, 0) == stats_before.get(name, 0), name
    assert stats.get("wasmcustom.atmost_completed", 0) == stats_before.get("wasmcustom.atmost_completed", 0) + 1
    assert stack.shown(attempt["id"])["state"] == "in_flight"

    # Envoy dies with the report: its connections are cut before the proxy lets anything on.
    stack.envoy.kill9()
    stack.ledger_proxy.cut_all()
    stack.ledger_proxy.set_mode("pass")
    left_to_its_lease(stack, server, permit, attempt["id"], args, key)


def left_to_its_lease(stack: ReleaseFirstStack, server, permit: dict, attempt_id: str, args: dict,
                      key: str) -> None:
    """With its Envoy dead and its report never delivered, the lease makes the attempt
    `uncertain`; on a new Envoy the same key is `delivery_uncertain`, never sent again, and
    the slot stays taken."""
    shown = wait_until(lambda: (a := stack.shown(attempt_id))["state"] != "in_flight" and a, 40,
                       "the lease to decide the attempt")
    assert shown["state"] == "uncertain", shown
    assert "lease_expired" in json.dumps(shown), shown
    stack.envoy = stack.new_envoy()
    stack.start_envoy()
    client = RawMcp(stack.envoy.url)
    try:
        again = client.call("pay_invoice", args, permit["token"], key)
    finally:
        client.close()
    assert denial_code(again) == "delivery_uncertain", again.text
    assert denial(again)["attempt_id"] == attempt_id
    assert server.executions("pay_invoice") == 1
    [after] = stack.attempts(permit)
    assert after["state"] == "uncertain"
