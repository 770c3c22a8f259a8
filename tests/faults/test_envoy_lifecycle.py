"""Envoy reloads its listener (LDS from a watched file) or drains while a call waits on the
ledger.

The ledger is held (its proxy forwards nothing towards it), so the call's callout is
pending; the reload or the drain is then observed complete in Envoy's admin stats while the
callout is still pending and the ledger has not seen the request. Only then does the ledger
get it. The call finishes where it started (the old filter chain, the draining listener),
whose connection Envoy closes after the answer (a drain close), and it is decided once by
the ledger and executed once by the upstream. The new listener is governed from its first
request.
"""

from __future__ import annotations

import os
import re
import threading
import urllib.request

import pytest
import yaml

from scripts.atmost_stack import TEST_SERVICE_TOKEN
from tests.faults.fault_stack import UPSTREAM_SECRET, new_key
from tests.support.history import Permit, key_hash, upstream_key
from tests.faults.test_ledger_faults import LOAD_CODES
from tests.support.mcp_raw import RawMcp
from tests.support.stack import wait_until

# The callout waits on the held ledger as long as the test needs, far below this.
PATIENT_CALLOUT_MS = 30000
DRAIN_CLOSE = "http.mcp.downstream_cx_drain_close"


def to_lds(envoy, lds_dir) -> None:
    """Moves Envoy's listener into a filesystem-watched LDS file."""
    config = yaml.safe_load(envoy.config_path.read_text())
    listener = config["static_resources"].pop("listeners")[0]
    config["node"] = {"id": "atmost-faults", "cluster": "atmost-faults"}
    config["dynamic_resources"] = {"lds_config": {
        "resource_api_version": "V3",
        "path_config_source": {"path": str(lds_dir / "lds.yaml"), "watched_directory": {"path": str(lds_dir)}}}}
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "atmost_ledger":
            # While the ledger is held its health checks time out too: they must not take it
            # out of the cluster meanwhile.
            cluster["health_checks"][0]["unhealthy_threshold"] = 1000
    envoy.config_path.write_text(yaml.safe_dump(config))
    write_lds(lds_dir, listener)
    envoy.lds_listener = listener


def write_lds(lds_dir, listener) -> None:
    listener = {"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", **listener}
    tmp = lds_dir / "lds.yaml.tmp"
    tmp.write_text(yaml.safe_dump({"resources": [listener]}))
    os.rename(tmp, lds_dir / "lds.yaml")


def authorizations(ledger) -> float:
    """Every authorize the ledger answered (the sum of `atmost_authorize_total`)."""
    return sum(float(v) for v in re.findall(r"^atmost_authorize_total\{[^}]*\} (\S+)$", ledger.metrics(), re.M))


@pytest.fixture
def lds_stack(fault_stack, tmp_path):
    s = fault_stack(plugin={"ledger": {"service_token": TEST_SERVICE_TOKEN, "timeout_ms": PATIENT_CALLOUT_MS}},
                    route_timeout="40s")
    s.envoy.stop()
    s.envoy = s.new_envoy(f"envoy-{s.name}-lds")
    # A draining listener or filter chain closes each connection after its next response at
    # once (not gradually over the drain time), so the drain shows in the stats.
    s.envoy.argv += ["--drain-strategy", "immediate"]
    to_lds(s.envoy, tmp_path)
    s.envoy.start()
    s.warm()
    s.lds_dir = tmp_path
    return s


