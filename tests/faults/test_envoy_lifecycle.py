"""Envoy reloads its listener (LDS from a watched file) or drains while a call waits on a
slow ledger. The call in flight finishes on the old listener — decided once, dispatched at
most once — and the new listener is governed from its first request."""

from __future__ import annotations

import os
import threading
import time

import pytest
import yaml

from tests.faults.fault_stack import new_key
from tests.faults.test_ledger_faults import LOAD_CODES
from tests.support.stack import http_get, wait_until

SLOW_LEDGER = 1.2


def to_lds(envoy, lds_dir) -> None:
    """Moves Envoy's listener into a filesystem-watched LDS file."""
    config = yaml.safe_load(envoy.config_path.read_text())
    listener = config["static_resources"].pop("listeners")[0]
    config["node"] = {"id": "atmost-faults", "cluster": "atmost-faults"}
    config["dynamic_resources"] = {"lds_config": {
        "resource_api_version": "V3",
        "path_config_source": {"path": str(lds_dir / "lds.yaml"), "watched_directory": {"path": str(lds_dir)}}}}
    envoy.config_path.write_text(yaml.safe_dump(config))
    write_lds(lds_dir, listener)
    envoy.lds_listener = listener


def write_lds(lds_dir, listener) -> None:
    listener = {"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", **listener}
    tmp = lds_dir / "lds.yaml.tmp"
    tmp.write_text(yaml.safe_dump({"resources": [listener]}))
    os.rename(tmp, lds_dir / "lds.yaml")


def slow_call(s, p, key, args, results):
    results.append(s.call(p, "pay", args, key, timeout=10))


@pytest.fixture
def lds_stack(fault_stack, tmp_path):
    # A patient filter (5 s callout timeout), so the call is still waiting when the reload lands.
    s = fault_stack(plugin={"ledger": {"service_token": "test-service-token", "timeout_ms": 5000}},
                    route_timeout="10s")
    s.envoy.stop()
    s.envoy = s.new_envoy(f"envoy-{s.name}-lds")
    to_lds(s.envoy, tmp_path)
    s.envoy.start()
    s.warm()
    s.lds_dir = tmp_path
    return s


def test_listener_reload_during_a_callout(lds_stack):
    s = lds_stack
    p = s.permit({"pay": 2})
    assert s.call(s.permit(), "ship").outcome == "ok"
    s.ledger_proxy.set_mode("delay", delay=SLOW_LEDGER)
    key, args, results = new_key(), {"invoice": "reload", "amount": 2}, []
    t = threading.Thread(target=slow_call, args=(s, p, key, args, results), daemon=True)
    t.start()
    time.sleep(0.3)
    # A new version of the listener: another stat prefix → Envoy builds a new listener and drains the old.
    before = s.envoy.stat("listener_manager.lds.update_success")
    listener = s.envoy.lds_listener
    listener["filter_chains"][0]["filters"][0]["typed_config"]["stat_prefix"] = "mcp_reloaded"
    write_lds(s.lds_dir, listener)
    wait_until(lambda: s.envoy.stat("listener_manager.lds.update_success") > before, 10, "the LDS update")
    t.join(15)
    s.ledger_proxy.set_mode("pass")
    [r] = results
    assert r.outcome in ("ok", "unknown"), r
    assert s.upstream.count("pay") <= 1
    # The reloaded listener is governed: no permit → denied; with one → decided by the ledger.
    no_permit = s.history.call(s.url, p.__class__(p.id, "", {}), "pay", {"x": 1}, new_key())
    assert (no_permit.outcome, no_permit.code) in (("denied", "permit_invalid"),), no_permit
    assert s.call(p, "pay", {"invoice": "after-reload", "amount": 1}).outcome in ("ok", "denied")
    time.sleep(0.3)
    s.probe_all()
    s.verify(allowed_codes=LOAD_CODES | {"permit_invalid"})


def test_drain_listeners_during_a_callout(lds_stack):
    s = lds_stack
    p = s.permit({"pay": 2})
    assert s.call(s.permit(), "ship").outcome == "ok"
    s.ledger_proxy.set_mode("delay", delay=SLOW_LEDGER)
    key, args, results = new_key(), {"invoice": "drain", "amount": 2}, []
    t = threading.Thread(target=slow_call, args=(s, p, key, args, results), daemon=True)
    t.start()
    time.sleep(0.3)
    import urllib.request
    req = urllib.request.Request(s.envoy.admin_url + "/drain_listeners?graceful", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
    t.join(15)
    s.ledger_proxy.set_mode("pass")
    [r] = results
    assert r.outcome in ("ok", "unknown"), r
    assert s.upstream.count("pay") <= 1
    # New calls after the drain: refused at the socket or answered — never sent unchecked.
    late = s.call(p, "pay", {"invoice": "after-drain", "amount": 1}, timeout=3)
    assert late.outcome in ("unknown", "ok", "denied"), late
    assert http_get(s.envoy.admin_url + "/ready")[0] in (200, 503)
    wait_until(lambda: not s.attempts_of(p, "in_flight"), 10, "in-flight attempts to settle")
    s.verify(allowed_codes=LOAD_CODES)
