"""The shipped monitoring (monitoring/, docs/monitoring.md) in a real Prometheus.

A real Prometheus (Debian's `prometheus`, `make prometheus-tools`: its own data directory, a
loopback port, scrapes and evaluations every second, the rules file loaded as shipped) scrapes a
real ledger (TLS, its /metrics) and a real Envoy (its admin /stats/prometheus) in front of the
example MCP server. One call goes uncertain through a cut response, and the test waits until
AtmostCallUncertain is pending, then firing, in Prometheus's own /api/v1/alerts, while no other
alert is pending or firing; it prints the timeline. Every query of the Grafana dashboard
(monitoring/grafana-dashboard.json) is then evaluated against that Prometheus.

The rules and the dashboard checked offline (promtool, their unit tests, the PrometheusRule, the
docs' alert table): tests/files/test_monitoring_rules.py.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import RawMcp, denial_code
from tests.support.monitoring import DASHBOARD, NO_DATA_EXPECTED, RULES, rule_groups
from tests.support.stack import Envoy, ExampleServer, Ledger, Process, free_port, wait_until
from tests.support.tcp_proxy import TcpProxy

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
UNCERTAIN_ALERT = "AtmostCallUncertain"
# How long the test waits for each step of the alert's timeline (its `for` is 30 s).
ALERT_WAIT_S = 120
# Template variables of the dashboard, as the test sets them: the window covers the whole run.
DASHBOARD_VARIABLES = {"$__rate_interval": "5m", "$ledger_cluster": "atmost_ledger"}


# ---------------------------------------------------------------- a real Prometheus


class Prometheus(Process):
    """Debian's Prometheus on a loopback port with a data directory of its own."""

    def __init__(self, log_dir: Path, config: dict):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="atmost-prometheus-"))
        config_path = self.dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        super().__init__("prometheus", [PROMETHEUS, f"--config.file={config_path}",
                                        f"--storage.tsdb.path={self.dir / 'data'}",
                                        f"--web.listen-address=127.0.0.1:{self.port}"], log_dir)

    def start(self) -> None:
        super().start()
        self.wait_started(self._ready, 60, f"prometheus on {self.url}")

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, *args, **kwargs) -> None:
        super().stop(*args, **kwargs)
        shutil.rmtree(self.dir, ignore_errors=True)

    def api(self, path: str, **params) -> dict | list:
        answer = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10).json()
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def alerts(self) -> dict[str, dict]:
        """Pending and firing alerts by name (one series each here)."""
        return {a["labels"]["alertname"]: a for a in self.api("alerts")["alerts"]}


@pytest.fixture(scope="module")
def scenario(log_dir, data_root):
    """The stack, Prometheus scraping it, and one call cut after the tool ran. Yields what was
    measured (the timeline, in seconds from the cut) and the Prometheus to query."""
    ledger = Ledger(log_dir, data_root / "ledger-monitoring", name="ledger-monitoring")
    server = ExampleServer(log_dir, name="mcp-server-monitoring")
    started = [ledger, server]
    proxy = None
    try:
        ledger.start()
        server.start()
        proxy = TcpProxy(server.port).start()
        envoy = Envoy(log_dir, proxy.port, [ledger.port], name="envoy-monitoring",
                      plugin_overrides={"ledger": {"service_token": ledger.service_token}})
        started.append(envoy)
        envoy.start()
        prometheus = Prometheus(log_dir, {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "atmost-ledger", "scheme": "https", "tls_config": {"ca_file": str(ledger.tls.ca)},
                 "static_configs": [{"targets": [f"127.0.0.1:{ledger.port}"]}]},
                {"job_name": "envoy", "metrics_path": "/stats/prometheus",
                 "static_configs": [{"targets": [f"127.0.0.1:{envoy.admin_port}"]}]},
            ],
        })
        started.append(prometheus)
        prometheus.start()
        yield run_scenario(ledger, server, proxy, envoy, prometheus), prometheus
    finally:
        for process in reversed(started):
            process.stop()
        if proxy is not None:
            proxy.stop()


