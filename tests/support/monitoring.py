"""The shipped monitoring (monitoring/: the Prometheus rules file, the PrometheusRule made from it,
the Grafana dashboard; docs/monitoring.md) and Debian's promtool, as the checks of the rules
(tests/files/test_monitoring_rules.py) and the run in a real Prometheus
(tests/e2e/test_monitoring.py) read them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support.stack import ROOT

MONITORING = ROOT / "monitoring"
RULES = MONITORING / "atmost-rules.yml"
PROMETHEUS_RULE = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULE_TESTS = ROOT / "tests" / "prometheus" / "atmost-rules.test.yml"
DOC = ROOT / "docs" / "monitoring.md"
GEN_PROMETHEUS_RULE = ROOT / "scripts" / "gen_prometheusrule.py"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
# Dashboard queries the scenario gives no data: nothing failed and nothing was forged.
NO_DATA_EXPECTED = {"Store errors by operation", "Outcome reports refused", "Reconciler lookups by result"}


def rule_groups(path: Path = RULES) -> list[dict]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]


def alerts_of(groups: list[dict]) -> list[dict]:
    return [r for g in groups for r in g["rules"] if "alert" in r]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