class HeldCall:
    """One governed call made while the ledger is held; returns once its callout is pending."""

    def __init__(self, s, permit: Permit, args: dict):
        self.s, self.permit, self.args, self.key = s, permit, args, new_key()
        self.results: list = []
        self.authorized_before = authorizations(s.ledger)
        held_before = s.ledger_proxy.held_count()
        s.ledger_proxy.set_mode("hold")
        self.thread = threading.Thread(target=self._call, daemon=True)
        self.thread.start()
        wait_until(lambda: s.ledger_proxy.held_count() > held_before
                   and s.envoy.stat("cluster.atmost_ledger.upstream_rq_active") >= 1, 10,
                   "the call's callout to be pending at the held ledger")

    def _call(self) -> None:
        self.results.append(self.s.call(self.permit, "pay", self.args, self.key, timeout=45))

    def assert_pending(self) -> None:
        """The client has no answer, Envoy still waits on the callout, the ledger saw nothing."""
        assert self.thread.is_alive() and not self.results, self.results
        active = self.s.envoy.stat("cluster.atmost_ledger.upstream_rq_active")
        assert active == 1, f"{active} callouts pending for one call"
        assert authorizations(self.s.ledger) == self.authorized_before

    def finish(self, drain_closes: int) -> None:
        """Lets the ledger have the request. The call is answered where it started, whose
        connection the drain then closes (`drain_closes` counted by then); it is decided once
        by the ledger, executed once by the upstream and answered with that execution. A new
        call afterwards is governed and runs."""
        s = self.s
        s.ledger_proxy.set_mode("pass")
        self.thread.join(50)
        assert not self.thread.is_alive(), "the held call never finished"
        [r] = self.results
        assert s.envoy.stat(DRAIN_CLOSE) == drain_closes
        assert (r.outcome, r.replayed) == ("ok", False), r
        assert authorizations(s.ledger) - self.authorized_before == 1
        [row] = [a for a in s.attempts_of(self.permit) if a["key_hash"] == key_hash(self.key)]
        assert row["state"] == "completed", row
        forwarded = upstream_key(UPSTREAM_SECRET, self.permit.id, self.key)
        [execution] = [e for e in s.upstream.snapshot() if e["upstream_key"] == forwarded]
        assert execution["arguments"] == self.args
        assert f"nonce={execution['nonce']}" in r.text
        assert s.upstream.count("pay") == 1
        after = s.call(self.permit, "pay", {"invoice": "after", "amount": 1})
        assert after.outcome == "ok", after
        assert s.upstream.count("pay") == 2
        s.probe_all()


def test_listener_reload_lands_while_a_callout_is_pending(lds_stack):
    s = lds_stack
    p = s.permit({"pay": 2})
    before = s.envoy.stats()
    held = HeldCall(s, p, {"invoice": "reload", "amount": 2})
    # A new version of the listener: another stat prefix, so a new filter chain takes new
    # connections and the old one drains, still holding the call.
    listener = s.envoy.lds_listener
    listener["filter_chains"][0]["filters"][0]["typed_config"]["stat_prefix"] = "mcp_reloaded"
    write_lds(s.lds_dir, listener)

    def reloaded() -> bool:
        stats = s.envoy.stats()
        return (stats.get("listener_manager.lds.update_success", 0) > before["listener_manager.lds.update_success"]
                and stats.get("listener_manager.total_filter_chains_draining", 0) == 1)

    wait_until(reloaded, 10, "the reload to land: LDS updated, the old filter chain draining")
    # The new listener is governed from its first request, while the old one holds the call.
    no_permit = s.history.call(s.url, Permit(p.id, "", {}), "pay", {"x": 1}, new_key())
    assert (no_permit.outcome, no_permit.code) == ("denied", "permit_invalid"), no_permit
    assert s.envoy.stat("http.mcp_reloaded.downstream_rq_completed") == 1
    held.assert_pending()

    # Answered on the old filter chain, which then closed the connection: its drain.
    held.finish(drain_closes=before.get(DRAIN_CLOSE, 0) + 1)
    s.verify(allowed_codes=LOAD_CODES | {"permit_invalid"})


def test_drain_lands_while_a_callout_is_pending(lds_stack):
    s = lds_stack
    p = s.permit({"pay": 2})
    drained_before = s.envoy.stat(DRAIN_CLOSE)
    held = HeldCall(s, p, {"invoice": "drain", "amount": 2})
    req = urllib.request.Request(s.envoy.admin_url + "/drain_listeners?graceful", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200

    def drain_in_effect() -> bool:
        """A request that needs no ledger (tools/list) is answered, and its connection is
        closed by the drain."""
        client = RawMcp(s.url, timeout=5)
        try:
            listed = client.post({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}})
        finally:
            client.close()
        return listed.status_code == 200 and s.envoy.stat(DRAIN_CLOSE) > drained_before

    wait_until(drain_in_effect, 10, "the drain to land")
    drained = s.envoy.stat(DRAIN_CLOSE)
    held.assert_pending()

    # The call's own connection was closed by the drain after its answer. (A graceful drain
    # still takes new connections until the drain time ends: the next call is governed.)
    held.finish(drain_closes=drained + 1)
    s.verify(allowed_codes=LOAD_CODES)