def run_scenario(ledger: Ledger, server: ExampleServer, proxy: TcpProxy, envoy: Envoy,
                 prometheus: Prometheus) -> dict:
    # Both targets scraped, the shipped rules loaded, and their first evaluation seen before
    # anything happens: a quiet start.
    wait_until(lambda: sorted((t["labels"]["job"], t["health"]) for t in prometheus.api("targets")["activeTargets"])
               == [("atmost-ledger", "up"), ("envoy", "up")], 60, "both targets up in Prometheus")
    loaded = {g["name"]: [r["name"] for r in g["rules"]] for g in prometheus.api("rules")["groups"]}
    assert loaded == {g["name"]: [r.get("alert", r.get("record")) for r in g["rules"]] for g in rule_groups()}
    wait_until(lambda: prometheus.query("atmost:uncertain_oldest_seconds:max == 0"), 60,
               "the uncertain figure recorded as 0")
    assert prometheus.alerts() == {}

    # A permit with room (the near-limit alert stays quiet), one call that completes, one denial.
    permit = ledger.create_permit("--max-calls", "pay_invoice=10", label=f"monitoring-{uuid.uuid4().hex[:8]}")
    client = RawMcp(envoy.url)
    try:
        done = client.call("pay_invoice", {"invoice": "INV-MON-1", "amount": 3}, permit["token"], new_key())
        assert done.status_code == 200 and "error" not in done.json(), done.text
        forged = permit["token"][:-4] + ("0000" if not permit["token"].endswith("0000") else "1111")
        denied = client.call("pay_invoice", {"invoice": "INV-MON-2", "amount": 3}, forged, new_key())
        assert denial_code(denied) == "permit_invalid", denied.text

        # The cut: the tool runs, its answer never reaches the client.
        executions_before = server.executions()
        proxy.mode = "cut_response"
        try:
            lost = client.call("pay_invoice", {"invoice": "INV-MON-3", "amount": 4}, permit["token"], new_key())
        finally:
            proxy.mode = "pass"
        cut = time.monotonic()
    finally:
        client.close()
    assert lost.status_code >= 500, lost.text
    assert server.executions() == executions_before + 1

    def since_cut() -> float:
        return round(time.monotonic() - cut, 2)

    timeline: dict[str, float] = {"call cut": 0.0}
    wait_until(lambda: ledger.cli_json("attempts", "list", "--state", "uncertain", "--permit", permit["id"])["attempts"],
               ALERT_WAIT_S, "the attempt recorded uncertain", interval=0.1)
    timeline["uncertain recorded"] = since_cut()
    wait_until(lambda: prometheus.query("atmost:uncertain_oldest_seconds:max > 0"), ALERT_WAIT_S,
               "Prometheus to see the uncertain call", interval=0.1)
    timeline["Prometheus sees it"] = since_cut()

    seen: list[tuple[float, dict]] = []

    def uncertain_alert(state: str):
        alerts = prometheus.alerts()
        seen.append((since_cut(), alerts))
        a = alerts.get(UNCERTAIN_ALERT)
        return a if a and a["state"] == state else None

    pending = wait_until(lambda: uncertain_alert("pending") or uncertain_alert("firing"), ALERT_WAIT_S,
                         f"{UNCERTAIN_ALERT} pending", interval=0.1)
    timeline["alert pending"] = since_cut()
    firing = wait_until(lambda: uncertain_alert("firing"), ALERT_WAIT_S, f"{UNCERTAIN_ALERT} firing", interval=0.2)
    timeline["alert firing"] = since_cut()
    return {"timeline": timeline, "pending": pending, "firing": firing, "seen": seen, "permit": permit,
            "envoy_uncertain": envoy.stat("wasmcustom.atmost_uncertain")}


def test_an_uncertain_call_fires_its_alert_in_a_real_prometheus(scenario):
    measured, prometheus = scenario
    timeline = measured["timeline"]
    print("\nalert timeline (s after the call was cut): "
          + ", ".join(f"{step} {at:.2f}" for step, at in timeline.items()))
    # Pending was seen before firing, and both in Prometheus's own API.
    assert measured["pending"]["state"] == "pending", measured["pending"]
    assert list(timeline) == ["call cut", "uncertain recorded", "Prometheus sees it", "alert pending", "alert firing"]
    assert timeline["alert pending"] <= timeline["alert firing"]
    firing = measured["firing"]
    assert firing["labels"] == {"alertname": UNCERTAIN_ALERT, "severity": "warning"}
    assert firing["annotations"]["runbook"] == "docs/monitoring.md#atmostcalluncertain"
    assert re.fullmatch(r"A call has been uncertain for .+: check it with the provider and resolve it in the inbox",
                        firing["annotations"]["summary"]), firing["annotations"]
    # Nothing else was pending or firing at any point while the test watched.
    others = {name for _, alerts in measured["seen"] for name in alerts if name != UNCERTAIN_ALERT}
    assert others == set(), measured["seen"][-1]
    # Prometheus read both sides: the filter's report and the ledger's record of it.
    assert measured["envoy_uncertain"] == 1
    assert [s["value"][1] for s in prometheus.query("sum(atmost_uncertain)")] == ["1"]
    assert [s["value"][1] for s in prometheus.query('max(atmost_attempts{state="uncertain"})')] == ["1"]


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, query with the template variables set) of every dashboard target."""
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for name, value in DASHBOARD_VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"{p['title']}: a template variable the test does not set: {expr}"
            out.append((p["title"], t["refId"], expr))
    return out


def test_every_dashboard_query_answers_in_that_prometheus(scenario):
    _, prometheus = scenario
    queries = dashboard_queries()
    assert len(queries) >= 15

    def has_data(expr: str) -> bool:
        return any(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in prometheus.query(expr))

    for title, ref, expr in queries:
        if title in NO_DATA_EXPECTED:
            continue
        # Envoy publishes its histograms at its stats flush (every 5 s): waited for, bounded.
        wait_until(lambda: has_data(expr), 60, f"data for the panel {title!r} ({ref}): {expr}", interval=0.5)
    for title, ref, expr in queries:
        if title in NO_DATA_EXPECTED:
            assert prometheus.query(expr) == [], f"{title} ({ref}) has data, yet nothing failed: {expr}"


def test_the_approval_alert_reads_a_series_the_ledger_exports(scenario):
    """AtmostApprovalWaitingLong needs ten minutes of waiting to fire (promtool shows it
    firing, tests/prometheus/atmost-rules.test.yml); here the real Prometheus evaluates it
    healthy over the gauge the real ledger exports, 0 with nobody waiting."""
    _, prometheus = scenario
    [rule] = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]
              if r["name"] == "AtmostApprovalWaitingLong"]
    wait_until(lambda: prometheus.query("max(atmost_approval_oldest_waiting_seconds)"), 30,
               "the approval gauge scraped")
    assert rule["health"] == "ok", rule
    assert [s["value"][1] for s in prometheus.query("max(atmost_approval_oldest_waiting_seconds)")] == ["0"]
